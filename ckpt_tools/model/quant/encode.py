"""Encoders: float values into one storage format's tensors, the inverse of ``decode`` (torch, CPU).

Each is ``(values [rows, cols], EncodeArgs) -> {suffix: tensor}`` with its layout, registered by name in
``codec.CODECS`` (what a scheme table's ``encoder:`` names). Each reproduces its producer operation for
operation, so its bytes are the producer's: compressed-tensors' FP8 / NVFP4 / MXFP4 as llm-compressor runs
it, ModelOpt's FP8 / NVFP4 export; the integer ones are in ``encode_int``, the block one in ``encode_block``.

A shard of an engine-fused layer takes the group's per-tensor quantity (``EncodeArgs.group_absmax``),
as the producers do for a layer vLLM loads with one scale. The compute dtype is the producer's (read off
the stored scale, or ``EncodeArgs.model_dtype``). Activation scales come from calibration: encoders do
not write them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...dtypes import torch_dtype
from ...errors import PlanError
from .encode_core import EncodeArgs, _absmax, _expand, _tile_minmax

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0
FP4_MAX = 6.0


def _tensor_absmax(x: torch.Tensor, args: EncodeArgs) -> torch.Tensor:
    """max |x| as a 0-d tensor of x's dtype, or the fused group's (``args.group_absmax``)."""
    import torch

    if args.group_absmax is not None:
        return torch.tensor(args.group_absmax, dtype=x.dtype)
    return _absmax(x.amin(), x.amax())


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.clamp(x, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _eps(dtype: torch.dtype) -> float:
    import torch

    return 0.125 if dtype == torch.float8_e4m3fn else float(torch.finfo(dtype).eps)


def _ct_fp8_tile(args: EncodeArgs, shape: tuple[int, int]) -> tuple[int, int]:
    rows, cols = shape
    strategy = str(args.params.get("strategy") or "tensor")
    if strategy == "tensor":
        return rows, cols
    if strategy == "channel":
        return 1, cols
    if strategy == "group" and args.params.get("group_size"):
        return 1, int(args.params["group_size"])
    if strategy == "block" and args.params.get("block"):
        br, bc = args.params["block"]
        return int(br), int(bc)
    raise PlanError(f"compressed-tensors FP8 strategy {strategy!r} has no encoder (tensor, channel, group, block)",
                    rule="quant-encode")


def _per_tensor(args: EncodeArgs) -> bool:
    return str(args.params.get("strategy") or "tensor") == "tensor"


def ct_fp8_layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    tile = _ct_fp8_tile(args, shape)
    grid = (1,) if _per_tensor(args) else (-(-shape[0] // tile[0]), -(-shape[1] // tile[1]))
    return {"weight": ("F8_E4M3", shape), "weight_scale": (args.dtypes.get("weight_scale", args.model_dtype), grid)}


def ct_fp8(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """compressed-tensors FP8 (tensor / channel / group / block): ``scale = absmax / 448`` in the scale's
    dtype (eps for zero), ``weight = e4m3(clamp(x / scale))`` with the quotient in that dtype."""
    import torch

    dtype = torch_dtype(args.dtypes.get("weight_scale", args.model_dtype))
    x = values.to(dtype)
    tile = _ct_fp8_tile(args, tuple(x.shape))
    scale = _absmax(*_tile_minmax(x, tile)) / torch.tensor(2 * FP8_MAX, dtype=dtype).div(2)
    scale = torch.where(scale == 0, torch.tensor(_eps(dtype), dtype=dtype), scale)
    # + 0: the compressor adds the (zero) symmetric zero point, which turns -0.0 into +0.0
    q = _e4m3(x / _expand(scale, tile, tuple(x.shape)) + torch.zeros((), dtype=dtype))
    return {"weight": q.contiguous(), "weight_scale": scale.reshape(1) if _per_tensor(args) else scale.contiguous()}


def cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``cast_to_fp4`` (CPU path): round to the nearest e2m1 value, ties as it breaks them."""
    import torch

    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def pack_fp4(x: torch.Tensor) -> torch.Tensor:
    """e2m1 values [rows, cols] -> U8 [rows, cols / 2], low nibble first; the sign bit is the value's
    (a negative value rounded to zero keeps it: code 8), as ``pack_fp4_to_uint8`` writes it."""
    import torch

    sign = torch.signbit(x).to(torch.uint8)
    mag = (x * 2).to(torch.int8).abs_()
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for code, twice in enumerate((1, 2, 3, 4, 6, 8), start=1):
        idx[mag == twice] = code
    idx[mag >= 12] = 7
    idx = (idx | (sign << 3)).reshape(-1, 2)
    return (idx[:, 0] | (idx[:, 1] << 4)).reshape(x.shape[0], x.shape[1] // 2)


def _fp4_codes(x: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``pack(cast_to_fp4(clamp(x / scale)))`` with a float32 scale per ``group`` columns."""
    import torch

    rows, cols = x.shape
    if cols % group or cols % 2:
        raise PlanError(f"NVFP4 needs columns divisible by {group}, got {cols}", rule="quant-encode")
    scaled = x.unflatten(-1, (cols // group, group)) / scale.unsqueeze(-1)
    q = cast_to_fp4(torch.clamp(scaled, -FP4_MAX, FP4_MAX)).flatten(-2).to(x.dtype)
    return pack_fp4(q)


def fp4_layout(scale2: str, scale2_shape: tuple[int, ...]) -> Callable:
    def layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
        rows, cols = shape
        group = int(args.params.get("group_size") or 16)
        if cols % group or cols % 2:  # refused when planned: the encoder's unflatten would fail mid-write
            raise PlanError(f"NVFP4 needs columns divisible by {group}, got {cols}", rule="quant-encode")
        weight = "weight_packed" if scale2 == "weight_global_scale" else "weight"
        return {weight: ("U8", (rows, cols // 2)), "weight_scale": ("F8_E4M3", (rows, cols // group)),
                scale2: ("F32", scale2_shape)}
    return layout


def ct_nvfp4(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4 (tensor_group): global ``g = 2688 / absmax`` in the model dtype, then F32;
    group scales ``e4m3(g * (absmax_g / 6))`` (0 -> 0.125); codes of ``x / (scale / g)`` in float32."""
    import torch

    dtype = torch_dtype(args.model_dtype)
    group = int(args.params.get("group_size") or 16)
    x = values.to(dtype)
    m = _tensor_absmax(x, args).reshape(1)
    m = torch.clamp(m, min=torch.finfo(dtype).tiny)
    g = torch.nan_to_num(FP8_MAX * FP4_MAX / m, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)
    lo, hi = _tile_minmax(x, (1, group))
    s = g * (_absmax(lo, hi) / torch.tensor(2 * FP4_MAX, dtype=dtype).div(2))
    s = _e4m3(s).to(torch.float32)
    s = torch.where(s == 0, torch.tensor(0.125, dtype=torch.float32), s)
    packed = _fp4_codes(x, s / g, group)
    return {"weight_packed": packed, "weight_scale": s.to(torch.float8_e4m3fn), "weight_global_scale": g}


def _round_to_power_2(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``round_to_power_2`` for e2m1 elements: the exponent bits of ``x`` after adding half of
    the bits below e2m1's one mantissa bit (so 1.75 * 2**k rounds up to 2**(k+1)), the rest cleared."""
    import torch

    if x.dtype == torch.bfloat16:
        bits, mantissa, width = x.view(torch.int16).to(torch.int32) & 0xFFFF, 7, 8
    elif x.dtype == torch.float32:
        bits, mantissa, width = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, 23, 8
    else:
        raise PlanError(f"MXFP4 scales from {x.dtype} values have no encoder (BF16, F32)", rule="quant-encode")
    mask = ((1 << (width + 1)) - 1) << mantissa
    out = (bits + (1 << (mantissa - 2))) & mask
    return out.to(torch.int16).view(torch.bfloat16) if x.dtype == torch.bfloat16 else out.to(torch.int32).view(x.dtype)


def mxfp4_layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    group = int(args.params.get("group_size") or 32)
    if group != 32 or shape[1] % 32:
        raise PlanError(f"MXFP4 is e2m1 codes in groups of 32 columns; got group {group}, {shape[1]} columns",
                        rule="quant-encode")
    return {"weight_packed": ("U8", (shape[0], shape[1] // 2)), "weight_scale": ("U8", (shape[0], shape[1] // 32))}


def ct_mxfp4(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """compressed-tensors MXFP4 (MXFP4PackedCompressor): per 32 values, the E8M0 exponent
    ``127 + floor(log2(round_to_power_2(absmax))) - 2`` (clamped to a byte; an all-zero group's scale
    ``2**-127``), codes ``cast_to_fp4(clamp(x / scale, -6, 6))`` in the model dtype, packed as NVFP4's."""
    import torch

    mxfp4_layout(tuple(values.shape), args)
    dtype = torch_dtype(args.model_dtype)
    x = values.to(dtype)
    m = _absmax(*_tile_minmax(x, (1, 32)))
    e = 127 + torch.floor(torch.log2(_round_to_power_2(m))) - 2  # in the model dtype, as the observer computes
    e = torch.round(torch.clamp(e, 0, 255)).to(torch.uint8)
    scale = (2.0 ** (e.to(torch.int32) - 127).to(torch.float)).to(dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    packed = _fp4_codes(x, scale, 32)
    return {"weight_packed": packed, "weight_scale": (127 + torch.floor(torch.log2(scale)).to(torch.int32)).to(
        torch.uint8)}


def _positive(scale: torch.Tensor) -> torch.Tensor:
    """An all-zero weight's per-tensor scale: float32 eps instead of 0 (as compressed-tensors' calculate_qparams
    does), so no scale is zero and no group scale divides by it (rule quant-scale-value); its codes stay 0."""
    import torch

    return torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).eps))


def modelopt_fp8_layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {"weight": ("F8_E4M3", shape), "weight_scale": ("F32", ())}


def modelopt_fp8(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """ModelOpt FP8 per tensor: ``weight_scale = amax / 448`` (float32), ``weight = e4m3(x / scale)`` with the
    quotient rounded to the model dtype first (as ModelOpt's export divides the weight by a 0-d scale)."""
    algo = str(args.params.get("algo") or "FP8").upper()
    if algo != "FP8":
        raise PlanError(f"ModelOpt {algo} has no encoder (per-tensor FP8 only)", rule="quant-encode")
    import torch

    x = values.to(torch_dtype(args.model_dtype))
    scale = _positive((_tensor_absmax(x, args).float() / FP8_MAX).reshape(()))
    q = _e4m3(x / scale)  # a 0-d float32 scale: the quotient is in the model dtype
    return {"weight": q, "weight_scale": scale.to(torch.float32)}


def modelopt_nvfp4(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4: ``weight_scale_2 = amax / (6 * 448)``; group scales ``e4m3(amax_g / (6 * ws2))``
    (0 -> 1); codes of ``x / (scale * ws2)``, packed low nibble first."""
    import torch

    group = int(args.params.get("group_size") or 16)
    x = values.to(torch_dtype(args.model_dtype))
    ws2 = _positive((_tensor_absmax(x, args).float() / (FP4_MAX * FP8_MAX)).reshape(()))
    x = x.float()
    amax_g = x.abs().unflatten(-1, (x.shape[-1] // group, group)).amax(-1)
    s = _e4m3(amax_g / (FP4_MAX * ws2)).to(torch.float32)
    s = torch.where(s == 0, torch.ones_like(s), s)
    packed = _fp4_codes(x, s * ws2, group)
    return {"weight": packed, "weight_scale": s.to(torch.float8_e4m3fn), "weight_scale_2": ws2}


def encode_matrices(enc: Callable, values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """``enc`` over every [rows, cols] matrix of a stack [..., rows, cols], outputs stacked the same way."""
    import torch

    *lead, rows, cols = values.shape
    if not lead:
        return enc(values, args)
    parts = [enc(m, args) for m in values.reshape(math.prod(lead), rows, cols)]
    return {k: torch.stack([p[k] for p in parts]).reshape(*lead, *parts[0][k].shape) for k in parts[0]}
