"""Integer encoders: compressed-tensors' int-quantized (``ct-int8``) and pack-quantized (``ct-pack``) formats.

Each reproduces compressed-tensors 0.20.1 as llm-compressor runs it (symmetric weights, round to nearest):
a min-max observer over the weight in the model's dtype (``calculate_qparams``: ``scale = absmax /
(bit_range / 2)``, ``bit_range = q_max - q_min`` = 255 for 8 bits, 15 for 4, in the scale's dtype, eps for
zero), then ``_quantize`` (``round(clamp(x / scale, q_min, q_max))`` in that dtype) and, for pack-quantized,
``pack_to_int32`` (codes offset by ``2**(bits-1)``, packed densely, element i at bit ``i * bits`` of its
group of 32, little-endian I32 words) with the true shape in ``weight_shape``. Held byte for byte to the
library's compressors and to llm-compressor's outputs in fixtures/producers (tests/test_quant_encode.py).
Asymmetric weights (zero points) have no encoder here: they are refused with rule ``quant-encode``.
Registered in ``codec.CODECS``, under the names the tables use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...dtypes import torch_dtype
from ...errors import PlanError
from .encode_core import EncodeArgs, _absmax, _expand, _tile_minmax

if TYPE_CHECKING:
    import torch


def _tile(args: EncodeArgs, shape: tuple[int, int]) -> tuple[int, int]:
    """One scale's tile: tensor, channel or group (compressed-tensors' strategies for integer weights)."""
    rows, cols = shape
    strategy = str(args.params.get("strategy") or "tensor")
    if args.params.get("symmetric") is False:
        raise PlanError("asymmetric integer weights (zero points) have no encoder", rule="quant-encode")
    if strategy == "tensor":
        return rows, cols
    if strategy == "channel":
        return 1, cols
    if strategy == "group" and args.params.get("group_size") and cols % int(args.params["group_size"]) == 0:
        return 1, int(args.params["group_size"])
    raise PlanError(f"integer strategy {strategy!r} (group_size {args.params.get('group_size')}) over {cols} "
                    "columns has no encoder (tensor, channel, group dividing the columns)", rule="quant-encode")


def _grid(args: EncodeArgs, shape: tuple[int, int]) -> tuple[int, ...]:
    tile = _tile(args, shape)
    if tile == shape:
        return (1,)
    return -(-shape[0] // tile[0]), -(-shape[1] // tile[1])


def _bits(args: EncodeArgs, default: int) -> int:
    bits = int(args.params.get("num_bits") or default)
    if bits not in (4, 8):
        raise PlanError(f"{bits}-bit integer weights have no encoder (4 or 8 bits)", rule="quant-encode")
    return bits


def _codes(values: torch.Tensor, args: EncodeArgs, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [rows, cols], scale grid) as compressed-tensors computes them, in the scale's dtype."""
    import torch

    dtype = torch_dtype(args.dtypes.get("weight_scale", args.model_dtype))
    x = values.to(dtype)
    shape = (int(x.shape[0]), int(x.shape[1]))
    tile = _tile(args, shape)
    q_min, q_max = torch.tensor(-(2.0 ** (bits - 1))), torch.tensor(2.0 ** (bits - 1) - 1)
    scale = _absmax(*_tile_minmax(x, tile)) / ((q_max - q_min).to(dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale)
    # + 0: the compressor adds the (zero) symmetric zero point before rounding
    scaled = x / _expand(scale, tile, shape) + torch.zeros((), dtype=dtype)
    q = torch.round(torch.clamp(scaled, q_min, q_max)).to(torch.int8)
    return q, scale.reshape(1) if tile == shape else scale.contiguous()


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` along the columns for 4 or 8 bits: ``code + 2**(bits-1)``,
    ``32 / bits`` per little-endian word, element i at bit ``i * bits`` (the last word zero-padded)."""
    import numpy as np
    import torch

    per = 32 // bits
    rows, cols = codes.shape
    v = (codes.to(torch.int32) + (1 << (bits - 1))).numpy().astype(np.uint32)
    pad = -cols % per
    if pad:
        v = np.pad(v, ((0, 0), (0, pad)))
    v = v.reshape(rows, -1, per) << (np.arange(per, dtype=np.uint32) * bits)
    words = np.bitwise_or.reduce(v, axis=2).astype(np.uint32)
    return torch.from_numpy(np.ascontiguousarray(words).view(np.int32))


def int8_layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    _bits(args, 8)
    return {"weight": ("I8", shape), "weight_scale": (args.dtypes.get("weight_scale", args.model_dtype),
                                                      _grid(args, shape))}


def ct_int8(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """compressed-tensors int-quantized INT8 (IntQuantizationCompressor): I8 codes and ``weight_scale``."""
    q, scale = _codes(values, args, _bits(args, 8))
    return {"weight": q.contiguous(), "weight_scale": scale}


def pack_layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    bits = _bits(args, 4)
    rows, cols = shape
    return {"weight_packed": ("I32", (rows, -(-cols * bits // 32))),
            "weight_scale": (args.dtypes.get("weight_scale", args.model_dtype), _grid(args, shape)),
            "weight_shape": (args.dtypes.get("weight_shape", "I64"), (2,))}


def ct_pack(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized INT4 / INT8 (PackedQuantizationCompressor): packed I32 codes,
    ``weight_scale`` and ``weight_shape``."""
    import torch

    bits = _bits(args, 4)
    q, scale = _codes(values, args, bits)
    shape_dtype = torch_dtype(args.dtypes.get("weight_shape", "I64"))
    return {"weight_packed": pack_int32(q, bits), "weight_scale": scale,
            "weight_shape": torch.tensor(list(values.shape), dtype=shape_dtype)}
