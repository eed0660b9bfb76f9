"""`ckpt validate`: every problem a checkpoint has, each with its rule, file and key.

The checks are the consistency gate's own: validate runs every check of the one rule set
(``model.rules.RULE_SET``), the gate the ones that refuse, so what validate calls valid no verb refuses
for the same reason (but a verb needing a whole model given an MTP draft: the ``draft`` note). Nothing
stops at the first problem: the safetensors format of every shard (the strict reader's rules), the index
against the files, then config against tensors and a complete trunk (docs/integrity.md lists every
rule). Notes (``copy-absent``, ``optional-absent``, ``draft``) are not problems: ``ok`` stays true.

``validate(path_or_checkpoint, arch=None) -> ValidationReport`` raises ``InputError`` (exit 3) only when
the path is not a checkpoint at all.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import CkptError, InputError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint, open_lenient
from ...model import consistency, rules
from ...model.consistency import Problem, config_path
from ...model.mtp import choose_table, open_mtp

if TYPE_CHECKING:
    from ...stream.writer import PendingOutput

VALID_FORMATS = rules.VALID_FORMATS
FILE_RULES = rules.OPEN_RULES  # rules that come from opening files (recognised on a strict, remote open)
MAX_LISTED = consistency.MAX_LISTED
__all__ = ["Problem", "ValidationReport", "validate", "validate_output", "bare_message"]


@dataclass
class ValidationReport:
    root: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[Problem] = field(default_factory=list)  # worth knowing, not wrong (ok stays true)
    family: str | None = None
    mtp_layers: int | None = None
    files_checked: int = 0
    tensors_checked: int = 0
    reader: str = "safetensors"  # what the weights were read from (a draft reader: torch, dcp)
    reader_notes: list[str] = field(default_factory=list)
    draft_format: str | None = None  # a renamed draft (speculators, angelspec, ...): checked as such
    mtp_quant: dict | None = None  # per MTP module: stored vs declared (quant.report.audit_json); quantized only

    @property
    def ok(self) -> bool:
        return not self.problems

    def rules(self) -> set[str]:
        return {p.rule for p in self.problems}

    def add(self, rule: str, path: str | os.PathLike | None, key: str | None, message: str) -> None:
        self.problems.append(Problem(rule, str(path) if path is not None else None, key, message))

    def extend(self, problems: list[Problem]) -> None:
        self.problems += problems

    def to_json(self) -> dict:
        """Stable keys: path, ok, family, mtp_layers, checked{files,tensors}, counts{rule: n}, problems[], notes[],
        mtp_quant (null, or the per-MTP-module quantization audit: see ops/inspect/inspect.py ``mtp_quant``)."""
        return {
            "path": self.root,
            "ok": self.ok,
            "family": self.family,
            "mtp_layers": self.mtp_layers,
            "checked": {"files": self.files_checked, "tensors": self.tensors_checked},
            "reader": self.reader,
            "reader_notes": self.reader_notes,
            "draft_format": self.draft_format,
            "counts": dict(sorted(Counter(p.rule for p in self.problems).items())),
            "problems": [p.to_json() for p in self.problems],
            "notes": [n.to_json() for n in self.notes],
            "mtp_quant": self.mtp_quant,
        }


def bare_message(e: CkptError) -> str:
    """The message of ``e`` without the ``path: [rule]`` prefix CkptError adds."""
    s = str(e)
    if e.path:
        s = s.removeprefix(f"{e.path}: ")
        if e.rule:
            s = s.removeprefix(f"[{e.rule}]: ")
    elif e.rule:
        s = s.removeprefix(f"[{e.rule}] ")
    return s


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def validate(path_or_checkpoint: str | os.PathLike | Checkpoint, arch: str | None = None, *,
             pending: PendingOutput | None = None) -> ValidationReport:
    """Check a checkpoint (a local path, an ``hf://`` URL or an opened ``Checkpoint``).

    ``pending``: an output the writer has not marked complete yet, checked as it will be.
    """
    unreadable: list[str] = []
    if isinstance(path_or_checkpoint, Checkpoint):
        ckpt = path_or_checkpoint
        report = ValidationReport(ckpt.root)
    elif "://" in str(path_or_checkpoint):
        report = ValidationReport(str(path_or_checkpoint))
        try:
            ckpt = Checkpoint.open(path_or_checkpoint)  # remote: strict, so the first file problem is all we get
        except InputError as e:
            if e.rule not in FILE_RULES:
                raise
            report.add(e.rule, e.path, None, bare_message(e))
            return report
    else:
        opened = open_lenient(path_or_checkpoint, index=pending.index if pending else None,
                              renamed=pending.renamed if pending else None,
                              manifest=pending.manifest if pending else None)
        ckpt, unreadable = opened.ckpt, opened.unreadable
        report = ValidationReport(ckpt.root)
        remote = set((ckpt.manifest or {}).get("remote_files") or {})
        for e in opened.errors:
            if e.rule == "missing-shard" and e.path and os.path.basename(e.path) in remote:
                continue  # left on the Hub on purpose (stitch --link remote); push --base copies it
            report.add(e.rule or "unreadable", e.path, None, bare_message(e))
    try:
        report.files_checked = len(ckpt.headers) + len(unreadable)
        report.tensors_checked = sum(len(h.tensors) for h in ckpt.headers.values())
        if ckpt.reader != "safetensors":  # a draft reader checked every tensor's dtype, shape and bytes on opening
            report.reader, report.reader_notes = ckpt.reader, list(ckpt.reader_notes)
            report.files_checked = sum(len(getattr(src, "paths", ())) or 1 for src in ckpt.sources.values())
            report.tensors_checked = len(ckpt.tensors)
        ctx = _file_checks(ckpt, unreadable, report, pending)
        config_broken = bool({"config-json", "config-field"} & report.rules())  # so far: only from reading it
        _config_checks(ckpt, arch, ctx, config_broken, report, notes=pending is None)
    finally:
        if ckpt is not path_or_checkpoint:
            ckpt.close()
    return report


# -- the rule set's checks, and what only validate reports -----------------------------------------------


def _file_checks(ckpt: Checkpoint, unreadable: list[str], report: ValidationReport,
                 pending: PendingOutput | None = None) -> rules.Context:
    """The rule set's files stage, every check; the context the model stage goes on with."""
    unknown = consistency.unknown_keys(ckpt, unreadable)
    ctx = rules.Context(ckpt, consistency.Holders(ckpt), unknown, list(unreadable),
                        checked=pending.checked if pending else frozenset())
    report.extend(rules.run(ctx, "files", refusing_only=False))
    return ctx


def _config_checks(ckpt: Checkpoint, arch: str | None, ctx: rules.Context, config_broken: bool,
                   report: ValidationReport, *, notes: bool = True) -> None:
    """The rule set's model stage, every check (those needing the table skipped when it cannot be told); with
    ``notes``, what the report shows beside the problems (notes, the MTP quantization audit): the writer's check
    of an output reads only the problems."""
    cfg = config_path(ckpt)
    draft_format = None if config_broken or arch else consistency.renamed_format(ckpt)
    if draft_format is not None:
        # a renamed draft has no architecture table of its own: its manifest is the reference
        report.draft_format = draft_format
        report.family = (ckpt.manifest or {}).get("family")
        layers = (ckpt.manifest or {}).get("layers")
        report.mtp_layers = len(layers) if isinstance(layers, list) else None
        return

    def as_problem(e: CkptError) -> Problem:
        return Problem(e.rule or "config", e.path if e.path and e.path != ckpt.root else cfg, None, bare_message(e))

    ctx.config = None if config_broken or not ckpt.config_present else cfg
    if not config_broken:
        try:
            ctx.table = choose_table(ckpt, arch)
            ctx.view = open_mtp(ckpt, ctx.table)
        except CkptError as e:
            report.problems.append(as_problem(e))
    view = ctx.view
    if view is not None:
        report.family, report.mtp_layers = view.table.family, view.count
    # a config value the trunk's expressions cannot use fails that check only: the others still run
    report.extend(rules.run(ctx, "model", refusing_only=False, on_error=lambda _check, e: [as_problem(e)]))
    if view is not None and notes:
        try:
            report.notes += consistency.absent_notes(view)
            if consistency.trunk_exempt(view):
                report.notes.append(Problem(
                    "draft", cfg, None, "no tensor of the main model (decoder layers, embedding, final norm, head)"
                    + (" and a draft manifest" if (ckpt.manifest or {}).get("kind") == "mtp-draft" else "")
                    + ": checked as an MTP draft; the trunk rules apply to whole models (stitch refuses it as a "
                    "verifier)"))
            report.mtp_quant = _mtp_quant(view)
        except CkptError as e:
            report.problems.append(as_problem(e))


def _mtp_quant(view) -> dict | None:
    """The audit behind rule mtp-quant-config, per module (headers only: cheap); None when unquantized."""
    from ...model.quant.audit import audit
    from ...model.quant.report import audit_json

    result = audit(view)
    return audit_json(result) if result.modules and (result.scheme is not None or result.unknown) or \
        result.findings else None


def validate_output(path: str | os.PathLike, *, arch: str | None = None, allow: Iterable[str] = (),
                    pending: PendingOutput | None = None) -> dict:
    """Validate an output this tool is writing (the writer's check, before its completion marker).

    An invalid output is an output error (exit 4) with the first problem's rule. ``allow``: rules the
    user let through on the input (``--allow-invalid``); an output that carries them is not refused
    for them, and the result lists them under ``allowed``.
    """
    from ...errors import OutputError

    report = validate(path, arch, pending=pending)
    allowed = [p for p in report.problems if p.rule in set(allow)]
    problems = [p for p in report.problems if p.rule not in set(allow)]
    if problems:
        raise OutputError(f"the output failed validation ({len(problems)} problem(s)): "
                          f"{consistency.problems_text(problems)}", rule=problems[0].rule, path=str(path))
    out = {"ok": True, "problems": 0, "family": report.family}
    if allowed:
        out["allowed"] = [p.to_json() for p in allowed]
    return out
