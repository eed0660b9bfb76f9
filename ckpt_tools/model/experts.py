"""Converting routed experts between layouts: the one place that knows how they are stored.

Every layout of ``expert_layouts`` is described the same way: each stored tensor is, per expert, a
*slab* of one or more *pieces* (``gate [I, H]``, ``up [I, H]``, ``down [H, I]``), possibly transposed,
joined along rows (``fused``), columns (``fused-transposed``) or interleaved columns (gpt-oss).
Stacked tensors hold the E slabs one after another. A target slab whose pieces are contiguous byte
ranges of the source in the same orientation is ``CopyBytes`` (any dtype, FP8 included); any other is
a ``Compute`` recipe moving one expert's slab at a time as unsigned-integer views (no arithmetic).

FP8 block scales are pieces too: they stack, split and transpose with their weights. Joining gate and
up scales is exact only when I is a multiple of the block; otherwise the conversion is refused. A
``Dequantizer`` may decode the pieces on the way. Computed recipes read into buffers of their own, so
the writer may decode them ahead of their turn (``Compute.ahead``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

from ..arrays import bytes_to_numpy, numpy_storage_dtype
from ..dtypes import DTYPES, FLOAT_DTYPES
from ..errors import PlanError
from ..io.safetensors_io import Segment, TensorRef, read_bytes
from ..stream.plan import Compute, CopyBytes, OutputTensor
from .expert_layouts import (
    LAYOUT_NAMES,
    MIXED_RULE,
    ExpertGroup,
    ExpertLayout,
    keys_under,
    mixed_layout_message,
    other_layout_keys,
    scale_key,
    scale_shape,
)
from .quant.codec import Codec, checkpoint_codec, storage_codec

if TYPE_CHECKING:  # numpy is imported where pieces are computed: pure restacking never needs it
    import numpy as np

MAX_LISTED = 20  # problems listed in one error message


class Dequantizer(Protocol):
    """Hook for FP8 -> high precision, applied to each canonical piece before it is joined."""

    dtype: str  # the output dtype, e.g. "BF16"

    def __call__(self, weight: np.ndarray, scale: np.ndarray, block: tuple[int, int], weight_dtype: str,
                 scale_dtype: str) -> np.ndarray:
        """One ``[out, in]`` piece: FP8 codes and its scale grid (numpy storage views of ``weight_dtype`` /
        ``scale_dtype``) -> its values, same shape, as ``ckpt_tools.arrays.numpy_storage_dtype``."""
        ...


@dataclass(frozen=True)
class BlockDequant:
    """The ``Dequantizer`` backed by the block format's decoder (model.quant: float32 product, one cast to
    ``dtype``); ``fmt``: the checkpoint's block format (None: the default one)."""

    dtype: str = "BF16"
    fmt: Codec | None = None

    def __call__(self, weight: np.ndarray, scale: np.ndarray, block: tuple[int, int], weight_dtype: str,
                 scale_dtype: str) -> np.ndarray:
        from .quant.dequant import decode_block_array

        return decode_block_array(self.fmt or checkpoint_codec(), weight, scale, block, weight_dtype, scale_dtype,
                                  self.dtype)


# ---------------------------------------------------------------------------
# Slabs: what one expert contributes to a stored tensor


@dataclass(frozen=True)
class Slab:
    pieces: tuple[str, ...]  # projections, in storage order
    transposed: bool  # pieces stored [in, out]
    join: str  # one | rows | cols | interleave

    @property
    def contiguous_pieces(self) -> bool:
        """Each piece is one byte range of the slab."""
        return self.join in ("one", "rows")


@lru_cache(maxsize=64)
def slab_of(layout: ExpertLayout, slot: str) -> Slab:
    if slot == "gate_up":
        pieces = ("up", "gate") if layout.up_first else ("gate", "up")
        join = "interleave" if layout.interleaved else ("cols" if layout.transposed else "rows")
        return Slab(pieces, layout.transposed, join)
    return Slab((slot,), layout.transposed, "one")


