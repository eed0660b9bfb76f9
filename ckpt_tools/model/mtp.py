"""The MTP view of a checkpoint: which tensors its table expects, which are present.

Expert layouts are detected from the header (a checkpoint may have been fused or unfused since
release). A linear weight stored quantized, in any scheme table's format (block FP8 with its
``weight_scale_inv``, ``weight_packed`` + scales, FP4 in U8 ...), stays in ``present`` under its
logical key and is described in ``quantized`` (ckpt_tools.model.quant), companions included;
``keys()`` / ``stored()`` give the tensors actually stored. Stacked experts (one tensor for a
group) have no module of their own: a block-FP8 stack brings its scale into ``present`` beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import TYPE_CHECKING

from ..dtypes import FLOAT_DTYPES
from ..errors import InputError
from ..io.checkpoint import Checkpoint
from .expert_layouts import LAYOUT_NAMES, ExpertGroup, ExpertLayout
from .quant.codec import Codec, checkpoint_codec
from .tables.loader import detect_table, get_table
from .tables.resolve import Resolved, Spec, resolve

if TYPE_CHECKING:
    from .quant import QuantScheme, Storage
    from .tables.schema import Table


@dataclass
class MtpView:
    ckpt: Checkpoint
    resolved: Resolved
    layouts: dict[str, ExpertLayout]  # expert group prefix -> layout found on disk
    present: list[Spec] = field(default_factory=list)  # expected and found (scales included)
    missing: list[Spec] = field(default_factory=list)  # required but absent
    optional_absent: list[Spec] = field(default_factory=list)
    misshaped: list[tuple[Spec, tuple[int, ...]]] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # inside the MTP namespace, not expected
    beyond: list[str] = field(default_factory=list)  # MTP-looking tensors past the declared count
    missing_scales: list[str] = field(default_factory=list)  # FP8 weights without their scale
    # logical weight key -> how it is stored, for weights a quantization scheme table describes
    quantized: dict[str, Storage] = field(default_factory=dict)
    quant_problems: list[tuple[str, str]] = field(default_factory=list)  # (key, message): wrong companions
    scheme: QuantScheme | None = None  # what the configuration declares (None: nothing, or not needed)

    @property
    def table(self) -> Table:
        return self.resolved.table

    @cached_property
    def codec(self) -> Codec:
        """How this checkpoint's block-scaled weights are stored (their scale companions, block, decoder):
        the scheme table it declares or stores, else the family's hint (model.quant.codec)."""
        return checkpoint_codec(self.ckpt, self.table.quantization)

    @property
    def count(self) -> int:
        return self.resolved.mtp_count

    def stored(self) -> list[tuple[Spec, str]]:
        """(spec, key) of every tensor stored for the present specs (a quantized weight's tensors)."""
        out = []
        for s in self.present:
            st = self.quantized.get(s.key)
            out += [(s, k) for k in st.all_keys()] if st is not None else [(s, s.key)]
        return out

    def keys(self) -> list[str]:
        return [k for _, k in self.stored()]

    def nbytes(self) -> int:
        return sum(self.ckpt.tensors[k].nbytes for k in self.keys())

    def groups(self) -> list[ExpertGroup]:
        return [g.with_layout(self.layouts[g.prefix]) if self.layouts[g.prefix] != g.layout else g
                for g in self.resolved.experts()]

    def complete(self) -> bool:
        return not (self.missing or self.misshaped or self.missing_scales or self.quant_problems)

    def require_complete(self) -> None:
        """Raise with every missing / mis-shaped tensor named (the rule: config declares MTP)."""
        problems = [f"missing {s.key} {list(s.shape)}" for s in self.missing]
        problems += [f"{s.key} has shape {list(a)}, table expects {list(s.shape)}" for s, a in self.misshaped]
        problems += [f"FP8 weight {k} has no {self.codec.scale_suffix}" for k in self.missing_scales]
        problems += [msg for _, msg in self.quant_problems]
        if problems:
            head = f"{self.ckpt.root}: config declares {self.count} MTP layer(s) ({self.table.family}) but "
            raise InputError(head + f"{len(problems)} tensor problem(s): " + "; ".join(problems[:20])
                             + (" ..." if len(problems) > 20 else ""), rule="mtp-incomplete")


