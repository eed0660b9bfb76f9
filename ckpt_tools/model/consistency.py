"""The consistency gate: whether a checkpoint can be used safely, decided before anything is planned.

``require_consistent`` refuses (exit 3) a checkpoint that breaks a refusing rule, naming the first
problem's file, key and rule, how many others there are, and the two ways on (``ckpt validate PATH``
lists them all; ``--allow-invalid RULE`` proceeds anyway); ``check`` returns the problems instead.
The rules are the refusing checks of the one rule set (``model.rules.RULE_SET``); this module holds
their checks: index and files, config vs tensors, a complete trunk (an MTP draft exempt, ``is_draft``),
and the notes for optional tensors left out (``absent_notes``). docs/integrity.md lists every rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError, UsageError
from ..io.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint
from ..io.safetensors_io import LocalFile, read_header
from .expert_layouts import MIXED_DESCRIPTION, MIXED_RULE, ExpertGroup, mixed_layout_keys, mixed_layout_message
from .expr import ExprError, render
from .mtp import MtpView, QuantLookup, detect_group_layout
from .problem import Problem
from .quant.agree import DESCRIPTION as AGREE_DESCRIPTION
from .quant.agree import RULE as AGREE_RULE
from .quant.codec import checkpoint_codec
from .quant.kv_scales import DESCRIPTION as KV_SCALE_DESCRIPTION
from .quant.kv_scales import RULE as KV_SCALE_RULE
from .quant.patterns import DESCRIPTION as PATTERN_DESCRIPTION
from .quant.patterns import RULE as PATTERN_RULE
from .quant.scale_values import DESCRIPTION as SCALE_VALUE_DESCRIPTION
from .quant.scale_values import RULE as SCALE_VALUE_RULE
from .stored_dtype import DESCRIPTION as STORED_DTYPE_DESCRIPTION
from .stored_dtype import RULE as STORED_DTYPE_RULE
from .tables.resolve import trunk_specs

if TYPE_CHECKING:
    from .tables.schema import Table

MAX_LISTED = 20  # keys named in one message before "..."

MTP_RULES = ("mtp-missing", "mtp-misshaped", "mtp-beyond", "mtp-extra")
TRUNK_RULES = ("trunk-missing", "trunk-misshaped")
# Every rule the gate refuses on, and what proceeding with --allow-invalid RULE means.
RULES: dict[str, str] = {
    "index-empty": "the index maps no tensor at all",
    "unindexed-shard": "a .safetensors file no index entry names; its tensors are not read",
    "unindexed-key": "a shard holds a key the index does not map to it; such keys are never carried",
    "duplicate-tensor": "a key held by two files; the indexed copy is used",
    "single-file-shadows-index": "model.safetensors beside an index naming other files; the index is used",
    "mtp-missing": "the config declares MTP tensors that are absent",
    "mtp-misshaped": "an MTP tensor has another shape than the table says",
    "mtp-beyond": "MTP tensors past the count the config declares",
    "mtp-extra": "tensors in the MTP namespace the table does not know",
    "fp8-scale-missing": "an FP8 weight without its block scale",
    "fp8-scale-shape": "a block scale of the wrong shape",
    "fp8-block-size": "the declared block (weight_block_size) is neither two positive integers nor null, or the "
                      "stored scale grids all have another block (the config is wrong: --fix-quant-config)",
    "quant-config": "FP8 tensors and quantization_config disagree",
    "mtp-quant-config": "an MTP module is stored otherwise than the quantization config declares it (not excluded, "
                        "excluded, fused names missed, scales missing)",
    "tied-head": "the config ties the head while the checkpoint ships one",
    "trunk-missing": "a tensor of the embedding, head, final norm or a decoder layer is absent",
    "trunk-misshaped": "a trunk tensor has another shape than the table says",
    STORED_DTYPE_RULE: STORED_DTYPE_DESCRIPTION,
    SCALE_VALUE_RULE: SCALE_VALUE_DESCRIPTION,
    PATTERN_RULE: PATTERN_DESCRIPTION,
    MIXED_RULE: MIXED_DESCRIPTION,
    "trunk-quant-config": "a main-model module is stored otherwise than the quantization config declares it "
                          "(quantized but excluded, float but targeted, scales missing or mis-shaped)",
    # a module's declared arguments against its stored tensors (quant/storage.py issues; docs/integrity.md)
    "quant-zero-point": "a zero point a symmetric scheme never reads, or an asymmetric one's missing or mis-shaped",
    "quant-group-size": "a group size that does not divide the weight's columns (a partial last group)",
    "quant-actorder": "an activation order (actorder group, weight_g_idx) the consumers refuse or never read",
    "quant-group-order": "two config groups target a module and compressed-tensors and vLLM pick different ones",
    AGREE_RULE: AGREE_DESCRIPTION,
    KV_SCALE_RULE: KV_SCALE_DESCRIPTION,
}
REPORT_ONLY = frozenset({"total-size", "index-metadata", "metadata-format", "manifest-missing", "manifest-mismatch",
                         "manifest-extra"})


@dataclass
class Gate:
    """What the gate found out on the way: the table and MTP view (verbs plan with them)."""

    table: Table | None
    view: MtpView | None
    allowed: list[Problem] = field(default_factory=list)  # let through by --allow-invalid
    waived: list[Problem] = field(default_factory=list)  # repaired by the verb itself


def parse_allow(rules: Iterable[str] | None) -> frozenset[str]:
    """The rules of ``--allow-invalid RULE`` options; an unknown name is a usage error listing the valid ones."""
    out = frozenset(r.strip() for r in rules or ())
    unknown = sorted(out - set(RULES))
    if unknown:
        raise UsageError(f"--allow-invalid {', '.join(map(repr, unknown))}: not a rule the consistency check "
                         f"refuses on; use one of {', '.join(RULES)}")
    return out


# -- index and files ------------------------------------------------------------------


def index_path(ckpt: Checkpoint) -> str:
    return str(ckpt.local_dir / INDEX_NAME) if ckpt.local_dir else f"{ckpt.root}/{INDEX_NAME}"


def shard_path(ckpt: Checkpoint, name: str) -> str:
    src = ckpt.sources.get(name)
    if src is not None:
        return src.name
    return str(ckpt.local_dir / name) if ckpt.local_dir else f"{ckpt.root}/{name}"


class Holders:
    """Which opened shards hold each key. Built with set operations: only keys held twice get a list."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.keys: set[str] = set()
        total = 0
        for keys in ckpt.shard_keys.values():
            self.keys.update(keys)
            total += len(keys)
        self.twice: dict[str, list[str]] = {}
        if total != len(self.keys):  # rare: find the keys held by several files
            seen: dict[str, list[str]] = {}
            for name, keys in ckpt.shard_keys.items():
                for k in keys:
                    seen.setdefault(k, []).append(name)
            self.twice = {k: names for k, names in seen.items() if len(names) > 1}
        self._shards = ckpt.shard_keys

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def first(self, key: str) -> str:
        """A shard holding ``key`` (for messages; a scan, so call it for problems only)."""
        return next(name for name, keys in self._shards.items() if key in keys)


