"""FP8 block quantization (DeepSeek style): the format, its config, and the quantizer (torch).

A quantized ``X.weight`` is ``F8_E4M3`` ``[..., out, in]`` with ``X.weight_scale_inv`` of
``[..., ceil(out/br), ceil(in/bc)]`` (block ``br x bc``, usually 128 x 128; edge tiles partial).
Dequantization (numpy, ``fp8_decode``) is ``W = float32(Q) * scale_inv[r // br, c // bc]``, then one
round-to-nearest-even cast. Quantization (``quantize``), per block::

    s = max(float32(amax / 448), 2**-126)     (a true division; zero and tiny blocks get 2**-126)
    Q = e4m3_rne(clamp(W / s, -448, 448))      (NaN / Inf inputs raise)

With ``s = fl(amax / 448)`` (not transformers' ``1 / (448 / amax)``) the round trip is a fixed point:
``quantize(dequantize(Q, s)) == (Q, s)`` byte for byte (tests/test_fp8.py checks a whole binade).
``block_scales`` (the scale grid) and ``quantize_with`` (the codes) split one band's work so a weight
and its scale share one grid. torch is imported inside those functions only. The block and ``scale_fmt``
a checkpoint declares are its scheme table's parameters (model/quant), not read here.
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