@dataclass(frozen=True)
class Stored:
    """One tensor of a layout (a weight or its scale)."""

    key: str
    kind: str  # weight | scale
    shape: tuple[int, ...]
    expert: int | None  # per-expert tensors: their expert; None: stacked (first axis = experts)
    slab: Slab
    weight_key: str  # the weight this tensor is or belongs to

    def experts(self, count: int) -> list[int]:
        return list(range(count)) if self.expert is None else [self.expert]

    @property
    def slab_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.expert is None else self.shape


def stored_tensors(group: ExpertGroup, kind: str = "weight", fmt: Codec | None = None
                   ) -> tuple[Stored, ...]:
    """Every tensor of ``group``'s layout (weights, or their ``fmt`` scale companions), in ``group.tensors()``
    order (``fmt``: the checkpoint's block format, model.quant.codec; None: the default one)."""
    fmt = fmt or checkpoint_codec()
    return _stored(group, kind, fmt.scale_suffix, (int(fmt.block[0]), int(fmt.block[1])))


@lru_cache(maxsize=256)  # rendering keys is the slow part of planning 256-expert groups
def _group_tensors(group: ExpertGroup) -> tuple:
    return tuple(group.tensors())


@lru_cache(maxsize=512)
def _stored(group: ExpertGroup, kind: str, scale_suffix: str, block: tuple[int, int]) -> tuple[Stored, ...]:
    out = []
    for t in _group_tensors(group):
        slab = slab_of(group.layout, t.slot)
        if kind == "weight":
            out.append(Stored(t.key, kind, t.shape, t.expert, slab, t.key))
        else:
            out.append(Stored(scale_key(t.key, scale_suffix), kind, scale_shape(t.shape, block), t.expert, slab,
                              t.key))
    return tuple(out)


def piece_shape(group: ExpertGroup, proj: str, kind: str, block: tuple[int, int]) -> tuple[int, int]:
    """Canonical ``[out, in]`` shape of one piece (for scales: its block grid)."""
    rows, cols = (group.hidden, group.inter) if proj == "down" else (group.inter, group.hidden)
    if kind == "scale":
        rows, cols = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    return rows, cols


def _stored_piece_shape(group: ExpertGroup, proj: str, kind: str, block, transposed: bool) -> tuple[int, int]:
    r, c = piece_shape(group, proj, kind, block)
    return (c, r) if transposed else (r, c)


def scale_slab_problem(group: ExpertGroup, slab: Slab, block: tuple[int, int]) -> str | None:
    """Why this slab's scale grid is not the join of its pieces' grids (None when it is)."""
    b0, b1 = block
    if slab.transposed and b0 != b1:
        return f"a transposed layout needs a square scale block, not {b0}x{b1}"
    if len(slab.pieces) < 2:
        return None
    if slab.join == "interleave":
        return "interleaved gate/up columns would share FP8 scale blocks"
    axis_block = b0 if slab.join == "rows" else b1
    if group.inter % axis_block:
        return (f"I={group.inter} is not a multiple of the {axis_block}-element scale block, so one scale block "
                f"would cover both gate and up {'rows' if slab.join == 'rows' else 'columns'}")
    return None


# ---------------------------------------------------------------------------
# Checking a group on disk


@dataclass
class GroupInfo:
    """What ``check_group`` learned about a group on disk."""

    dtype: str  # dtype of every weight
    scale_dtype: str | None  # FP8 only
    keys: list[str] = field(default_factory=list)  # every source key of the group (weights, then scales)

    @property
    def fp8(self) -> bool:
        return self.scale_dtype is not None


_SENTINEL = 987654321


@lru_cache(maxsize=512)
def _expert_patterns(group: ExpertGroup) -> tuple[re.Pattern, ...]:
    """Regexes for per-expert keys of ``group`` (the expert index captured)."""
    g = group if group.layout.per_expert else group.with_layout(ExpertLayout("per-expert"))
    out = []
    for p in g.projections():
        tmpl = re.escape(g.key(p, _SENTINEL)).replace(str(_SENTINEL), r"(\d+)", 1)
        out.append(re.compile(tmpl + r"(?:_.*)?"))
    return tuple(out)