def unknown_keys(ckpt: Checkpoint, unreadable: Iterable[str]) -> set[str]:
    """Keys whose presence cannot be known: the index maps them to a shard that could not be read."""
    bad = set(unreadable)
    return {k for k, s in ckpt.index["weight_map"].items() if s in bad} if ckpt.index is not None and bad else set()


def index_problems(ckpt: Checkpoint, holders: Holders | None = None) -> list[Problem]:
    """Index vs the shards it names: empty map, keys held twice, keys the index does not map where they are."""
    out: list[Problem] = []
    holders = Holders(ckpt) if holders is None else holders
    for key, names in holders.twice.items():
        out.append(Problem("duplicate-tensor", shard_path(ckpt, names[1]), key,
                           f"held by {len(names)} files: {', '.join(names)}; loaders that read every indexed "
                           "file (vLLM) load both copies"))
    index = ckpt.index
    if index is None:
        return out
    wmap: dict[str, str] = index["weight_map"]
    if not wmap:
        out.append(Problem("index-empty", index_path(ckpt), None,
                           "weight_map is empty: the index names no tensor, so loaders load nothing"))
    if len(ckpt.tensors) != len(wmap):  # every entry found its tensor otherwise (a strict open ensures it)
        for key, shard in wmap.items():
            if shard in ckpt.headers and key not in ckpt.headers[shard].tensors:
                out.append(Problem("index-key-missing", index_path(ckpt), key,
                                   f"index maps it to {shard}, which does not hold it"))
    for name, keys in ckpt.shard_keys.items():
        if set(map(wmap.get, keys)) <= {name}:
            continue  # the common case: every key mapped to this shard (checked at C speed)
        for k in keys:
            mapped = wmap.get(k)
            if mapped is None:
                out.append(Problem("unindexed-key", shard_path(ckpt, name), k,
                                   f"{name} holds it but the index does not list it; index-driven loaders never "
                                   "see it"))
            elif mapped != name and mapped in ckpt.headers and k not in ckpt.headers[mapped].tensors:
                out.append(Problem("unindexed-key", shard_path(ckpt, name), k,
                                   f"{name} holds it but the index maps it to {mapped}"))
            # mapped elsewhere and held there too: a duplicate, reported above; mapped to a missing or
            # unreadable shard: reported with that shard
    return out


