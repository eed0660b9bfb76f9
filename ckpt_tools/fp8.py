"""FP8 block quantization (DeepSeek style): dequantize and requantize, exactly.

API: ``dequantize`` / ``quantize`` (in-memory tensors); ``dequant_recipe`` and
``requant_recipes`` (streaming Compute recipes over TensorRefs or ``TensorRows``
windows: one expert, a row range); ``fp8_decode`` has the numpy twin of the dequantizer
for sequential byte readers; ``unchanged_after_dequant`` (may stitch keep the verifier's FP8 bytes?);
``is_fp8_config`` / ``block_size`` (config).

Format (checkpoint-engineering.md section 3): a quantized ``X.weight`` is ``F8_E4M3``
``[..., out, in]`` with a companion ``X.weight_scale_inv`` of ``[..., ceil(out/br),
ceil(in/bc)]`` (block ``br x bc``, usually 128 x 128). Edge tiles are partial.

Dequantization, as DeepSeek's ``weight_dequant`` kernel and transformers'
``Fp8Dequantize`` do it::

    W[r, c] = float32(Q[r, c]) * scale_inv[r // br, c // bc]     (one float32 rounding)

then one cast (round to nearest even) to the output dtype.

Quantization (``quantize``), per block::

    s = float32(amax / 448)         (a true division, not amax * (1/448))
    Q = e4m3_rne(clamp(W / s, -448, 448))

Scales are floored at the smallest normal float32, ``s = max(fl(amax / 448), 2**-126)``,
so all-zero blocks get ``2**-126`` (finite, never NaN or Inf) and so do blocks too tiny
for a normal scale; every ``Q * s`` then stays exact. One rule rather than "1.0 for
zero blocks" (transformers' and our fixtures' choice) because a tiny block can round
to all-zero codes: with a special value for zero blocks it would come back from
``quantize(dequantize(...))`` with a different scale. NaN or Inf inputs raise.

Why ``amax / 448`` rather than transformers' ``1 / (448 / amax)``: with a scale
``s = fl(amax / 448)`` the round trip is a fixed point, ``quantize(dequantize(Q, s))
== (Q, s)`` byte for byte. The block's largest element is ``fl(448 * s)`` after
dequantization, and ``fl(fl(448 * s) / 448) == s`` holds for every float32 of the
form ``fl(x / 448)`` (checked exhaustively over a whole binade in tests/test_fp8.py;
powers of two commute with everything, so one binade covers all normal scales). The
other elements come back to the same e4m3 value because ``fl(fl(q * s) / s)`` is
within 2**-22 relative of ``q``, far below half an e4m3 step.

Speed: e4m3 is decoded with integer shifts into float16 (``byte << 7`` is the
float16 of ``value / 256``, subnormals included), widened to float32 and multiplied
by ``256 * scale`` - the same real product, so the same float32 rounding as
``value * scale``, and no float32 subnormal ever enters the arithmetic. Work runs
in row bands of about 256K elements with reused scratch buffers, which keeps it in
cache; a band is part of one block row or a run of whole block rows, so a view of the
per-column factors applies. Recipes compute one thread ahead of the writer (see
``_prefetched``) with one torch thread, set by the consuming main thread (a worker
never changes torch's process-wide thread count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .dtypes import DTYPES, FLOAT_DTYPES, FP8_WEIGHT_DTYPES, SCALE_DTYPES, from_torch, lookup, torch_dtype
from .errors import InputError, PlanError
from .fp8_decode import band_rows, bands
from .numeric import COMPUTE_THREADS, torch_threads
from .plan import Compute, OutputTensor
from .prefetch import prefetched
from .safetensors_io import TensorRef

FP8_MAX = 448.0  # largest finite e4m3fn value
FLT_MIN = 2.0**-126  # smallest normal float32: floor of every block scale (all-zero blocks included)
DEFAULT_BLOCK = (128, 128)
BAND_ELEMS = 1 << 18  # elements per compute step: ~2 MB of scratch, cache-resident (measured best 2^18..2^19)
PREFETCH = 2  # chunks computed ahead in a worker thread while the writer writes and hashes (0: inline)
QUANT_DTYPE = "F8_E4M3"
SCALE_DTYPE = "F32"
_FAST_SCALE_LIMIT = 2.0**119  # 256 * scale stays finite below this


# ---------------------------------------------------------------------------
# Config


def _quant_config(config: Any) -> dict | None:
    get = getattr(config, "get", None)
    qc = get("quantization_config") if get is not None else None
    return qc if isinstance(qc, dict) else None


def is_fp8_config(config: Any) -> bool:
    """True when ``quantization_config.quant_method`` is ``fp8`` (a ConfigView or a plain dict)."""
    qc = _quant_config(config)
    return qc is not None and str(qc.get("quant_method", "")).lower() == "fp8"


def block_size(config: Any) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` as (rows, cols); 128 x 128 when absent.

    An explicit ``null`` means per-tensor FP8 (transformers' reading), which is not
    block quantization, so it is refused rather than guessed.
    """
    qc = _quant_config(config)
    if qc is None or "weight_block_size" not in qc:
        return DEFAULT_BLOCK
    return _check_block(qc["weight_block_size"], "quantization_config.weight_block_size")


