"""Arithmetic on planned tensors, streamed in bands: casts, FP8 dequantization, half swaps.

Each function takes an ``OutputTensor`` (whatever its recipe: byte copies or a
computation) and returns a new one whose recipe reads the input recipe's bytes band by
band along the first axis, so memory stays bounded by one band, never a whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from .dtypes import DTYPES, FLOAT_DTYPES, FP8_DTYPES
from .errors import PlanError
from .numeric import as_bytes, bytes_to_numpy, bytes_to_torch
from .plan import Compute, CopyBytes, OutputTensor, Recipe
from .safetensors_io import read_bytes

BAND_BYTES = 16 << 20  # target size of one band of input


class RecipeReader:
    """Reads the bytes a recipe produces, in whatever sizes the caller asks for."""

    def __init__(self, recipe: Recipe) -> None:
        self._segments = list(recipe.segments) if isinstance(recipe, CopyBytes) else None
        self._seg_i = 0
        self._seg_pos = 0
        self._pieces = None if self._segments is not None else iter(recipe.produce())
        self._pending = memoryview(b"")

    def read(self, n: int) -> bytearray:
        out = bytearray()
        while len(out) < n:
            if self._segments is not None:
                if self._seg_i >= len(self._segments):
                    break
                seg = self._segments[self._seg_i]
                k = min(n - len(out), seg.length - self._seg_pos)
                out += read_bytes(seg.source, seg.offset + self._seg_pos, k)
                self._seg_pos += k
                if self._seg_pos == seg.length:
                    self._seg_i += 1
                    self._seg_pos = 0
            else:
                if not len(self._pending):
                    piece = next(self._pieces, None)
                    if piece is None:
                        break
                    self._pending = as_bytes(piece)
                    continue
                k = min(n - len(out), len(self._pending))
                out += self._pending[:k]
                self._pending = self._pending[k:]
        return out


def recipe_bytes(recipe: Recipe, chunk: int) -> Iterator[bytearray]:
    """The bytes a recipe produces, cut into chunks of ``chunk`` bytes (the last may be short)."""
    reader = RecipeReader(recipe)
    while True:
        buf = reader.read(chunk)
        if not buf:
            return
        yield buf


def _rows_per_band(t: OutputTensor, multiple: int = 1) -> int:
    rows = t.shape[0] if t.shape else 1
    row_bytes = max(1, t.nbytes // max(rows, 1))
    n = max(1, BAND_BYTES // row_bytes)
    n = max(multiple, n // multiple * multiple)
    return min(rows, n) if rows else 1


def _row_bytes(t: OutputTensor) -> int:
    return t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes


def cast(t: OutputTensor, dtype: str) -> OutputTensor:
    """``t`` converted to another float dtype (round to nearest even, as torch does)."""
    if t.dtype == dtype:
        return t
    if t.dtype in FP8_DTYPES or dtype in FP8_DTYPES:
        raise PlanError(f"{t.key}: casting {t.dtype} to {dtype} needs block scales; use --dequant", rule="fp8-cast")
    if t.dtype not in ("F16", "BF16", "F32", "F64") or dtype not in ("F16", "BF16", "F32", "F64"):
        raise PlanError(f"{t.key}: cannot cast {t.dtype} to {dtype}", rule="cast")
    src = t

    def produce():
        from .dtypes import torch_dtype

        band = _rows_per_band(src)
        rb = _row_bytes(src)
        for buf in recipe_bytes(src.recipe, band * rb if src.shape else src.nbytes):
            n = len(buf) // DTYPES[src.dtype].nbytes(1)
            yield bytes_to_torch(buf, src.dtype, (n,)).to(torch_dtype(dtype))

    return OutputTensor(t.key, dtype, t.shape, Compute(produce, "cast", _inputs(t), {"from": t.dtype, "to": dtype}),
                        t.shard, dict(t.meta))


def swap_halves(t: OutputTensor) -> OutputTensor:
    """Exchange the two halves of the last axis: ``[A | B] -> [B | A]`` (fusion input order)."""
    if not t.shape or t.shape[-1] % 2:
        raise PlanError(f"{t.key}: cannot swap halves of shape {list(t.shape)}", rule="concat-order")
    src = t

    def produce():
        band = _rows_per_band(src)
        rb = _row_bytes(src)
        width = src.shape[-1]
        for buf in recipe_bytes(src.recipe, band * rb):
            a = bytes_to_numpy(buf, src.dtype, (-1, width))
            half = width // 2
            out = a.copy()
            out[:, :half] = a[:, half:]
            out[:, half:] = a[:, :half]
            yield out

    return OutputTensor(t.key, t.dtype, t.shape, Compute(produce, "swap-halves", _inputs(t)), t.shard, dict(t.meta))


def dequantize(w: OutputTensor, scale: OutputTensor, dtype: str, block: tuple[int, int]) -> OutputTensor:
    """FP8 block-quantized ``w`` times its ``scale`` grid, as ``dtype``; bands of whole tile rows."""
    if w.dtype not in FP8_DTYPES:
        raise PlanError(f"{w.key} is {w.dtype}, not FP8", rule="dequant")
    if len(w.shape) < 2 or tuple(scale.shape[:-2]) != tuple(w.shape[:-2]):
        raise PlanError(f"{w.key}: scale shape {list(scale.shape)} does not fit {list(w.shape)}", rule="fp8-scale")
    expect = (*w.shape[:-2], math.ceil(w.shape[-2] / block[0]), math.ceil(w.shape[-1] / block[1]))
    if tuple(scale.shape) != expect:
        raise PlanError(f"{scale.key} has shape {list(scale.shape)}, expected {list(expect)} for {w.key}",
                        rule="fp8-scale")
    src, sc = w, scale

    def produce():
        from . import fp8
        from .dtypes import torch_dtype

        scales = bytes_to_torch(bytearray(b"".join(recipe_bytes(sc.recipe, max(sc.nbytes, 1)))), "F32", sc.shape)
        rows, cols = src.shape[-2], src.shape[-1]
        lead = math.prod(src.shape[:-2])
        s2 = scales.reshape(lead, *scales.shape[-2:])
        # bands of whole tile rows, so every band starts at a scale row
        band_rows = max(block[0], (BAND_BYTES // max(cols, 1)) // block[0] * block[0])
        out_dtype = torch_dtype(dtype)
        reader = RecipeReader(src.recipe)
        for e in range(lead):
            r = 0
            while r < rows:
                n = min(band_rows, rows - r)
                q = bytes_to_torch(reader.read(n * cols), src.dtype, (n, cols))
                srow = s2[e, r // block[0]: r // block[0] + math.ceil(n / block[0])]
                yield fp8.dequantize(q, srow, block).to(out_dtype)
                r += n

    meta = dict(w.meta)
    meta["dequantized_from"] = {"dtype": w.dtype, "scale": scale.key, "block": list(block)}
    return OutputTensor(w.key, dtype, w.shape, Compute(produce, "dequant", _inputs(w) + _inputs(scale)), w.shard, meta)


def _inputs(t: OutputTensor) -> list[str]:
    r = t.recipe
    if isinstance(r, Compute):
        return list(r.inputs)
    return list(t.meta.get("source", [])) or [t.key]


def requantize(t: OutputTensor, block: tuple[int, int], scale_key: str) -> tuple[OutputTensor, OutputTensor]:
    """Block-FP8 quantization of ``t``: the F8_E4M3 weight and its F32 ``weight_scale_inv`` grid.

    Both recipes walk ``t`` in bands of one block row (of one matrix of a stack), so
    memory stays at one band; the cheap per-block amax is simply computed in both.
    """
    if t.dtype not in FLOAT_DTYPES or len(t.shape) < 2:
        raise PlanError(f"{t.key}: cannot quantize {t.dtype} {list(t.shape)} to FP8", rule="fp8-dtype")
    *lead_dims, rows, cols = t.shape
    lead = math.prod(lead_dims)
    grid = (*lead_dims, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    src = t
    item = DTYPES[t.dtype].nbytes(1)

    def bands():
        from . import fp8

        reader = RecipeReader(src.recipe)
        for _ in range(lead):
            for r in range(0, rows, block[0]):
                n = min(block[0], rows - r)
                values = bytes_to_torch(reader.read(n * cols * item), src.dtype, (n, cols)).float()
                yield fp8.quantize(values, block)

    def weights():
        for q, _s in bands():
            yield q

    def scales():
        for _q, s in bands():
            yield s

    meta = dict(t.meta, quantized={"block": list(block)})
    w = OutputTensor(t.key, "F8_E4M3", t.shape, Compute(weights, "quantize", _inputs(t)), t.shard, meta)
    s = OutputTensor(scale_key, "F32", grid, Compute(scales, "quantize-scale", _inputs(t)), t.shard,
                     {"role": "scale", "source": _inputs(t)})
    return w, s