def _weight_files(ckpt: Checkpoint) -> Iterator[tuple[str, str, object]]:
    """(name, display path, opener) of every top-level ``.safetensors`` file beside the checkpoint's own.

    Local directories are listed; a Hub source uses the repository's file list.
    """
    d = ckpt.local_dir
    if d is not None:
        if not Path(d).is_dir():
            return
        for p in sorted(Path(d).glob("*.safetensors")):
            if not p.name.startswith("."):
                yield p.name, str(p), lambda p=p: LocalFile(p)
        return
    sizes = getattr(ckpt, "file_sizes", None)  # checkpoint.RemoteCheckpoint
    if not sizes:
        return
    for name in sorted(n for n in sizes if n.endswith(".safetensors") and "/" not in n and not n.startswith(".")):
        yield name, f"{ckpt.root}/{name}", lambda n=name: ckpt.open_file(n)


def stray_problems(ckpt: Checkpoint, holders: Holders | None = None) -> list[Problem]:
    """``.safetensors`` files the index does not name: stale copies (duplicate-tensor) or left-out shards."""
    out: list[Problem] = []
    holders = Holders(ckpt) if holders is None else holders
    referenced = set(ckpt.headers) | (set(ckpt.index["weight_map"].values()) if ckpt.index else set())
    where = f"{INDEX_NAME} does not name it" if ckpt.index is not None else f"there is no {INDEX_NAME} naming it"
    for name, path, opener in _weight_files(ckpt):
        if name == SINGLE_NAME and ckpt.index is not None and referenced != {SINGLE_NAME}:
            out.append(Problem("single-file-shadows-index", path, None,
                               f"{SINGLE_NAME} sits next to {INDEX_NAME}, which references other files; "
                               f"transformers loads {SINGLE_NAME} alone and ignores the index"))
            continue
        if name in referenced:
            continue
        try:
            src = opener()
            try:
                keys = list(read_header(src).tensors)
            finally:
                getattr(src, "close", lambda: None)()
        except InputError as e:
            out.append(Problem("unindexed-shard", path, None, f"{where}, and it cannot be read ({e.rule or 'error'}); "
                                                              "remove it or repair and index it"))
            continue
        dups = sorted(k for k in keys if k in holders)
        out += [Problem("duplicate-tensor", path, k, f"stale copy: also held by {holders.first(k)}; {name} is not in "
                        "the index, but tools that glob *.safetensors load both") for k in dups[:MAX_LISTED]]
        own = sorted(k for k in keys if k not in holders)
        if own:
            shown = ", ".join(own[:5]) + (" ..." if len(own) > 5 else "")
            out.append(Problem("unindexed-shard", path, own[0],
                               f"{where}, so loaders and every ckpt command ignore its {len(own)} tensor(s) "
                               f"({shown}); add it to the index (or remove it)"))
    return out