def _compact(nums: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2, 5, 7-8'."""
    parts, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(parts)


def _raise(group: ExpertGroup, problems: list[tuple[str, str]]) -> None:
    rules = {r for r, _ in problems}
    rule = problems[0][0] if len(rules) == 1 else "expert-group"
    listed = "; ".join(f"[{r}] {msg}" for r, msg in problems[:MAX_LISTED])
    more = f"; ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    raise PlanError(
        f"expert group {group.prefix} ({group.layout.label()}, E={group.count}, H={group.hidden}, "
        f"I={group.inter}): {len(problems)} problem(s): {listed}{more}",
        rule=rule,
    )


def layout_problem(group: ExpertGroup) -> str | None:
    """Why ``group``'s layout cannot hold its experts (None when it can)."""
    if not group.gated and (group.layout.up_first or group.layout.interleaved):
        return (f"layout {group.layout.label()} orders gate and up, but {group.prefix} is non-gated "
                "(up and down only)")
    return None


def _encoded(group: ExpertGroup, refs: Mapping[str, TensorRef], fmt: Codec):
    """How ``group``'s first expert weight is stored when a scheme table other than the block format ``fmt``
    describes it (packed codes, per-channel or global scales ...): a model.quant Storage; None otherwise."""
    first = _group_tensors(group)[0]
    ref = refs.get(first.key)
    if ref is not None and (ref.dtype in FLOAT_DTYPES or fmt.scaled(first.key, refs)):
        return None
    if not first.key.endswith(".weight"):
        return None  # a stacked name: no scheme table names companions of stacked experts
    from types import SimpleNamespace

    from .quant.storage import module_storage

    st = module_storage(SimpleNamespace(tensors=refs), None, first.key.removesuffix(".weight"), tuple(first.shape))
    if not st.quantized or (st.scheme, st.format) == (fmt.scheme, fmt.format):
        return None  # float, absent, or the block format missing its scale: the checks below name it
    return st


def check_group(src: ExpertGroup, refs: Mapping[str, TensorRef], fmt: Codec | None = None) -> GroupInfo:
    """Every tensor of ``src`` present with its shape, one dtype, FP8 scales, nothing stray; else PlanError."""
    problems: list[tuple[str, str]] = []
    why = layout_problem(src)
    if why:
        _raise(src, [("layout-unsupported", why)])
    fmt = fmt or checkpoint_codec()
    encoded = _encoded(src, refs, fmt)
    if encoded is not None:
        _raise(src, [("expert-quant-scheme", storage_codec(encoded).refusal(encoded, "restack experts (only one "
                      "scale companion over fixed tiles stacks along the expert axis)", "them"))])
    weights = stored_tensors(src)
    expected = {w.key for w in weights}
    dtypes: dict[str, list[str]] = {}
    for w in weights:
        ref = refs.get(w.key)
        if ref is None:
            problems.append(("expert-missing", f"missing {w.key} {list(w.shape)}"))
            continue
        if tuple(ref.shape) != w.shape:
            problems.append(("expert-shape", f"{w.key} in {ref.file} has shape {list(ref.shape)}, the config "
                                             f"implies {list(w.shape)}"))
        dtypes.setdefault(ref.dtype, []).append(w.key)
    dtype = max(dtypes, key=lambda d: len(dtypes[d])) if dtypes else "BF16"
    if len(dtypes) > 1:
        for d, ks in dtypes.items():
            if d != dtype:
                problems.append(("expert-dtype", f"{ks[0]} is {d} ({len(ks)} tensor(s)), the group's other "
                                                 f"weights are {dtype}"))
    scale_dtype = None
    scale_keys: list[str] = []
    block = fmt.block
    if fmt.stores(dtype):
        sdt: set[str] = set()
        for w in weights:
            skey, grid, ref = fmt.scale_of(w.key, w.shape, refs)
            expected.add(skey)
            if ref is None:
                if w.key in refs:
                    problems.append(("fp8-scale-missing", f"FP8 weight {w.key} has no {skey}"))
                continue
            scale_keys.append(skey)
            sdt.add(ref.dtype)
            if tuple(ref.shape) != grid:
                problems.append(("fp8-scale-shape", f"{skey} has shape {list(ref.shape)}, {list(block)} blocks "
                                                    f"of its weight imply {list(grid)}"))
        if len(sdt) > 1:
            problems.append(("fp8-scale-dtype", f"the scales of {src.prefix} mix dtypes {sorted(sdt)}"))
        scale_dtype = sorted(sdt)[0] if sdt else "F32"
    problems += _stray(src, refs, expected)
    if problems:
        _raise(src, problems)
    return GroupInfo(dtype, scale_dtype, [w.key for w in weights] + scale_keys)