def power_of_two_scales(config: Any) -> bool:
    """``quantization_config.scale_fmt: ue8m0`` (DeepSeek-V3.1 / V3.2): every block scale is a power of
    two, which engines may take as UE8M0 (DeepGEMM's scale format); a requantized weight must keep that."""
    qc = _quant_config(config)
    return qc is not None and str(qc.get("scale_fmt", "")).lower() == "ue8m0"


def _check_block(block: Any, what: str = "block") -> tuple[int, int]:
    ok = (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not ok:
        raise InputError(f"{what} must be two positive integers, got {block!r}", rule="fp8-block-size")
    return int(block[0]), int(block[1])


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight: last two dims divided by the block, rounded up."""
    if len(shape) < 2:
        raise InputError(f"block quantization needs at least 2 dims, got shape {list(shape)}", rule="fp8-shape")
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


# ---------------------------------------------------------------------------
# Row sources: where a recipe reads its input, one band of rows at a time


class RowSource(Protocol):
    """Rows of a (possibly stacked) matrix. ``shape`` is ``(*lead, rows, cols)``.

    ``read(lead, r0, r1, buf)`` returns rows ``[r0, r1)`` of the ``lead``-th matrix
    (lead dims flattened, C order) as a torch tensor ``[r1 - r0, cols]`` of the
    source's own dtype; ``buf`` is a scratch bytearray it may fill and view.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def read(self, lead: int, r0: int, r1: int, buf: bytearray) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorRows:
    """A RowSource over a TensorRef: the whole tensor, one expert of a 3-D stack
    (``expert=e``: a 2-D source) and/or a window of rows (``rows=(start, stop)``,
    e.g. the gate or up half of a fused ``gate_up``). Reads only those bytes."""

    ref: TensorRef
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        shape = self.ref.shape
        if len(shape) < 2:
            raise InputError(f"{self.ref.key}: needs at least 2 dims, has {list(shape)}", rule="fp8-shape",
                             path=self.ref.file)
        if self.expert is not None and not (len(shape) == 3 and 0 <= self.expert < shape[0]):
            raise ValueError(f"{self.ref.key}: expert {self.expert} outside shape {list(shape)}")
        if self.rows is not None and not (0 <= self.rows[0] <= self.rows[1] <= shape[-2]):
            raise ValueError(f"{self.ref.key}: rows {self.rows} outside shape {list(shape)}")

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def dtype(self) -> str:
        return self.ref.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, rows, cols = self.ref.shape
        if self.rows is not None:
            rows = self.rows[1] - self.rows[0]
        if self.expert is not None:
            lead = []
        return (*lead, rows, cols)

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].nbytes(math.prod(self.shape))

    def read(self, lead: int, r0: int, r1: int, buf: bytearray) -> torch.Tensor:
        full_rows, cols = self.ref.shape[-2:]
        item = DTYPES[self.dtype].bits // 8
        if self.expert is not None:
            lead = self.expert
        start = self.rows[0] if self.rows is not None else 0
        offset = ((lead * full_rows) + start + r0) * cols * item
        n = (r1 - r0) * cols * item
        if n == 0:
            return torch.empty((r1 - r0, cols), dtype=torch_dtype(self.dtype))
        mv = memoryview(buf)[:n]
        self.ref.source.readinto(self.ref.offset + offset, mv)
        return torch.frombuffer(mv, dtype=torch_dtype(self.dtype)).view(r1 - r0, cols)