# -- config vs tensors -------------------------------------------------------------------


def config_path(ckpt: Checkpoint) -> str:
    return str(ckpt.local_dir / "config.json") if ckpt.local_dir else f"{ckpt.root}/config.json"


def file_of(ckpt: Checkpoint, key: str) -> str | None:
    ref = ckpt.tensors.get(key)
    return ref.file if ref is not None else None


def renamed_format(ckpt: Checkpoint) -> str | None:
    """The draft format of ``ckpt`` when it is a renamed draft (speculators, angelspec, ...), else None."""
    from .formats import detect_format

    fmt = detect_format(ckpt.config.raw, ckpt.manifest, ckpt.tensors)
    return None if fmt.rename == "native" else fmt.name


def count_field(view: MtpView) -> str:
    """The config key that declares the MTP count (for messages)."""
    table = view.table
    var = table.config.get(table.mtp.count_field or "")
    if var is None:
        return "the MTP count"
    return next((k for k in var.keys if view.ckpt.config.has(k)), var.keys[0])


def _mixed(view: MtpView) -> list[tuple[ExpertGroup, dict[str, str]]]:
    """Every expert group of the trunk and of the MTP layers, in the layout on disk, with the tensors of another
    layout it holds beside it (``expert_layouts.mixed_layout_keys``)."""
    tensors = view.ckpt.tensors

    def on_disk(g: ExpertGroup) -> ExpertGroup:
        names = g.columns()[0]
        if names[0] in tensors and names[-1] in tensors:  # stored as shipped (trunk-* judge whether completely)
            return g
        lay = detect_group_layout(g, tensors)
        return g if lay == g.layout else g.with_layout(lay)

    groups = [on_disk(g) for g in trunk_specs(view.resolved)[1]] + view.groups()
    return [(g, found) for g in groups if (found := mixed_layout_keys(g, tensors))]


def mixed_layout_problems(view: MtpView, unknown: set[str] = frozenset()) -> list[Problem]:
    """``expert-layouts-mixed``: a routed-expert group (trunk or MTP) holding a second layout's tensors; the rule
    fuse-experts and unfuse-experts refuse it by (model.experts.check_group), so validate and every gate agree."""
    return [Problem(MIXED_RULE, file_of(view.ckpt, key), key, mixed_layout_message(g, layout))
            for g, found in _mixed(view) for key, layout in sorted(found.items()) if key not in unknown]


