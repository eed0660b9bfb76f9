"""FP8 block quantization (DeepSeek style): the format, its config, and the quantizer (torch).

The two backends of block FP8, and who runs them:

- dequantization is numpy, in ``fp8_decode`` (``extract --dequant``, ``unfuse-experts --dequant``,
  stitch's comparisons, ``diff --dequant``, the scheme decoders in ``quant``);
- quantization is torch, here (``quantize``), run one band at a time by ``transforms.requantize``
  (stitch and graft re-quantizing MTP weights) and whole by the test fixtures.

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

A band of whole block rows is quantized by ``block_scales`` (the scale grid rows) and then
``quantize_with`` (the codes): the split lets the scale recipe and the weight recipe of one
tensor share one grid instead of quantizing twice. torch is imported by those functions only.
The block and ``scale_fmt`` a checkpoint declares are its scheme table's parameters
(``weight_block_size``, ``scale_fmt``: model/quant), not read here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0  # largest finite e4m3fn value
FLT_MIN = 2.0**-126  # smallest normal float32: floor of every block scale (all-zero blocks included)
DEFAULT_BLOCK = (128, 128)


# ---------------------------------------------------------------------------
# Shapes


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
# Quantization


def quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
             pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a float tensor (2-D or stacked) to (float8_e4m3fn weight, float32 scale_inv).

    Values are taken as float32 first (exact for BF16 / F16; F64 rounds once). ``pow2``: scales rounded
    up to powers of two (``scale_fmt: ue8m0``, DeepSeek's rule); then the round trip is a fixed point in
    values, not always in bytes (a block whose largest code rounds down to 224 comes back with half the
    scale and doubled codes: the same values).
    """
    import torch

    block = _check_block(block)
    if not w.dtype.is_floating_point or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InputError(f"quantize needs a float tensor, got {w.dtype}", rule="fp8-dtype")
    grid_shape(tuple(w.shape), block)
    x = w.to(torch.float32, copy=True).contiguous()
    scale = block_scales(x, block, pow2=pow2)
    return quantize_with(x, scale, block), scale.contiguous()


def block_scales(x: torch.Tensor, block: tuple[int, int], *, pow2: bool = False, where: str = "input",
                 path: str | None = None) -> torch.Tensor:
    """The scale grid ``[..., ceil(rows/br), ceil(cols/bc)]`` of float32 values ``[..., rows, cols]``.

    ``where`` / ``path`` name the values in the error a NaN or Inf raises."""
    import torch

    amax = _block_amax(x, *block)
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


def quantize_with(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 codes of float32 values ``x`` with their scale grid (from ``block_scales``); ``x`` is
    divided in place (scratch)."""
    br, bc = block
    _apply_row_blocks(x, scale.repeat_interleave(bc, dim=-1)[..., : x.shape[-1]], br, _div)
    return _to_e4m3(x)


def _div(t: torch.Tensor, f: torch.Tensor) -> None:
    t.div_(f)


def _block_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[..., rows, cols] -> [..., ceil(rows/br), ceil(cols/bc)] max |x| (NaN propagates)."""
    import torch

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


def _apply_row_blocks(x: torch.Tensor, per_col: torch.Tensor, br: int, op: Callable) -> None:
    """``op(x_rows, factor)`` in place on [..., rows, cols] with per-row-block factors [..., g, cols]."""
    rows = x.shape[-2]
    full = rows // br
    if full:
        op(x[..., : full * br, :].unflatten(-2, (full, br)), per_col[..., :full, None, :])
    if rows % br:
        op(x[..., full * br :, :], per_col[..., full : full + 1, :])


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest even e4m3fn, saturating at +-448 (explicit: torch versions differ above 448)."""
    import torch

    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