def _other_layout_keys(src: ExpertGroup) -> set[str]:
    """Keys of the group's stacked and fused layouts (per-expert keys are matched by ``_expert_patterns``)."""
    keys: set[str] = set()
    for name in LAYOUT_NAMES:
        if name != "per-expert":
            g = src if name == src.layout.name else src.with_layout(ExpertLayout(name))
            keys.update(t.key for t in g.tensors())
    return keys


def _stray(src: ExpertGroup, refs: Mapping[str, TensorRef], expected: set[str]) -> list[tuple[str, str]]:
    """Keys in the group's namespace that its layout does not explain; gaps in expert indices."""
    problems: list[tuple[str, str]] = []
    patterns = _expert_patterns(src)

    def index_of(key: str) -> int | None:
        for pat in patterns:
            m = pat.fullmatch(key)
            if m:
                return int(m.group(1))
        return None

    # Only keys some layout of this group could write (and their scales) are the group's business: a
    # router or shared expert may share the prefix (Step-3.5: moe.gate.weight, moe.router_bias beside the
    # stacked moe.{gate,up,down}_proj.weight)
    layout_keys = _other_layout_keys(src)

    def layout_like(key: str) -> bool:
        return index_of(key) is not None or key in layout_keys or any(key.startswith(k + "_") for k in layout_keys)

    found: set[int] = set()
    stray: list[str] = []
    under = keys_under(refs, (src.prefix + ".", src.prefix + "_"))
    mixed = other_layout_keys(src, under)  # the gate's rule (expert_layouts.MIXED_RULE): the same finding
    for key in under:
        if src.layout.per_expert:
            idx = index_of(key)
            if idx is not None:
                found.add(idx)
        if key not in expected and layout_like(key):
            stray.append(key)
    for key in sorted(stray):
        idx = index_of(key)
        if key in mixed and not (idx is not None and src.layout.per_expert):
            problems.append((MIXED_RULE, f"{key}: {mixed_layout_message(src, mixed[key])}"))
        elif idx is not None and src.layout.per_expert and idx >= src.count:
            problems.append(("expert-index", f"{key}: expert index {idx} but the config has {src.count} experts "
                                             f"(0..{src.count - 1})"))
        else:
            problems.append(("expert-unexpected", f"{key} is not a tensor of the {src.layout.label()} layout of "
                                                  f"{src.prefix} (left over from another layout?)"))
    if src.layout.per_expert and found:
        top = max(found)
        gaps = [i for i in range(top + 1) if i not in found]
        if gaps:
            problems.insert(0, ("expert-noncontiguous", f"expert indices of {src.prefix} are not contiguous: found "
                                                        f"{_compact(sorted(found))}, no {_compact(gaps)}"))
        elif top + 1 != src.count:
            problems.insert(0, ("expert-count", f"{src.prefix} has experts 0..{top}, the config has "
                                                f"{src.count}"))
    return problems


# ---------------------------------------------------------------------------
# Conversion


@dataclass(frozen=True)
class _Loc:
    stored: Stored
    ref: TensorRef
    slab_offset: int  # byte offset of the expert's slab inside the tensor
    slab_nbytes: int
    index: int  # position of the piece inside the slab
    piece_nbytes: int


