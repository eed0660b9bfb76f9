"""`ckpt validate --fix-quant-config SRC -o OUT`: only the quantization config repaired.

For a checkpoint whose MTP weights are all there but mis-declared (rule ``mtp-quant-config``), OUT is
SRC with config.json and a producer's side file (hf_quant_config.json) changed as ``quant.repair.repair_view``
says; every shard and every other file is copied or linked whole, never rewritten.

Refused (InputError, exit 3, nothing written): an input that breaks another rule (``mtp-missing`` names
``ckpt graft``), or a finding no configuration change repairs (``mtp-quant-config``, each module named).
Nothing to repair is not an error: ``FixReport.status`` is ``nothing-to-fix`` and no plan is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import __version__
from ...errors import InputError, UsageError
from ...io.checkpoint import Checkpoint, revision_of, source_name
from ...model.consistency import TRUNK_QUANT_RULE, config_path
from ...model.mtp import choose_table, open_mtp
from ...model.quant.audit import RULE, Finding, audit
from ...model.quant.block_audit import misdeclared_block
from ...model.quant.config import quant_files
from ...model.quant.repair import Repair, repair_view
from ...model.quant.report import audit_json, config_diff
from ...stream.fingerprint import record_inputs
from ...stream.plan import Plan
from ..writing.carry import carried_files

GRAFT = "`ckpt graft SOURCE {root} -o OUT` (SOURCE: the original release) writes the MTP layers anew"
HINTS = {"mtp-missing": "a config repair cannot restore missing weights: " + GRAFT}
FIXABLE = frozenset({RULE, TRUNK_QUANT_RULE})  # the rules a config change may repair (repair_view: MTP and trunk)
# what OUT does not inherit: it gets its own index and manifest
REWRITTEN = frozenset({"total-size", "index-metadata", "manifest-missing", "manifest-mismatch", "manifest-extra"})


@dataclass
class FixReport:
    path: str
    family: str
    status: str  # fixed | nothing-to-fix (a dry run says what it would write: fixed, written False)
    scheme: str | None = None
    link: str = "copy"
    out: str | None = None
    written: bool = False
    repair: Repair | None = None
    diff: list[dict] = field(default_factory=list)  # [{file, field, added, removed}]
    changed_files: list[str] = field(default_factory=list)
    linked_files: list[str] = field(default_factory=list)  # shards copied or linked whole
    carried_files: list[str] = field(default_factory=list)
    modules: dict | None = None  # the audit of the repaired configuration (quant.report.audit_json)
    validation: dict | None = None

    def to_json(self) -> dict:
        rep = self.repair.to_json() if self.repair is not None else {"changes": [], "fixed": [], "unfixable": []}
        return {
            "path": self.path, "out": self.out, "family": self.family, "scheme": self.scheme, "status": self.status,
            "written": self.written, "link": self.link, "diff": self.diff, "changes": rep["changes"],
            "fixed": rep["fixed"], "changed_files": self.changed_files, "linked_files": self.linked_files,
            "carried_files": self.carried_files, "audit": self.modules,
            **({"validation": self.validation} if self.validation is not None else {}),
        }


def plan_fix(ckpt: Checkpoint, *, arch: str | None = None, link: str = "copy", command: str = "ckpt validate "
             "--fix-quant-config") -> tuple[Plan | None, FixReport]:
    """The plan that writes ``ckpt`` with its quantization config repaired (None: nothing to repair)."""
    from ..writing.carry import LINK_MODES, untouched_file
    from ..writing.output_config import config_files

    if link not in LINK_MODES:
        raise UsageError(f"--link {link!r}: use one of {', '.join(LINK_MODES)}")
    if link == "remote" and ckpt.local_dir is not None:
        raise UsageError("--link remote needs an hf:// checkpoint (its shards stay on the Hub)")
    source = ckpt
    ckpt, block = _block_repaired(ckpt, arch)  # a declared block the stored scales all disagree with, set right
    _refuse_other_problems(ckpt, arch)
    view = open_mtp(ckpt, choose_table(ckpt, arch))
    repair = repair_view(view)
    before = audit(view)
    report = FixReport(ckpt.root, view.table.family, "nothing-to-fix", link=link, repair=repair,
                       scheme=before.scheme.name if before.scheme is not None else None)
    if repair.unfixable:
        raise _unfixable(ckpt, repair.unfixable, _in_mtp(view))
    if block is not None:
        declared, fitting, key = block
        repair.fixed.insert(0, Finding(f"quantization_config.{key}", f"{list(declared)} disagreed with the stored "
                                       f"scale grids; set to {list(fitting)}, the block all of them have"))
    if not repair.changed and block is None:
        report.modules = audit_json(before)
        return None, report
    report.status = "fixed"
    report.modules = audit_json(repair.after) if repair.after is not None else audit_json(before)
    changed = {"config.json": ckpt.config.raw, **repair.files} if block is not None else repair.files
    report.diff = config_diff(quant_files(source), changed)
    report.changed_files = sorted(changed)
    files = config_files(source, ckpt.config.raw if block is not None else source.config.raw, repair)
    ckpt = source
    replaced = {f.name for f in files}
    wm = ckpt.index["weight_map"] if ckpt.index else None
    for shard, keys in ckpt.shard_keys.items():
        listed = {k: ckpt.tensors[k].nbytes for k in keys if wm is None or wm.get(k) == shard}
        files.append(untouched_file(ckpt, shard, link, listed))
        report.linked_files.append(shard)
    carried = [f for f in carried_files(ckpt) if f.name not in replaced]
    report.carried_files = [f.name for f in carried]
    manifest = {"kind": "quant-config-fixed", "source": {"path": source_name(ckpt), "revision": revision_of(ckpt)},
                "family": report.family, "quant_config": repair.to_json(), "tool_version": __version__}
    plan = Plan(command, [], files + carried, manifest=manifest)
    if ckpt.index is None:  # one file, copied whole: the writer lists it in an index (as stitch does)
        plan.single_file_name = next(iter(ckpt.shard_keys))
    record_inputs(plan, source=ckpt)
    return plan, report


def _block_repaired(ckpt: Checkpoint, arch: str | None) -> tuple[Checkpoint, tuple | None]:
    """``ckpt`` with its configuration's block set to the one every stored scale grid has, when the declared one
    fits none of them (``misdeclared_block``: rule ``BLOCK_SIZE_RULE``), and what was wrong; else ``ckpt``, None."""
    from dataclasses import replace

    wrong = misdeclared_block(ckpt, open_mtp(ckpt, choose_table(ckpt, arch)).codec)
    if wrong is None:
        return ckpt, None
    _, fitting, key = wrong
    return replace(ckpt, config=ckpt.config.with_values({f"quantization_config.{key}": list(fitting)})), wrong


def _refuse_other_problems(ckpt: Checkpoint, arch: str | None) -> None:
    """OUT must pass validate and only the config changes: any other problem of the input is refused."""
    from ..check.validate import validate

    problems = [p for p in validate(ckpt, arch).problems if p.rule not in FIXABLE and p.rule not in REWRITTEN]
    if not problems:
        return
    first = problems[0]
    hint = HINTS.get(first.rule, "").format(root=ckpt.root)
    hint = f"; {hint}" if hint and "ckpt graft" not in first.message else ""
    others = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    key = f"{first.key}: " if first.key else ""
    raise InputError(f"{key}{first.message}{others}{hint}. --fix-quant-config changes only the quantization config "
                     f"of a checkpoint that is otherwise valid; `ckpt validate {ckpt.root}` lists every problem. "
                     "Nothing was written", rule=first.rule, path=first.path or ckpt.root)


def _in_mtp(view) -> set[str]:
    """The MTP modules of ``view`` and their parents (a fused engine name sits beside its shards)."""
    modules = {s.key.removesuffix(".weight") for s in view.present}
    return modules | {m.rpartition(".")[0] for m in modules}


def _unfixable(ckpt: Checkpoint, findings: list[Finding], mtp: set[str]) -> InputError:
    shown = "; ".join(f"{f.key}: {f.message}" for f in findings[:5])
    more = f" (and {len(findings) - 5} more)" if len(findings) > 5 else ""
    return InputError(
        f"{len(findings)} module(s) need more than the config change --fix-quant-config makes ({shown}){more}. "
        f"Correct the config by hand or rewrite the weights: re-quantize them, or (MTP) {GRAFT.format(root=ckpt.root)}."
        " Nothing was written",
        rule=RULE if any(f.key in mtp or f.key.rpartition(".")[0] in mtp for f in findings) else TRUNK_QUANT_RULE,
        path=config_path(ckpt))