def mtp_problems(view: MtpView, unknown: set[str] = frozenset()) -> list[Problem]:
    ckpt = view.ckpt
    cfg = config_path(ckpt)
    field_name = count_field(view)
    declared = f"config declares {view.count} MTP layer(s) ({field_name}, {view.table.family})"
    # no MTP weight at all: what quantizers that drop MTP leave behind
    fix = (f"; quantizer dropped MTP? `ckpt graft SOURCE {ckpt.root} -o OUT` restores it from the original release"
           if not view.present else "")
    out: list[Problem] = []
    for s in view.missing:
        if s.key in unknown or s.role == "scale":  # a quantized weight's companion: rule mtp-quant-config
            continue
        where = f"depth {s.depth}" if s.depth is not None else "shared by every depth"
        out.append(Problem("mtp-missing", cfg, s.key, f"{declared} but this {s.role} tensor {list(s.shape)} "
                                                      f"({where}) is missing (a release without MTP weights sets "
                                                      f"{field_name} to 0){fix}"))
    for s, actual in view.misshaped:
        if s.role == "scale":
            continue  # FP8 scales are checked for every weight, with the config's block size
        # a matrix stored transposed (a release has shipped one: see the table's comments)
        turned = (" (stored transposed: engines load it as the table says; transpose it back)"
                  if len(actual) == 2 and tuple(actual) == tuple(s.shape)[::-1] else "")
        out.append(Problem("mtp-misshaped", file_of(ckpt, s.key), s.key,
                           f"shape {list(actual)}, but the {view.table.family} table expects {list(s.shape)}"
                           + turned))
    out += [Problem("mtp-misshaped", file_of(ckpt, view.quantized[k].all_keys()[0]), k, msg)
            for k, msg in view.quant_problems]
    out += [Problem("mtp-beyond", file_of(ckpt, k), k, f"{declared} but this tensor belongs to an MTP layer past that "
                    f"count; set {field_name} to match the weights, or drop the tensors (`ckpt extract --drop-mtp`)")
            for k in view.beyond]
    mixed = {k for _, found in _mixed(view) for k in found} if view.extra else set()
    for k in view.extra:
        if k in mixed:
            continue  # another expert layout's tensor: rule expert-layouts-mixed names it
        out.append(Problem("mtp-extra", file_of(ckpt, k), k,
                           f"inside the MTP namespace but not a tensor of the {view.table.family} table"))
    return out


def absent_notes(view: MtpView) -> list[Problem]:
    """Notes, not problems: optional MTP tensors the checkpoint leaves out (``optional: true`` in the table).

    In every table these are per-layer embed / head copies whose engines take the trunk's tensor
    when the copy is absent (GLM-4.6 and later ship without them, SGLang's NextN export drops them
    from DeepSeek-V3); no rule of the gate refuses their absence.
    """
    cfg = config_path(view.ckpt)
    out: list[Problem] = []
    ckpt = view.ckpt
    if view.count == 0 and not view.beyond and (ckpt.config.get("quantization_config") is not None
                                                 or "hf_quant_config.json" in ckpt.files):
        out.append(Problem("mtp-none", cfg, None,
                           f"a quantized {view.table.family} checkpoint without MTP layers ({count_field(view)} is 0); "
                           f"if its release ships them, the quantizer dropped them: `ckpt graft SOURCE {ckpt.root} "
                           "-o OUT` restores them"))
    for s in view.optional_absent:
        where = f"MTP depth {s.depth}" if s.depth is not None else "the MTP layers"
        source = view.resolved.shared_source(s.copy_of) if s.copy_of else None
        if source is not None:
            what = "embedding" if s.role == "embed" else "LM head"
            out.append(Problem("copy-absent", cfg, s.key,
                               f"{where} has no per-layer copy of the {what}; optional in the {view.table.family} "
                               f"table: its engines take the trunk's {source.key}"))
        else:
            out.append(Problem("optional-absent", cfg, s.key,
                               f"absent from {where}; optional in the {view.table.family} table"))
    return out


def tied_head_problems(view: MtpView) -> list[Problem]:
    res = view.resolved
    head = res.table.shared.get("head")
    if head is None or head.when is None or "head" in res.shared:
        return []
    try:
        key = render(head.key, res.env)
    except ExprError:
        return []
    if key not in view.ckpt.tensors:
        return []
    return [Problem("tied-head", file_of(view.ckpt, key), key,
                    f"the config ties the head to the embedding (tie_word_embeddings), so loaders ignore this "
                    f"tensor; set tie_word_embeddings: false or drop {key}")]