class _Converter:
    def __init__(self, src: ExpertGroup, refs: Mapping[str, TensorRef], dst: ExpertGroup, info: GroupInfo,
                 fmt: Codec, dequant: Dequantizer | None) -> None:
        self.src, self.dst, self.info, self.block, self.fmt = src, dst, info, fmt.block, fmt
        self.refs = refs
        self.dequant = dequant if info.fp8 else None
        self.locs: dict[tuple[str, str, int], _Loc] = {}
        kinds = ("weight", "scale") if info.fp8 else ("weight",)
        for kind in kinds:
            dtype = info.scale_dtype if kind == "scale" else info.dtype
            assert dtype is not None
            sizes: dict[Slab, tuple[int, list[int]]] = {}  # the same for every expert
            for s in stored_tensors(src, kind, fmt):
                if s.slab not in sizes:
                    pieces = [_nbytes(dtype, math.prod(_stored_piece_shape(src, p, kind, self.block,
                                                                           s.slab.transposed)),
                                      s.key) for p in s.slab.pieces]
                    sizes[s.slab] = (_nbytes(dtype, math.prod(s.slab_shape), s.key), pieces)
                slab_n, piece_ns = sizes[s.slab]
                ref = refs[s.key]
                for e in s.experts(src.count):
                    off = e * slab_n if s.expert is None else 0
                    for i, p in enumerate(s.slab.pieces):
                        self.locs[(kind, p, e)] = _Loc(s, ref, off, slab_n, i, piece_ns[i])

    # -- planning ---------------------------------------------------------------

    @property
    def _self_contained(self) -> bool:
        """Whether each output's recipe shares no state with another recipe, so the writer may start it early
        on the decoding pool (stream.lookahead; ``Compute.ahead``). ``_produce`` reads its own byte ranges of
        the source (positioned reads) into buffers it allocates per call and per expert (a slab read once for
        the pieces of one expert is local to that call); ``self.locs`` is read-only after planning. The block
        decoder (``BlockDequant``: a frozen dataclass, model.quant's decoder with per-call state and
        thread-local scratch) is safe on any thread; another plugged-in ``Dequantizer`` may hold state, so its
        recipes stay on the writing thread."""
        return self.dequant is None or isinstance(self.dequant, BlockDequant)

    def outputs(self) -> list[OutputTensor]:
        out: list[OutputTensor] = []
        scales = {s.weight_key: s for s in stored_tensors(self.dst, "scale", self.fmt)}
        for w in stored_tensors(self.dst):
            out.append(self._tensor(w))
            if self.info.fp8 and self.dequant is None:
                out.append(self._tensor(scales[w.key]))
        return out

    def _dtype(self, kind: str) -> str:
        if kind == "scale":
            assert self.info.scale_dtype is not None
            return self.info.scale_dtype
        return self.dequant.dtype if self.dequant is not None else self.info.dtype

    def _tensor(self, d: Stored) -> OutputTensor:
        E = self.src.count
        used = dict.fromkeys(self.locs[(d.kind, p, e)].stored.key for e in d.experts(E) for p in d.slab.pieces)
        if self.dequant is not None:
            used.update(dict.fromkeys(self.fmt.scale_key(k) for k in list(used)))
        sources = list(used)
        meta = {"source": sources, "layout": self.dst.layout.label(), "source_layout": self.src.layout.label()}
        dtype = self._dtype(d.kind)
        segments: list[Segment] | None = [] if self.dequant is None else None
        if segments is not None:
            for e in d.experts(E):
                segs = self._segments(d, e)
                if segs is None:
                    segments = None
                    break
                segments += segs
        if segments is not None:
            recipe = CopyBytes(segments)
            recipe.op = self._copy_op(recipe, sources)
            return OutputTensor(d.key, dtype, d.shape, recipe, meta=meta)
        self._check_compute(d)
        op = "dequant" if self.dequant is not None else _compute_op(self._src_slab(d), d.slab)
        recipe = Compute(lambda d=d: self._produce(d), op, inputs=sources,
                         detail={"layout": self.dst.layout.label(), "per": "expert"}, read_bytes=self._read_bytes(d),
                         ahead=self._self_contained)
        return OutputTensor(d.key, dtype, d.shape, recipe, meta=meta)

    def _read_bytes(self, d: Stored) -> int:
        """What ``_produce`` reads: contiguous pieces alone, else each needed slab once per expert."""
        kinds = (d.kind, "scale") if self.dequant is not None else (d.kind,)
        total = 0
        for e in d.experts(self.src.count):
            slabs: set[str] = set()
            for kind in kinds:
                for p in d.slab.pieces:
                    loc = self.locs[(kind, p, e)]
                    if loc.stored.slab.contiguous_pieces:
                        total += loc.piece_nbytes
                    elif loc.stored.key not in slabs:
                        slabs.add(loc.stored.key)
                        total += loc.slab_nbytes
        return total

    def _src_slab(self, d: Stored) -> Slab:
        return self.locs[(d.kind, d.slab.pieces[0], d.experts(self.src.count)[0])].stored.slab

    def _copy_op(self, recipe: CopyBytes, sources: list[str]) -> str:
        if len(recipe.segments) == 1 and len(sources) == 1:
            ref = self.refs[sources[0]]
            seg = recipe.segments[0]
            return "copy" if seg.offset == ref.offset and seg.length == ref.nbytes else "slice"
        return "concat"

    def _segments(self, d: Stored, e: int) -> list[Segment] | None:
        """Byte ranges of the source that make up expert ``e``'s slab of ``d``; None when it needs compute."""
        first = self.locs[(d.kind, d.slab.pieces[0], e)]
        if first.stored.slab == d.slab and first.index == 0:
            return [first.ref.segment(first.slab_offset, first.slab_nbytes)]
        if not d.slab.contiguous_pieces:
            return None
        out = []
        for p in d.slab.pieces:
            loc = self.locs[(d.kind, p, e)]
            s = loc.stored.slab
            if not s.contiguous_pieces or s.transposed != d.slab.transposed:
                return None
            if d.kind == "scale":
                self._require_scale_slab(loc.stored, self.src)
                self._require_scale_slab(d, self.dst)
            out.append(loc.ref.segment(loc.slab_offset + loc.index * loc.piece_nbytes, loc.piece_nbytes))
        return out

    def _require_scale_slab(self, s: Stored, group: ExpertGroup) -> None:
        why = scale_slab_problem(group, s.slab, self.block)
        if why:
            src_side = group is self.src
            raise PlanError(
                f"cannot {'split' if src_side else 'build'} the FP8 block scales {s.key} "
                f"({group.layout.label()}): {why}. Dequantize the experts first (--dequant bf16) or choose a layout "
                "that keeps gate and up apart (per-expert, stacked, stacked-transposed)",
                rule="fp8-scale-fusion",
            )

    def _check_compute(self, d: Stored) -> None:
        """Refuse what compute cannot do before a byte is written."""
        kinds = ("weight", "scale") if self.info.fp8 else ("weight",)
        for kind in kinds:
            src_dt = self.info.scale_dtype if kind == "scale" else self.info.dtype
            try:
                numpy_storage_dtype(src_dt or "F32")
            except ValueError:
                raise PlanError(f"{d.key}: {src_dt} tensors can be restacked but not transposed or interleaved",
                                rule="layout-dtype") from None
        if self.dequant is not None or d.kind == "scale":
            for e in d.experts(self.src.count)[:1]:
                for p in d.slab.pieces:
                    self._require_scale_slab(self.locs[("scale", p, e)].stored, self.src)
            if d.kind == "scale":
                self._require_scale_slab(d, self.dst)

    # -- execution ----------------------------------------------------------------

    def _produce(self, d: Stored) -> Iterator[np.ndarray]:
        for e in d.experts(self.src.count):
            cache: dict[str, np.ndarray] = {}
            pieces = [self._canonical(d.kind, p, e, cache) for p in d.slab.pieces]
            if self.dequant is not None:
                scales = [self._canonical("scale", p, e, cache) for p in d.slab.pieces]
                sdt = self.info.scale_dtype or "F32"
                pieces = [self.dequant(w, s, self.block, self.info.dtype, sdt)
                          for w, s in zip(pieces, scales, strict=True)]
            yield compose(pieces, d.slab)

    def _canonical(self, kind: str, p: str, e: int, cache: dict[str, np.ndarray]) -> np.ndarray:
        """Piece ``p`` of expert ``e`` as an ``[out, in]`` array (a uint view for bf16 / fp8)."""
        loc = self.locs[(kind, p, e)]
        s = loc.stored
        dtype = loc.ref.dtype
        shape = _stored_piece_shape(self.src, p, kind, self.block, s.slab.transposed)
        if s.slab.contiguous_pieces:
            raw = read_bytes(loc.ref.source, loc.ref.offset + loc.slab_offset + loc.index * loc.piece_nbytes,
                             loc.piece_nbytes)
            arr = bytes_to_numpy(raw, dtype, shape)
        else:
            slab = cache.get(s.key)
            if slab is None:
                raw = read_bytes(loc.ref.source, loc.ref.offset + loc.slab_offset, loc.slab_nbytes)
                slab = cache[s.key] = bytes_to_numpy(raw, dtype, s.slab_shape)
            arr = split(slab, s.slab, loc.index, shape)
        return arr.T if s.slab.transposed else arr