def _as_rows(src: TensorRef | RowSource) -> RowSource:
    return TensorRows(src) if isinstance(src, TensorRef) else src


def _file_of(src: Any) -> str | None:
    ref = getattr(src, "ref", src)
    return getattr(ref, "file", None)


# ---------------------------------------------------------------------------
# Element kernels


def _scale_to_f32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float32:
        return scale
    return scale.to(torch.float32)  # exact for BF16 / F16 / E8M0 (2**(b-127), 0xff NaN)


def _has_nan_bytes(raw: torch.Tensor, fmt: str) -> bool:
    """e4m3fn has NaN only at 0x7f / 0xff: the int8 max and the uint8 max, so two cheap reductions find them."""
    if fmt != "F8_E4M3" or raw.numel() == 0:
        return False
    u8 = raw.view(torch.uint8).numpy()  # numpy's byte reductions are the faster ones here
    return bool(u8.view("int8").max() == 127) or bool(u8.max() == 255)


def _decode_into(raw: torch.Tensor, i16: torch.Tensor, out: torch.Tensor, fmt: str) -> None:
    """Write ``value / 256`` (e4m3) or ``value`` (e5m2) of the fp8 bytes ``raw`` into float32 ``out``, exactly."""
    if fmt == "F8_E4M3":
        # sign-extend to int16, move the 7 magnitude bits to float16's exponent/mantissa
        # position and keep the sign at bit 15: the float16 of value * 2**-8
        i16.copy_(raw.view(torch.int8))
        i16.bitwise_left_shift_(7)
        i16.bitwise_and_(-16385)  # 0xBFFF: clear bit 14, a copy of the sign
    elif fmt == "F8_E5M2":
        # e5m2 is the top byte of a float16 (inf and NaN included)
        i16.copy_(raw.view(torch.uint8))
        i16.bitwise_left_shift_(8)
    else:
        raise InputError(f"cannot dequantize {fmt}; expected one of {FP8_WEIGHT_DTYPES}", rule="fp8-dtype")
    out.copy_(i16.view(torch.float16))


def _multiplier(scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, float | None]:
    """(factor, pre) so that ``decoded * pre * factor`` equals ``value * scale`` exactly."""
    if fmt != "F8_E4M3":
        return scale, None
    if scale.numel() == 0 or bool((scale.abs() < _FAST_SCALE_LIMIT).all()):  # NaN / Inf fail this too
        return scale * 256.0, None  # exact: a power-of-two multiple that cannot overflow
    return scale, 256.0


class _BandKernel:
    """Dequantizes row bands with reused scratch buffers (one per run of a recipe)."""

    def __init__(self, fmt: str, cols: int, max_rows: int) -> None:
        self.fmt = fmt
        self.cols = cols
        n = max(1, max_rows * cols)
        self.i16 = torch.empty(n, dtype=torch.int16)
        self.f32 = torch.empty(n, dtype=torch.float32)

    def dequant(self, raw: torch.Tensor, col_scale: torch.Tensor, br: int, pre: float | None) -> torch.Tensor:
        """float32 ``value * scale`` of ``raw`` [rows, cols].

        ``col_scale`` [g, cols] holds the factors (from ``_multiplier``) of the block rows
        the band covers; the band starts on a block-row boundary or lies inside one block
        row (g = 1). Returns a view of the scratch buffer, valid until the next call."""
        rows = raw.shape[0]
        n = rows * self.cols
        i16 = self.i16[:n].view(rows, self.cols)
        out = self.f32[:n].view(rows, self.cols)
        _decode_into(raw, i16, out, self.fmt)
        if pre is not None:
            out.mul_(pre)
        if col_scale.shape[0] == 1:
            out.mul_(col_scale[0])
        else:
            _apply_row_blocks(out, col_scale, br, torch.Tensor.mul_)
        if _has_nan_bytes(raw, self.fmt):
            u8 = raw.view(torch.uint8)
            out[(u8 & 0x7F) == 0x7F] = float("nan")
        return out