def is_draft(view: MtpView, trunk_keys: Iterable[str] = ()) -> bool:
    """An MTP-only checkpoint, exempt from the trunk rules: our draft manifest says so, or it holds no
    tensor of the main model at all - no decoder layer's (``trunk_keys``) and no shared embedding, final
    norm or head. Holding any of them makes it a model missing the rest: an embed + norm + head + MTP
    checkpoint is a trunk without layers, not a draft (a draft carrying the embedding or head says so
    in its manifest, as `ckpt extract --with-embed` writes it)."""
    if (view.ckpt.manifest or {}).get("kind") == "mtp-draft":
        return True
    tensors = view.ckpt.tensors
    shared = [s.key for s in view.resolved.shared.values()]
    return not any(k in tensors for k in shared) and not any(k in tensors for k in trunk_keys)


def trunk_exempt(view: MtpView) -> bool:
    """The trunk rules do not apply to ``view``'s checkpoint (a draft) unless a whole model is required."""
    return is_draft(view, (s.key for s in trunk_specs(view.resolved)[0]))


def trunk_problems(view: MtpView, unknown: set[str] = frozenset(), *, whole_model: bool = False) -> list[Problem]:
    """The shared tensors and every decoder layer the table requires, each present with its shape.

    ``whole_model``: check even a checkpoint that holds no trunk layer at all (a draft otherwise).
    """
    ckpt, res = view.ckpt, view.resolved
    specs, groups = trunk_specs(res)
    if not whole_model and is_draft(view, (s.key for s in specs)):
        return []
    expected = [s for s in res.shared.values() if not s.optional] + [s for s in specs if not s.optional]
    tensors = ckpt.tensors
    quant = QuantLookup(ckpt, checkpoint_codec(ckpt, res.table.quantization))
    for g in groups:  # routed experts in the layout found on disk (the shipped one, checked first, is usual)
        names, shapes = g.columns()
        refs = list(map(tensors.get, names))  # one C-level pass per group (768 tensors a layer in a release)
        if None not in refs and tuple(r.shape for r in refs) == shapes:
            continue  # complete as shipped
        lay = detect_group_layout(g, tensors)
        on_disk = g if lay == g.layout else g.with_layout(lay)
        if quant.alike(on_disk) is None:  # else quantized alike, every companion present and shaped: complete
            expected += on_disk.tensors()
    out: list[Problem] = []
    cfg = config_path(ckpt)
    for s in expected:
        ref = ckpt.tensors.get(s.key)
        if ref is None or tuple(ref.shape) != tuple(s.shape):
            st = quant.storage(s, ref)  # a quantized weight stored under other names or packed
            if st is not None:
                out += [Problem("trunk-missing", cfg, k, f"{st.label} weight {s.key} without this tensor")
                        for k in st.missing if k not in unknown]
                out += [Problem("trunk-misshaped", file_of(ckpt, st.all_keys()[0]), s.key, p) for p in st.problems]
                continue
        if ref is None:
            if s.key not in unknown:
                out.append(Problem("trunk-missing", cfg, s.key,
                                   f"the {res.family} table requires this tensor {list(s.shape)} of the main model, "
                                   "and no shard holds it"))
        elif tuple(ref.shape) != tuple(s.shape):
            out.append(Problem("trunk-misshaped", ref.file, s.key,
                               f"shape {list(ref.shape)}, but the {res.family} table expects {list(s.shape)} "
                               "for this config"))
    return out