def split(slab: np.ndarray, layout: Slab, index: int, stored_shape: tuple[int, int]) -> np.ndarray:
    """Piece ``index`` of a slab array, in its stored orientation (a view)."""
    n = len(layout.pieces)
    if layout.join == "one":
        return slab
    if layout.join == "rows":
        r = stored_shape[0]
        return slab[index * r:(index + 1) * r]
    if layout.join == "cols":
        c = stored_shape[1]
        return slab[:, index * c:(index + 1) * c]
    return slab[:, index::n]


def compose(pieces: list[np.ndarray], layout: Slab) -> np.ndarray:
    """Canonical ``[out, in]`` pieces -> one expert's slab in ``layout`` (C-contiguous)."""
    import numpy as np

    if layout.transposed:
        pieces = [p.T for p in pieces]
    if layout.join == "one":
        return np.ascontiguousarray(pieces[0])
    if layout.join == "rows":
        return np.concatenate(pieces, axis=0)
    if layout.join == "cols":
        return np.concatenate(pieces, axis=1)
    n = len(pieces)
    rows, cols = pieces[0].shape
    out = np.empty((rows, n * cols), dtype=pieces[0].dtype)
    for i, p in enumerate(pieces):
        out[:, i::n] = p
    return out


def _compute_op(src: Slab, dst: Slab) -> str:
    if src.transposed != dst.transposed:
        return "transpose"
    return "interleave" if "interleave" in (src.join, dst.join) else "restack"