def _step(cols: int, block_rows: int) -> int:
    return band_rows(cols, block_rows, BAND_ELEMS)  # BAND_ELEMS read here: tests vary it


_bands = bands


def _expand_cols(scale_rows: torch.Tensor, bc: int, cols: int) -> torch.Tensor:
    """[..., g] per-block values -> [..., cols] per-column values (edge block cropped)."""
    return scale_rows.repeat_interleave(bc, dim=-1)[..., :cols]


def _apply_row_blocks(x: torch.Tensor, per_col: torch.Tensor, br: int, op: Callable) -> None:
    """``op(x_rows, factor)`` in place on [..., rows, cols] with per-row-block factors [..., g, cols]."""
    rows = x.shape[-2]
    full = rows // br
    if full:
        op(x[..., : full * br, :].unflatten(-2, (full, br)), per_col[..., :full, None, :])
    if rows % br:
        op(x[..., full * br :, :], per_col[..., full : full + 1, :])


# ---------------------------------------------------------------------------
# Whole-tensor API


def _fmt_of(q: torch.Tensor) -> str:
    if q.dtype == torch.float8_e4m3fn:
        return "F8_E4M3"
    if q.dtype == torch.float8_e5m2:
        return "F8_E5M2"
    raise InputError(f"expected a float8_e4m3fn or float8_e5m2 tensor, got {q.dtype}", rule="fp8-dtype")


def _check_grid(shape, scale_shape, block, what: str = "scale", path: str | None = None) -> None:
    want = grid_shape(tuple(shape), block)
    if tuple(scale_shape) != want:
        raise PlanError(
            f"{what} has shape {list(scale_shape)}, but a {list(shape)} weight with block {list(block)} needs "
            f"{list(want)}",
            rule="fp8-scale-shape",
            path=path,
        )


@dataclass(frozen=True)
class _MemoryRows:
    """A RowSource over an in-memory contiguous tensor (bands are views, no copies)."""

    t: torch.Tensor
    key: str = "tensor"

    @property
    def dtype(self) -> str:
        return from_torch(self.t.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def nbytes(self) -> int:
        return self.t.numel() * self.t.element_size()

    def read(self, lead: int, r0: int, r1: int, buf: bytearray) -> torch.Tensor:
        return self.t.view(-1, *self.t.shape[-2:])[lead, r0:r1]


def dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, *, dtype=torch.float32
) -> torch.Tensor:
    """``q * scale_inv`` per block (float32 product) for a 2-D or stacked fp8 tensor; edge tiles cropped.

    The result is float32, or ``dtype`` (one rounding of the float32 product, without a
    float32 copy of the whole tensor). Works in cache-sized bands on COMPUTE_THREADS threads.
    """
    block = _check_block(block)
    _fmt_of(q)
    _check_grid(q.shape, scale_inv.shape, block)
    src = _MemoryRows(q.contiguous())
    out = torch.empty(q.shape, dtype=dtype)
    flat = out.view(-1, *q.shape[-2:]) if q.dim() >= 2 else out
    with _torch_threads(COMPUTE_THREADS):
        for li, r0, r1, band in _dequant_bands(src, _scale_to_f32(scale_inv), block):
            flat[li, r0:r1].copy_(band)
    return out


