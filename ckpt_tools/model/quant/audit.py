"""Per MTP module: how it is stored versus what the quantization configuration declares.

``audit(view, files=None)`` judges every MTP linear module (glue, block, head copies, each routed
expert under the per-expert name engines probe, whatever the layout on disk) the way its consumers
read the configuration (``declared``): stored unquantized must be excluded, by its checkpoint name and,
for a shard of a layer the engines fuse (the table's ``fused_modules``), under the fused name too;
stored quantized must be declared quantized by the table it is stored in, with every companion
present. Under the family's own release convention (a block format, or the scheme the family table
hints) a tensor the table's ``quant`` flag leaves off needs no exclusion (DeepSeek's BF16 ``eh_proj``).

Each disagreement is a ``Finding`` (rule ``mtp-quant-config``) with the change that repairs it
(``exclude`` / ``include`` these names), or none when only the weights can fix it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

from ...dtypes import FLOAT_DTYPES
from ...errors import InputError
from ..expert_layouts import ExpertGroup, ExpertLayout
from .block_audit import scale_pairs
from .codec import checkpoint_codec, restack_codec
from .config import QuantFiles
from .declared import Declared, Declarer, declaration
from .detect import QuantScheme, detect_scheme
from .storage import Storage, module_storage

if TYPE_CHECKING:
    from ..mtp import MtpView
    from ..tables.schema import Table

RULE = "mtp-quant-config"
ORDER_RULE = "quant-group-order"  # two config groups target a module and the consumers pick different ones
PER_EXPERT = ExpertLayout("per-expert")
Fix = Literal["exclude", "include"]


@dataclass(frozen=True)
class Stored:
    """How one module is stored."""

    state: Literal["unquantized", "quantized"]
    label: str  # "BF16", "NVFP4 (...)", "F8_E4M3 (fused experts)"
    scheme: str | None = None  # the scheme table the tensors are stored in (quantized)
    storage: Storage | None = None
    dtype: str | None = None  # the weight's stored dtype


StoredOf = Callable[[str], "Stored | None"]
Row = tuple[str, Stored, bool, bool]  # (module, how it is stored, the table's quant flag, routed expert)


@dataclass
class ModuleAudit:
    module: str  # checkpoint module name (no ``.weight``)
    stored: Stored
    declared: Declared
    quant_flag: bool  # the family table's ``quant`` flag for this tensor
    expert: bool  # a routed expert (probed per expert, never fused into a linear)
    exempt: bool = False  # unquantized by the family's release convention: no exclusion needed
    fused: tuple[str, ...] = ()  # engine fused layers this module is a shard of
    problem: str | None = None  # what disagrees (None: stored as declared)

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class Finding:
    key: str  # the module (or fused layer) concerned
    message: str
    fix: Fix | None = None  # what a configuration repair does; None: the weights must change
    names: tuple[str, ...] = ()  # the names to exclude / include
    rule: str | None = None  # a rule of its own (schema.ARG_RULES, ORDER_RULE); None: the audit's (mtp / trunk)


@dataclass
class Audit:
    scheme: QuantScheme | None
    modules: list[ModuleAudit] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    unknown: str | None = None  # the configuration declares a scheme no table describes (not judged)

    @property
    def ok(self) -> bool:
        return not self.findings


def scheme_of(view: MtpView) -> QuantScheme | None:
    """What ``view``'s checkpoint declares (InputError ``quant-unknown`` propagates)."""
    return view.scheme if view.scheme is not None else detect_scheme(view.ckpt)


def fused_names(module: str, fused: dict[str, list[str]], present: set[str]) -> tuple[str, ...]:
    """The engine layers ``module`` is a shard of: ``fused`` entries whose every shard is a present sibling."""
    parent, dot, leaf = module.rpartition(".")
    return tuple(f"{parent}{dot}{name}" for name, shards in fused.items()
                 if leaf in shards and all(f"{parent}{dot}{s}" in present for s in shards))


def _stored(view: MtpView, scheme: QuantScheme | None, key: str, shape) -> Stored:
    ref = view.ckpt.tensors.get(key)
    st = view.quantized.get(key)
    if st is None and ref is not None and ref.dtype in FLOAT_DTYPES:
        return _plain(ref.dtype)
    fmt = view.codec
    if st is None and fmt.scaled(key, view.ckpt.tensors):
        # the checkpoint's block format (its scale companion): the fp8-* rules check its scales
        return _block(ref.dtype, fmt.block)
    if st is None:  # something only the scheme tables know
        st = module_storage(view.ckpt, scheme, key.removesuffix(".weight"), tuple(shape))
    if st.state == "quantized":
        return Stored("quantized", st.label, st.scheme, st, st.dtype)
    return Stored("unquantized", st.label, None, st, st.dtype)