def quant_config_problems(view: MtpView, unknown: set[str] = frozenset()) -> list[Problem]:
    """``mtp-quant-config``: every MTP module stored as the quantization config declares it (quant.audit)."""
    from .quant.audit import RULE, audit

    cfg = config_path(view.ckpt)
    fix = f"; `ckpt validate --fix-quant-config {view.ckpt.root} -o OUT` repairs the config"
    # no config change can fix it (missing scales, fused shards stored differently): the weights must change
    weights = (f"; a config change cannot fix this: re-quantize the MTP layers, or `ckpt graft SOURCE "
               f"{view.ckpt.root} -o OUT` writes them anew from the original release")
    # a finding a config change could fix that the repair still cannot (a per-module list would have to
    # name the module with its own scheme, e.g. ModelOpt quantized_layers)
    stuck = (f"; --fix-quant-config cannot repair it (the config would have to declare the module's own scheme in "
             f"a per-module list): declare it by hand, or `ckpt graft SOURCE {view.ckpt.root} -o OUT`")
    findings = audit(view).findings
    left = _left_by_repair(view) if any(f.fix for f in findings) else set()
    weights_or_block = _block_advice(view, weights) if any(not f.fix for f in findings) else None
    out = []
    for f in findings:
        if any(k.startswith(f.key + ".") for k in unknown):
            continue
        if f.rule is not None:  # a rule of its own: its message says what repairs it
            out.append(Problem(f.rule, cfg, f.key, f.message))
            continue
        out.append(Problem(RULE, cfg, f.key, f.message + (weights_or_block(f.key) if not f.fix else stuck
                                                          if f.key in left else fix)))
    return out


TRUNK_QUANT_RULE = "trunk-quant-config"


def trunk_quant_problems(view: MtpView, unknown: set[str] = frozenset(), *, whole_model: bool = False
                         ) -> list[Problem]:
    """``trunk-quant-config``: every linear module of the main model stored as the quantization config declares it
    (stored quantized but excluded, stored in float but targeted, companions missing or mis-shaped)."""
    from .quant.audit import audit_trunk

    if not whole_model and is_draft(view, (s.key for s in trunk_specs(view.resolved)[0])):
        return []
    cfg = config_path(view.ckpt)
    findings = audit_trunk(view).findings
    if not findings:
        return []
    left = _left_by_repair(view) if any(f.fix for f in findings) else set()
    fix = f"; `ckpt validate --fix-quant-config {view.ckpt.root} -o OUT` repairs the config"
    stuck = "; --fix-quant-config cannot repair it: correct the quantization config by hand"
    weights = "; a config change cannot fix this: the stored tensors are wrong (re-quantize the module)"
    weights_or_block = _block_advice(view, weights)
    return [Problem(f.rule, cfg, f.key, f.message) if f.rule is not None else
            Problem(TRUNK_QUANT_RULE, cfg, f.key, f.message + (weights_or_block(f.key) if not f.fix else stuck
                                                                if f.key in left else fix))
            for f in findings if not any(k.startswith(f.key + ".") for k in unknown)]


def _block_advice(view: MtpView, weights: str) -> Callable[[str], str]:
    """The advice for a module only the weights could fix: ``weights``, except for a module of the block format
    when the configuration's block is wrong (``misdeclared_block``): its scales are right, the config is not."""
    from .quant.block_audit import block_advice, misdeclared_block

    ckpt, fmt = view.ckpt, view.codec
    wrong = misdeclared_block(ckpt, fmt)
    if wrong is None:
        return lambda module: weights
    advice = f"; {block_advice(ckpt, wrong)}"

    def pick(module: str) -> str:
        return advice if fmt.scaled(f"{module}.weight", ckpt.tensors) else weights

    return pick


def _left_by_repair(view: MtpView) -> set[str]:
    """The modules ``quant.repair`` leaves unfixed (only asked when a finding has a config fix)."""
    from .quant.repair import repair_view

    return {f.key for f in repair_view(view).unfixable}


# -- the gate ---------------------------------------------------------------------------


def problems_text(problems: list[Problem], limit: int = 5) -> str:
    shown = "; ".join(str(p) for p in problems[:limit])
    return shown + (f" ... and {len(problems) - limit} more" if len(problems) > limit else "")




def note_allowed(manifest: dict, *gates: Gate) -> dict:
    """Record in an output's manifest what --allow-invalid let through on its inputs (provenance)."""
    allowed = [p.to_json() for g in gates for p in g.allowed]
    if allowed:
        manifest["allowed_invalid"] = allowed
    return manifest