_SHAPE = attrgetter("shape")


def detect_group_layout(group: ExpertGroup, keys) -> ExpertLayout:
    """The layout whose tensors are on disk; the shipped layout when nothing matches."""
    candidates = [group.layout] + [ExpertLayout(n) for n in LAYOUT_NAMES if n != group.layout.name]
    # fused and fused-transposed share key names: only shapes (refs in a mapping) tell them apart
    if hasattr(keys, "get"):
        for lay in candidates:
            g = group if lay == group.layout else group.with_layout(lay)
            names, shapes = g.columns()
            refs = list(map(keys.get, names))  # one C-level pass per group (768 tensors a layer in a release)
            if None not in refs and tuple(map(tuple, map(_SHAPE, refs))) == shapes:
                return lay
    best, best_hits = group.layout, -1
    stored = _stored_weight_suffixes()
    for lay in candidates:
        g = group if lay == group.layout else group.with_layout(lay)
        names = g.columns()[0]
        absent = [k for k in names if k not in keys]
        # a weight a quantization scheme stores under another name (weight_packed) is on disk too: one pass per
        # name (a release's layer has 768 experts), a weight counted once whatever name holds it
        weights = [k[:-6] for k in absent if k.endswith(".weight")]
        hits = len(names) - len(absent) + len({w for s in stored for w in weights if w + s in keys})
        if hits == len(names):
            return lay
        if hits > best_hits:
            best, best_hits = lay, hits
    return best if best_hits > 0 else group.layout


def _stored_weight_suffixes() -> tuple[str, ...]:
    """The names the quantization scheme tables store a weight under, besides ``weight``."""
    from .quant import all_schemes

    return tuple(sorted({f.weight.suffix for t in all_schemes().values() for f in t.storage} - {"weight"}))


def choose_table(ckpt: Checkpoint, arch: str | None = None) -> Table:
    if arch:
        return get_table(arch)
    if not ckpt.config_present:
        raise InputError("config.json is missing; pass --arch NAME", rule="no-config", path=ckpt.root)
    return detect_table(ckpt.config)


def _namespace(res: Resolved) -> tuple[list[str], set[str]]:
    prefixes = [layer.prefix for layer in res.layers]
    for layer in res.layers:
        prefixes += [p for p in layer.block_prefixes if p not in prefixes]
    glue = {s.key for s in res.glue_specs()}
    return prefixes, glue


def _beyond(ckpt: Checkpoint, res: Resolved) -> list[str]:
    """Tensors that would belong to MTP depths >= the count (or to shared glue when it is 0): ``res.probed``."""
    declared_glue = {s.key for s in res.glue_specs()}
    glue = {s.key for layer in res.probed for s in layer.glue.values()} - declared_glue
    prefixes = tuple(p for layer in res.probed for p in [layer.prefix, *layer.block_prefixes])
    # one C call per key: every prefix at once
    return sorted(key for key in ckpt.tensors if key in glue or key.startswith(prefixes))