# one shared description per dtype (a release has 46,000 modules stored a handful of ways): the trunk audit
# judges each distinct (stored, declared) pair once
@lru_cache(maxsize=64)
def _plain(dtype: str) -> Stored:
    return Stored("unquantized", dtype, dtype=dtype)


@lru_cache(maxsize=64)
def _block(dtype: str, block: tuple[int, int]) -> Stored:
    return Stored("quantized", f"{dtype} block {list(block)}", dtype=dtype)


@lru_cache(maxsize=512)
def _weights(group: ExpertGroup) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The keys of a per-expert group and their module names, when every key is a ``.weight`` (else none: such a
    group is looked at key by key)."""
    keys = group.columns()[0]
    if not all(k.endswith(".weight") for k in keys):
        return (), ()
    return keys, tuple(k[:-7] for k in keys)


def _stored_alike(ckpt: Any, fmt: Any, quantized: dict, keys: tuple[str, ...]) -> Stored | None:
    """The one description of weights ``keys`` when all are present in one dtype, float or the checkpoint's block
    format with every scale beside them (a release's routed experts, 768 a layer); None: ask per key."""
    tensors = ckpt.tensors
    refs = list(map(tensors.get, keys))
    if not refs or None in refs or not quantized.keys().isdisjoint(keys):
        return None
    dtypes = set(map(_DTYPE, refs))
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    if dtype in FLOAT_DTYPES:
        return _plain(dtype)
    if fmt.stores(dtype) and scale_pairs(ckpt, fmt)[1].issuperset(keys):  # keys: ``.weight`` names (``_weights``)
        return _block(dtype, fmt.block)
    return None


_DTYPE = attrgetter("dtype")


def forget_group_keys() -> None:
    """Drop the memoised keys of expert groups (``ExpertGroup.tensors`` / ``columns``, ``_weights``)."""
    from ..expert_layouts import forget_group_tensors

    _weights.cache_clear()
    forget_group_tensors()


def module_rows(view: MtpView, scheme: QuantScheme | None, stored_of: StoredOf | None = None) -> list[Row]:
    """(module, stored, quant flag, expert) of every MTP linear module present.

    ``stored_of(key)``: how a verb is about to store the tensor ``key`` (None: as the checkpoint does).
    """
    def look(key: str, shape) -> Stored:
        got = stored_of(key) if stored_of is not None else None
        return got if got is not None else _stored(view, scheme, key, shape)

    out: list[Row] = []
    for s in view.present:
        if s.role in ("scale", "expert", "trunk-expert") or s.kind != "linear" or not s.key.endswith(".weight"):
            continue
        out.append((s.key.removesuffix(".weight"), look(s.key, s.shape), s.quant, False))
    present = view.present_keys() if isinstance(view, TrunkModules) else {s.key for s in view.present}
    known = view.alike if isinstance(view, TrunkModules) else {}  # trunk groups told apart already
    for g in view.groups():
        if g.layout.per_expert:
            alike = None if stored_of is not None else known[g] if g in known else _stored_alike(
                view.ckpt, view.codec, view.quantized, _weights(g)[0])
            if alike is not None:  # every weight present, stored one way
                out += [(m, alike, g.quant, True) for m in _weights(g)[1]]
                continue
            out += [(t.key[:-7] if t.key.endswith(".weight") else t.key, look(t.key, t.shape), g.quant, True)
                    for t in g.tensors() if t.key in present]
            continue
        # fused / stacked experts: engines still probe (and exclude) them per expert
        whole = experts_stored(view, g, look)
        if whole is None:
            continue
        stored = replace(whole, label=f"{whole.label} ({g.layout.label()} experts)", scheme=None)
        out += [(t.key.removesuffix(".weight"), stored, g.quant, True) for t in g.with_layout(PER_EXPERT).tensors()]
    return out


def experts_stored(view: MtpView, group: ExpertGroup, look: Callable[[str, Any], Stored] | None = None
                   ) -> Stored | None:
    """How the stored tensors of a routed-expert group are stored, as one description (labels of differing
    tensors joined by ``/``; quantized when any is); None when none of its tensors is stored.

    ``group`` in the layout on disk (``MtpView.groups``); ``look(key, shape)``: how one tensor is stored
    (default: as the checkpoint stores it, under the scheme it declares, or none when no table describes it).
    """
    if look is None:
        try:
            scheme = scheme_of(view)
        except InputError as e:
            if e.rule != "quant-unknown":
                raise
            scheme = None  # the tensors still say how they are stored

        def look(key: str, shape: Any) -> Stored:
            return _stored(view, scheme, key, shape)

    present = {s.key for s in view.present}
    parts = [look(t.key, t.shape) for t in group.tensors() if t.key in present]
    if not parts:
        return None
    labels = "/".join(sorted({p.label for p in parts}))
    state = "unquantized" if all(p.state == "unquantized" for p in parts) else "quantized"
    schemes = {p.scheme for p in parts}
    return Stored(state, labels, schemes.pop() if len(schemes) == 1 else None, dtype=parts[0].dtype)


def audit(view: MtpView, files: QuantFiles | None = None) -> Audit:
    """Every MTP linear module of ``view``: stored as what, declared as what, and what disagrees.

    ``files``: configuration files to judge instead of the checkpoint's (file name -> JSON object),
    e.g. a repaired copy.
    """
    scheme = _scheme_or_unknown(view)
    if isinstance(scheme, Audit):
        return scheme
    if scheme is None and not view.quantized and not any(
            view.ckpt.tensors[k].dtype not in FLOAT_DTYPES for _, k in view.stored() if k in view.ckpt.tensors):
        return Audit(None)  # nothing declared, nothing quantized: the common unquantized checkpoint
    return judge(module_rows(view, scheme), scheme, view.table, files)


def judge(rows: list[Row], scheme: QuantScheme | None, table: Table, files: QuantFiles | None = None, *,
          every_module: bool = True) -> Audit:
    """``audit`` over modules described directly (``rows``), e.g. the MTP a verb is about to write.

    ``every_module=False``: ``modules`` keeps only the modules that disagree or are a fused layer's shards (the
    findings are the same; the trunk rule needs no more)."""
    result = Audit(scheme)
    fused_map = {k: list(v) for k, v in table.fused_modules.items()}
    names = {m for m, *_ in rows}
    none = Declared("excluded", None, "the configuration declares no quantization")
    hint = checkpoint_codec(hint=table.quantization)
    # a block-format release (a declared table with a block format, or scales under the name of the family's
    # hinted scheme): the table's quant flags say which modules those releases keep unquantized - where the
    # table flags any (a table that flags none says nothing of its quantized releases: every module needs its
    # exclusion, as the configuration's own rules say)
    convention = scheme is not None and any(flag for _, _, flag, _ in rows) and (
        any(restack_codec(t) is not None for t in scheme.tables)
        or any(t.suffix == hint.scale_suffix for _, f in scheme.formats() for t in f.tensors))
    declare = Declarer(scheme, files) if scheme is not None else None  # one answer per combination of matches
    shards = {s for v in fused_map.values() for s in v}
    # modules stored and declared alike (shared Stored / Declared objects) are judged once: a release's 46,000
    # trunk modules come in a handful of such classes; a class that disagrees is judged module by module (the
    # findings name each module)
    fine: dict[tuple[int, int, bool], bool] = {}
    # a declaration that names no module (no lists): routed experts (never fused) are told apart by how they are
    # stored and flagged alone, so a fine class's 768 experts a layer are passed over without a declaration each
    by_class = not every_module and (declare is None or declare.constant)
    passed: set[tuple[int, bool]] = set()
    for module, stored, flag, expert in rows:
        if expert and by_class and (id(stored), flag) in passed:
            continue
        d = declare(module) if declare is not None else none
        fused = () if expert or module.rpartition(".")[2] not in shards else fused_names(module, fused_map, names)
        exempt = convention and not flag
        at = (id(stored), id(d), exempt)
        if not every_module and not fused and fine.get(at):
            if expert and by_class:
                passed.add((id(stored), flag))
            continue
        m = ModuleAudit(module, stored, d, flag, expert, exempt, fused)
        result.modules.append(m)
        if fine.get(at):
            continue
        before = len(result.findings)
        _judge(m, scheme, result)
        fine[at] = len(result.findings) == before
        if fine[at] and expert and by_class:
            passed.add((id(stored), flag))
    _judge_fused(result, scheme, files, fused_map)
    return result


def _judge(m: ModuleAudit, scheme: QuantScheme | None, result: Audit) -> None:
    st, d = m.stored, m.declared
    problem: Finding | None = None
    if st.storage is not None and st.storage.problems and st.state == "unquantized":
        problem = Finding(m.module, "; ".join(st.storage.problems))
    elif st.state == "unquantized":
        if d.state != "excluded" and not m.exempt:
            problem = Finding(m.module, f"stored unquantized ({st.label}) but not excluded ({d.reason}): engines build "
                                        f"a quantized layer for it and cannot load its {st.label} weight",
                              "exclude", (m.module, *m.fused))
    elif st.storage is not None and not st.storage.complete:
        what = [f"missing {k}" for k in st.storage.missing] + list(st.storage.problems)
        how = "incomplete" if st.storage.missing else "malformed"  # a wrong dtype or shape is no missing tensor
        problem = Finding(m.module, f"stored {st.label} but {how}: {'; '.join(what)}; engines cannot load it")
    elif scheme is None:
        if not checkpoint_codec().stores(st.dtype):  # FP8 without a quantization_config is rule quant-config
            problem = Finding(m.module, f"stored {st.label}, but the configuration declares no quantization: "
                                        "loaders read its packed bytes as weights")
    elif d.state == "excluded":
        problem = Finding(m.module, f"stored {st.label} but excluded ({d.reason}): engines build an unquantized "
                                    f"layer for it and cannot load its {st.label} tensors",
                          "include", (m.module, *m.fused))
    elif d.state == "conflict":
        problem = Finding(m.module, f"stored {st.label}; {d.reason}")
    elif d.group is not None and st.scheme is not None and d.group.table.scheme != st.scheme:
        problem = Finding(m.module, f"stored {st.label} ({st.scheme}), but {d.reason} as {d.group.table.title}")
    found = [problem] if problem is not None else []
    where = f"config group {d.group.name!r} ({d.reason})" if d.group is not None else d.reason
    if st.state == "quantized" and st.storage is not None:
        # what the declared arguments make of the stored tensors (storage._check): the consumers read it otherwise
        found += [Finding(m.module, f"{text}; {where}; the stored tensors or the config group are wrong", rule=rule)
                  for rule, text in st.storage.issues]
    if st.state == "quantized" and d.state == "quantized" and d.other is not None and d.group is not None:
        found.append(Finding(m.module, f"config groups {d.group.name!r} and {d.other.name!r} both target it and "
                                       f"declare different schemes: compressed-tensors ranks target {d.target!r} "
                                       f"first and reads it as group {d.group.name!r}, vLLM takes the first target "
                                       f"in config order and reads it as group {d.other.name!r}; target it from "
                                       "one group only", rule=ORDER_RULE))
    if found:
        m.problem = found[0].message
        result.findings += found


def _judge_fused(result: Audit, scheme: QuantScheme | None, files: QuantFiles | None,
                 fused_map: dict[str, list[str]]) -> None:
    """Each fused engine layer: shards stored alike, and declared as stored under the fused name too."""
    if scheme is None:
        return
    by_name = {m.module: m for m in result.modules}
    seen: set[str] = set()
    for m in result.modules:
        for f in m.fused:
            if f in seen:
                continue
            seen.add(f)
            parent = f.rpartition(".")[0]
            shards = [by_name[f"{parent}.{s}"] for s in fused_map[f.rpartition(".")[2]]]
            states = {s.stored.state for s in shards}
            if len(states) > 1:
                how = ", ".join(f"{s.module.rpartition('.')[2]} {s.stored.label}" for s in shards)
                result.findings.append(Finding(f, f"engines load {f} as one layer, but its shards are stored "
                                                  f"differently ({how})"))
                continue
            if any(not s.ok for s in shards):
                continue  # the shards' own findings carry the fused name in their repair
            if states == {"unquantized"}:
                if all(s.exempt for s in shards):
                    continue
                bad = [d for d in (declaration(scheme, files, f), declaration(scheme, files, f, fused_map))
                       if d.state != "excluded"]
                if bad:
                    result.findings.append(Finding(
                        f, f"its shards ({', '.join(s.module for s in shards)}) are stored unquantized and excluded "
                           f"by their checkpoint names, but engines build the fused layer {f} and match that name, "
                           f"which is not excluded ({bad[0].reason})", "exclude", (f,)))
            else:
                d = declaration(scheme, files, f, fused_map)
                if d.state != "quantized":
                    result.findings.append(Finding(
                        f, f"its shards are stored {shards[0].stored.label}, but engines build the fused layer {f}, "
                           f"which is {d.state} ({d.reason})", "include", (f,)))


@dataclass
class TrunkModules:
    """The main model's linear modules in the shape ``module_rows`` reads (``present``, ``quantized``, ``groups``):
    the decoder layers the family table requires (``trunk_specs``), routed experts in the layout on disk.
    ``present`` holds the specs of the modules outside routed experts; ``expert_keys`` the routed experts' weights
    found (46,000 in a release: keys, not a spec each)."""

    ckpt: Any
    codec: Any
    present: list = field(default_factory=list)
    quantized: dict = field(default_factory=dict)
    expert_groups: list = field(default_factory=list)
    expert_keys: set = field(default_factory=set)
    alike: dict = field(default_factory=dict)  # per-expert group -> its weights' one description (_stored_alike)

    def groups(self) -> list[ExpertGroup]:
        return self.expert_groups

    def present_keys(self) -> set[str]:
        return self.expert_keys | {s.key for s in self.present}


def trunk_modules(view: MtpView) -> TrunkModules:
    """``view``'s checkpoint's trunk linear modules, found as ``open_mtp`` finds the MTP ones."""
    from ..mtp import QuantLookup, detect_group_layout
    from ..tables.resolve import trunk_specs

    ckpt = view.ckpt
    keys = ckpt.tensors
    specs, groups = trunk_specs(view.resolved)
    out = TrunkModules(ckpt, view.codec)
    quant = QuantLookup(ckpt, view.codec)
    if view.scheme is not None:
        quant._scheme = view.scheme  # already read
    for g in groups:
        lay = detect_group_layout(g, keys)
        out.expert_groups.append(g if lay == g.layout else g.with_layout(lay))
    for s in specs:
        if s.kind != "linear" or not s.key.endswith(".weight"):
            continue
        ref = keys.get(s.key)
        st = quant.storage(s, ref)
        if st is not None:
            out.quantized[s.key] = st
            out.present.append(s)
        elif ref is not None:
            out.present.append(s)
    # routed experts: float, or the checkpoint's block format with its scale, told apart inline (QuantLookup's
    # first test); the rest asks the scheme tables
    scaled = scale_pairs(ckpt, view.codec)[1]
    found = out.expert_keys
    for g in out.expert_groups:
        if not g.layout.per_expert:
            continue
        # kept for module_rows, which would find the same: alike, none of the group's keys enters ``quantized``
        if out.alike.setdefault(g, _stored_alike(ckpt, view.codec, out.quantized, _weights(g)[0])) is not None:
            found.update(_weights(g)[0])
            continue
        st = quant.alike(g)  # a scheme table's format (NVFP4 experts): one storage for the group, looked at in columns
        if st is not None:
            out.alike[g] = Stored("quantized", st.label, st.scheme, st, st.dtype)  # as ``_stored`` makes per module
            found.update(_weights(g)[0])
            continue
        for t in g.tensors():
            key = t.key
            if not key.endswith(".weight"):
                continue
            ref = keys.get(key)
            if ref is not None and (ref.dtype in FLOAT_DTYPES or key in scaled):
                found.add(key)
                continue
            st = quant.storage(t, ref)
            if st is not None:
                out.quantized[key] = st
                found.add(key)
            elif ref is not None:
                found.add(key)
    return out


def trunk_rows(view: MtpView, scheme: QuantScheme | None) -> list[Row]:
    """``module_rows`` of the trunk (per-expert rows of the routed experts keep the ``expert`` flag)."""
    return module_rows(trunk_modules(view), scheme)  # type: ignore[arg-type]  # duck-typed like an MtpView


def _scheme_or_unknown(view: MtpView) -> QuantScheme | Audit | None:
    """The checkpoint's declared scheme, or an Audit that says the declaration names no known scheme."""
    try:
        return scheme_of(view)
    except InputError as e:
        if e.rule != "quant-unknown":
            raise
        return Audit(None, unknown=str(e))


def audit_trunk(view: MtpView) -> Audit:
    """``audit`` for the main model's linear modules: stored quantized but excluded, stored float but targeted,
    incomplete or mis-shaped companions, wherever the module sits."""
    scheme = _scheme_or_unknown(view)
    if isinstance(scheme, Audit):
        return scheme
    if scheme is None:
        return Audit(None)  # nothing declared: FP8 without a config is rule quant-config, packed bytes mtp/trunk rules
    return judge(trunk_rows(view, scheme), scheme, view.table, every_module=False)