def _nbytes(dtype: str, numel: int, key: str) -> int:
    bits = numel * DTYPES[dtype].bits
    if bits % 8:
        raise PlanError(f"{key}: one expert's {dtype} piece is not a whole number of bytes", rule="layout-dtype")
    return bits // 8


def convert_group(src: ExpertGroup, refs: Mapping[str, TensorRef], dst: ExpertGroup, *,
                  fmt: Codec | None = None, dequant: Dequantizer | None = None) -> list[OutputTensor]:
    """Plan ``dst`` (layout and key prefix) from the experts of ``src`` as stored in ``refs``.

    FP8 weights bring their block scales, converted the same way (or, with ``dequant``,
    are dequantized piece by piece and lose them). Same layout and prefix gives plain copies.
    """
    fmt = fmt or checkpoint_codec()
    if (src.count, src.hidden, src.inter, src.gated) != (dst.count, dst.hidden, dst.inter, dst.gated):
        raise PlanError(
            f"{dst.prefix}: target E={dst.count} H={dst.hidden} I={dst.inter} gated={dst.gated} does not match "
            f"the source {src.prefix} E={src.count} H={src.hidden} I={src.inter} gated={src.gated}",
            rule="expert-shape",
        )
    why = layout_problem(dst)
    if why:
        raise PlanError(f"{dst.prefix}: {why}", rule="layout-unsupported")
    info = check_group(src, refs, fmt)
    return _Converter(src, refs, dst, info, fmt, dequant).outputs()


def layout_from_label(text: str) -> ExpertLayout:
    """Parse ``ExpertLayout.label()`` output (``fused(up-first)``) as well as ``fused:up-first``."""
    m = re.fullmatch(r"\s*([a-z-]+)\s*\(([^)]*)\)\s*", text)
    return ExpertLayout.parse(f"{m.group(1)}:{m.group(2)}" if m else text)