def _block_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[..., rows, cols] -> [..., ceil(rows/br), ceil(cols/bc)] max |x| (NaN propagates)."""

    def reduce(t: torch.Tensor, dim: int, b: int) -> torch.Tensor:
        n = t.shape[dim]
        if n == 0 or t.numel() == 0:  # empty weights have an empty grid
            shape = list(t.shape)
            shape[dim] = -(-n // b)
            return t.new_zeros(shape)
        full = n // b
        parts = []
        if full:
            parts.append(t.narrow(dim, 0, full * b).unflatten(dim, (full, b)).amax(dim=dim + 1 if dim >= 0 else dim))
        if n % b:
            parts.append(t.narrow(dim, full * b, n - full * b).amax(dim=dim, keepdim=True))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    a = x.abs()
    return reduce(reduce(a, -1, bc), -2, br)


def _scales_from_amax(amax: torch.Tensor, where: str, path: str | None = None, pow2: bool = False) -> torch.Tensor:
    if not bool(torch.isfinite(amax).all()):
        bad = (~torch.isfinite(amax)).nonzero()[0].tolist()
        raise InputError(f"{where} holds NaN or Inf (block {bad}); FP8 quantization needs finite values",
                         rule="fp8-nonfinite", path=path)
    s = amax / FP8_MAX  # float32 division, correctly rounded: the fixed-point property needs exactly this
    s.clamp_(min=FLT_MIN)
    if pow2:  # rounded up to a power of two, as DeepSeek's ue8m0 quantizer does: 2 ** ceil(log2(s))
        mant, exp = torch.frexp(s)
        s = torch.where(mant == 0.5, s, torch.ldexp(torch.ones_like(s), exp))
    return s


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest even e4m3fn, saturating at +-448 (explicit: torch versions differ above 448)."""
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
             pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a float tensor (2-D or stacked) to (float8_e4m3fn weight, float32 scale_inv).

    Values are taken as float32 first (exact for BF16 / F16; F64 rounds once). ``pow2``: scales rounded
    up to powers of two (``scale_fmt: ue8m0``, DeepSeek's rule); then the round trip is a fixed point in
    values, not always in bytes (a block whose largest code rounds down to 224 comes back with half the
    scale and doubled codes: the same values).
    """
    br, bc = _check_block(block)
    if not w.dtype.is_floating_point or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InputError(f"quantize needs a float tensor, got {w.dtype}", rule="fp8-dtype")
    grid_shape(tuple(w.shape), (br, bc))
    with _torch_threads(COMPUTE_THREADS):
        x = w.to(torch.float32, copy=True).contiguous()
        scale = _scales_from_amax(_block_amax(x, br, bc), "input", pow2=pow2)
        _apply_row_blocks(x, _expand_cols(scale, bc, x.shape[-1]), br, lambda t, f: t.div_(f))
        return _to_e4m3(x), scale.contiguous()


# ---------------------------------------------------------------------------
# Streaming recipes


def _torch_threads(n: int):
    """``n`` torch threads for band work, set on the main thread only (see ``numeric.torch_threads``)."""
    return torch_threads(n, load=True)


def _prefetched(make: Callable[[], Iterable[Any]], depth: int | None = None) -> Iterator[Any]:
    """``prefetch.prefetched``, the worker starting with COMPUTE_THREADS torch threads.

    The consumer's thread sets the count (when it is the main thread) before the worker
    starts and restores it when the iteration ends: the worker never sets it itself.
    """
    with _torch_threads(COMPUTE_THREADS):
        yield from prefetched(make, PREFETCH if depth is None else depth)


def _read_scale(src: RowSource) -> torch.Tensor:
    """The scale grid (small: one float per block) as float32 [lead, gr, gc], read exactly once."""
    *_, rows, cols = src.shape
    lead = _lead(src.shape)
    out = torch.empty((lead, rows, cols), dtype=torch.float32)
    buf = bytearray(rows * cols * (DTYPES[src.dtype].bits // 8))
    for li in range(lead):
        out[li].copy_(src.read(li, 0, rows, buf))  # exact widening (F32 / BF16 / F16 / E8M0)
    return out


def _lead(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-2])


def _check_pair(q_src: RowSource, s_src: RowSource, block: tuple[int, int]) -> str:
    """Plan-time checks of a weight and its scale: dtypes, grid shape, block alignment of row windows."""
    if q_src.dtype not in FP8_WEIGHT_DTYPES:
        raise PlanError(f"{q_src.key} is {q_src.dtype}, not an FP8 weight ({', '.join(FP8_WEIGHT_DTYPES)})",
                        rule="fp8-dtype", path=_file_of(q_src))
    if s_src.dtype not in SCALE_DTYPES:
        raise PlanError(f"scale {s_src.key} of {q_src.key} is {s_src.dtype}; expected one of {SCALE_DTYPES}",
                        rule="fp8-scale-dtype", path=_file_of(s_src))
    _check_grid(q_src.shape, s_src.shape, block, what=f"scale {s_src.key} of {q_src.key}", path=_file_of(s_src))
    window = getattr(q_src, "rows", None)
    if isinstance(window, tuple) and window[0] % block[0]:
        raise PlanError(f"{q_src.key}: rows {window[0]}..{window[1]} start inside a {block[0]}-row scale block",
                        rule="fp8-block-misaligned", path=_file_of(q_src))
    return q_src.dtype


def _dequant_bands(q_src: RowSource, s_src: RowSource | torch.Tensor, block: tuple[int, int]):
    """Yield (lead, r0, r1, float32 band view) over the whole weight; views are reused.

    ``s_src`` is the scale as a RowSource (read once) or a float32 tensor."""
    br, bc = block
    fmt = q_src.dtype
    *_, rows, cols = q_src.shape
    scale = s_src.reshape(-1, *s_src.shape[-2:]) if isinstance(s_src, torch.Tensor) else _read_scale(s_src)
    factor, pre = _multiplier(scale, fmt)
    step = _step(cols, br)
    kern = _BandKernel(fmt, cols, step)
    buf = bytearray(step * cols)
    last = -1
    col_factor = factor[0]
    for li, r0, r1 in _bands(_lead(q_src.shape), rows, br, step):
        if li != last:  # per-column factors of one matrix: [gr, cols], small
            last = li
            col_factor = _expand_cols(factor[li], bc, cols).contiguous()
        raw = q_src.read(li, r0, r1, buf)
        yield li, r0, r1, kern.dequant(raw, col_factor[r0 // br : (r1 - 1) // br + 1], br, pre)


def dequant_recipe(
    weight_ref: TensorRef | RowSource,
    scale_ref: TensorRef | RowSource,
    out_dtype: str = "BF16",
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> Compute:
    """A Compute recipe that streams the dequantized weight in ``out_dtype`` (BF16 / F16 / F32).

    Reads the scale grid once and the weight in row bands of about ``BAND_ELEMS``
    elements (never more than one block row of one expert), so memory stays a few MB
    whatever the tensor size. Checks dtypes and the scale shape now, at plan time.
    One expert of a stack: ``dequant_recipe(TensorRows(w, expert=e), TensorRows(s, expert=e))``.
    """
    block = _check_block(block)
    src = _as_rows(weight_ref)
    scale_src = _as_rows(scale_ref)
    fmt = _check_pair(src, scale_src, block)
    out = lookup(out_dtype).name
    if out not in ("BF16", "F16", "F32"):
        raise PlanError(f"cannot dequantize {src.key} to {out_dtype}; use BF16, F16 or F32", rule="fp8-out-dtype")
    tdt = torch_dtype(out)

    def chunks() -> Iterator[torch.Tensor]:
        for _li, _r0, _r1, band in _dequant_bands(src, scale_src, block):
            yield band.clone() if out == "F32" else band.to(tdt)  # fresh tensor: consumers may keep chunks

    def produce() -> Iterator[torch.Tensor]:
        return _prefetched(chunks)

    return Compute(
        produce,
        "dequant",
        inputs=[src.key, scale_src.key],
        detail={"from": fmt, "to": out, "block": list(block), "scale": scale_src.key},
        read_bytes=src.nbytes + scale_src.nbytes,
    )


@dataclass
class RequantRecipes:
    """The two outputs of requantizing one tensor: the F8_E4M3 weight and its F32 scale grid.

    Each recipe reads the source once, band by band (a band is one block row of one
    expert, so memory stays bounded by ~block_rows x cols floats); the per-block amax is
    computed in both, which is cheap next to reading. Emit them with ``outputs()``.
    """

    weight: Compute
    scale: Compute
    shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    weight_dtype: str = QUANT_DTYPE
    scale_dtype: str = SCALE_DTYPE
    meta: dict = field(default_factory=dict)

    def outputs(self, weight_key: str, scale_key: str, *, shard: str | None = None,
                meta: dict | None = None) -> list[OutputTensor]:
        m = {**self.meta, **(meta or {})}
        return [
            OutputTensor(weight_key, self.weight_dtype, self.shape, self.weight, shard=shard, meta=dict(m)),
            OutputTensor(scale_key, self.scale_dtype, self.scale_shape, self.scale, shard=shard,
                         meta={**m, "role": "scale"}),
        ]


def _quant_bands(src: RowSource, block: tuple[int, int]):
    """Yield (float32 values [rows, cols], scale row [gc]) per block row, in C order."""
    br, bc = block
    *_, rows, cols = src.shape
    item = DTYPES[src.dtype].bits // 8
    buf = bytearray(min(br, rows) * cols * item)
    f32 = torch.empty(min(br, rows) * cols, dtype=torch.float32)
    for li, r0, r1 in _bands(_lead(src.shape), rows, br, br):  # amax needs whole block rows
        x = f32[: (r1 - r0) * cols].view(r1 - r0, cols)
        x.copy_(src.read(li, r0, r1, buf))
        amax = _block_amax(x, r1 - r0, bc)[0]
        where = f"{src.key}" + (f" (matrix {li}, rows {r0}..{r1})" if _lead(src.shape) > 1 else f" (rows {r0}..{r1})")
        yield x, _scales_from_amax(amax, where, _file_of(src))


def requant_recipes(value_source: TensorRef | RowSource, block: tuple[int, int] = DEFAULT_BLOCK) -> RequantRecipes:
    """Plan the block-FP8 requantization of draft values (any float dtype, 2-D or stacked).

    ``value_source`` is a TensorRef or any RowSource (e.g. ``TensorRows(ref, expert=e)``
    for one expert of a stack, or a custom source that reorders a fused tensor);
    the results match ``quantize(values)`` byte for byte.
    """
    block = _check_block(block)
    src = _as_rows(value_source)
    if src.dtype not in FLOAT_DTYPES:
        raise PlanError(f"cannot quantize {src.key}: {src.dtype} is not a float dtype ({sorted(FLOAT_DTYPES)})",
                        rule="fp8-dtype", path=_file_of(src))
    shape = tuple(src.shape)
    sshape = grid_shape(shape, block)
    bc = block[1]

    def weight_chunks() -> Iterator[torch.Tensor]:
        for x, s in _quant_bands(src, block):
            x.div_(_expand_cols(s, bc, x.shape[-1]))
            yield _to_e4m3(x)  # a fresh tensor; x is scratch

    def scale_chunks() -> Iterator[torch.Tensor]:
        for _x, s in _quant_bands(src, block):
            yield s

    detail = {"from": src.dtype, "to": QUANT_DTYPE, "block": list(block)}
    return RequantRecipes(
        weight=Compute(lambda: _prefetched(weight_chunks), "quantize", inputs=[src.key], detail=detail,
                       read_bytes=src.nbytes),
        scale=Compute(scale_chunks, "quantize-scale", inputs=[src.key], detail=dict(detail, to=SCALE_DTYPE),
                      read_bytes=src.nbytes),
        shape=shape,
        scale_shape=sshape,
        meta={"source": src.key, "quant": "fp8-block", "block": list(block)},
    )


def unchanged_after_dequant(
    draft_ref: TensorRef | RowSource,
    verifier_q_ref: TensorRef | RowSource,
    verifier_scale_ref: TensorRef | RowSource,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> bool:
    """True when the draft equals ``dequantize(verifier)`` cast to the draft's dtype, bit for bit.

    Then the verifier's FP8 bytes and scale can be kept as they are, so an untouched
    round trip (dequantize -> train nothing -> stitch) is byte-identical. Streams both
    tensors band by band and stops at the first differing band. Different shapes or a
    non-float draft give False.
    """
    block = _check_block(block)
    draft = _as_rows(draft_ref)
    q_src = _as_rows(verifier_q_ref)
    s_src = _as_rows(verifier_scale_ref)
    _check_pair(q_src, s_src, block)
    if tuple(draft.shape) != tuple(q_src.shape) or draft.dtype not in FLOAT_DTYPES:
        return False
    tdt = torch_dtype(draft.dtype)
    item = DTYPES[draft.dtype].bits // 8
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[item]
    *_, rows, cols = q_src.shape
    step = _step(cols, block[0])
    buf = bytearray(step * cols * item)
    cast = torch.empty(step * cols, dtype=tdt)
    with _torch_threads(COMPUTE_THREADS):
        for li, r0, r1, band in _dequant_bands(q_src, s_src, block):
            d = draft.read(li, r0, r1, buf)
            c = cast[: band.numel()].view(band.shape)
            c.copy_(band)
            if not torch.equal(c.view(bits), d.view(bits)):
                return False
    return True