def open_mtp(ckpt: Checkpoint, table: Table | None = None, count: int | None = None) -> MtpView:
    """Classify the checkpoint's MTP tensors against ``table`` (detected when None)."""
    table = table or choose_table(ckpt)
    res = resolve(table, ckpt.config, mtp_count=count, probe=4)  # 4 depths past the count: tensors beyond it
    keys = ckpt.tensors
    layouts = {g.prefix: detect_group_layout(g, keys) for g in res.experts()}
    view = MtpView(ckpt, res, layouts)
    expected = res.mtp_specs(layouts)
    expected_keys = set()
    fmt = view.codec
    quant = QuantLookup(ckpt, fmt)
    for s in expected:
        expected_keys.add(s.key)
        ref = keys.get(s.key)
        st = quant.storage(s, ref)
        if st is not None:
            _add_quantized(view, s, st, expected_keys)
            continue
        if ref is None:
            (view.optional_absent if s.optional else view.missing).append(s)
            continue
        if tuple(ref.shape) != tuple(s.shape):
            view.misshaped.append((s, tuple(ref.shape)))
        view.present.append(s)
        if fmt.stores(ref.dtype):  # stacked experts ([E, out, in], no .weight module): the block scale beside them
            skey, sshape, sref = fmt.scale_of(s.key, s.shape, keys)
            expected_keys.add(skey)
            scale = Spec(skey, sshape, "scale", depth=s.depth, kind="other", dtype="F32")
            if sref is None:
                view.missing_scales.append(s.key)
            else:
                if tuple(sref.shape) != sshape:
                    view.misshaped.append((scale, tuple(sref.shape)))
                view.present.append(scale)
    prefixes, glue = _namespace(res)
    starts = tuple(prefixes)
    for key in keys:
        if (key.startswith(starts) or key in glue) and key not in expected_keys:
            view.extra.append(key)
    view.extra.sort()
    view.beyond = _beyond(ckpt, res)
    view.scheme = quant.scheme_if_read
    return view


class QuantLookup:
    """How each quantized linear weight is stored (``module_storage``), the scheme read lazily: a checkpoint
    whose weights are all float never reads it."""

    def __init__(self, ckpt: Checkpoint, fmt: Codec) -> None:
        self.ckpt = ckpt
        self.fmt = fmt
        self._scheme: object = _UNREAD
        self._lookup: Callable[..., Storage] | None = None  # storage_lookup of the scheme (a short-lived object)
        self._last_names: set[str] | None = None  # the last name component of every key (alike)

    @property
    def scheme_if_read(self) -> QuantScheme | None:
        return None if self._scheme is _UNREAD else self._scheme  # type: ignore[return-value]

    def storage(self, s, ref) -> Storage | None:
        """How ``s`` (a Spec or ExpertTensor) is stored, when a quantization scheme table describes it, block
        formats included (FP8 with ``weight_scale_inv`` or ``.scale``); None for float weights, a stacked
        experts tensor (no module of its own: its block scale travels with it, ``Codec``) and anything no
        table describes (reported as missing or mis-shaped)."""
        if getattr(s, "kind", "linear") != "linear" or not s.key.endswith(".weight"):
            return None
        if ref is not None and ref.dtype in FLOAT_DTYPES:
            return None
        if self._lookup is None:  # the scheme and the tables in force looked up once: a lookup runs per module
            from .quant import detect_scheme
            from .quant.storage import storage_lookup

            if self._scheme is _UNREAD:
                self._scheme = detect_scheme(self.ckpt)
            self._lookup = storage_lookup(self._scheme)  # type: ignore[arg-type]
        st = self._lookup(self.ckpt, s.key[: -len(".weight")], tuple(s.shape))
        return st if st.quantized else None

    def alike(self, group: ExpertGroup) -> Storage | None:
        """The one quantized storage of a per-expert group's weights when all are stored alike (``alike_storage``:
        judged in columns), else None (ask ``storage`` per tensor)."""
        from .quant import detect_scheme
        from .quant.storage import alike_storage

        keys, shapes = group.columns()
        if not group.layout.per_expert or not all(k.endswith(".weight") for k in keys):
            return None
        if self._scheme is _UNREAD:
            self._scheme = detect_scheme(self.ckpt)
        if self._last_names is None:  # once per lookup (a short-lived object): a name no key ends with is not asked
            self._last_names = {k.rpartition(".")[2] for k in self.ckpt.tensors}
        st = alike_storage(self.ckpt, self._scheme, [k[:-7] for k in keys], shapes,  # type: ignore[arg-type]
                           self._last_names)
        return st if st is not None and st.quantized else None


_UNREAD = object()


def _add_quantized(view: MtpView, s: Spec, st: Storage, expected_keys: set[str]) -> None:
    view.present.append(s)
    view.quantized[s.key] = st
    expected_keys.update(st.all_keys())
    for key in st.missing:
        view.missing.append(Spec(key, (), "scale", depth=s.depth, kind="other", dtype="",
                                 optional=False))
    view.quant_problems += [(s.key, f"{st.label}: {p}") for p in st.problems]
