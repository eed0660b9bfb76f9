"""Arithmetic on planned tensors, streamed in bands: casts, half swaps,
column-wise joins and splits (decoding a quantized weight is ``model.quant.dequant``'s).

Each function takes an ``OutputTensor`` (whatever its recipe: byte copies or a
computation) and returns a new one whose recipe reads the input recipe's bytes band by
band along the first axis, so memory stays bounded by one band, never a whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ..arrays import as_bytes, bytes_to_numpy, bytes_to_torch, torch_threads
from ..dtypes import DTYPES, FP8_DTYPES
from ..errors import PlanError
from ..io.safetensors_io import read_bytes
from ..stream.plan import Compute, CopyBytes, OutputTensor, Recipe

BAND_BYTES = 16 << 20  # target size of one band of input
TORCH_OPS = frozenset({"cast", "quantize", "quantize-scale"})  # the recipes below that compute with torch


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
                piece = read_bytes(seg.source, seg.offset + self._seg_pos, k)
                if out:
                    out += piece
                else:  # a fresh buffer: taken as it is, not copied
                    out = piece
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
        from ..dtypes import torch_dtype

        band = _rows_per_band(src)
        rb = _row_bytes(src)
        with torch_threads(load=True):  # one thread for the whole recipe (not switched per band)
            for buf in recipe_bytes(src.recipe, band * rb if src.shape else src.nbytes):
                n = len(buf) // DTYPES[src.dtype].nbytes(1)
                yield bytes_to_torch(buf, src.dtype, (n,)).to(torch_dtype(dtype))

    return OutputTensor(t.key, dtype, t.shape, Compute(produce, "cast", inputs_of(t), {"from": t.dtype, "to": dtype}),
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

    return OutputTensor(t.key, t.dtype, t.shape, Compute(produce, "swap-halves", inputs_of(t)), t.shard, dict(t.meta))


def _column_layout(shapes: list[tuple[int, ...]], dtype: str, what: str) -> tuple[tuple[int, ...], list[int]]:
    """Leading dims shared by every piece, and each piece's row width in bytes."""
    if not shapes or any(len(s) < 1 for s in shapes) or len({s[:-1] for s in shapes}) != 1:
        raise PlanError(f"{what}: pieces {[list(s) for s in shapes]} do not share their leading dimensions",
                        rule="concat-columns")
    widths = [DTYPES[dtype].nbytes(s[-1]) for s in shapes]
    if any(w <= 0 or s[-1] * DTYPES[dtype].bits % 8 for s, w in zip(shapes, widths, strict=True)):
        raise PlanError(f"{what}: columns must be whole bytes, got {[list(s) for s in shapes]} of {dtype}",
                        rule="concat-columns")
    return shapes[0][:-1], widths


def _bands_of_rows(lead: tuple[int, ...], row_bytes: int) -> Iterator[int]:
    """Row counts of successive bands covering every row (rows = product of the leading dims)."""
    rows = math.prod(lead)
    per = max(1, BAND_BYTES // max(row_bytes, 1))
    done = 0
    while done < rows:
        n = min(per, rows - done)
        yield n
        done += n


def concat_columns(parts: list[OutputTensor], key: str) -> OutputTensor:
    """``[A | B | ...]`` along the last axis: every part's row r, side by side (pure byte moves).

    The inverse of ``split_columns``; used where a format holds one ``[H, 2H]`` projection and
    the family stores its two ``[H, H]`` halves separately.
    """
    dtypes = {t.dtype for t in parts}
    if len(dtypes) != 1:
        raise PlanError(f"{key}: cannot join columns of different dtypes {sorted(dtypes)}", rule="concat-columns")
    dtype = dtypes.pop()
    lead, widths = _column_layout([tuple(t.shape) for t in parts], dtype, key)
    shape = (*lead, sum(t.shape[-1] for t in parts))
    srcs = list(parts)

    def produce():
        import numpy as np

        readers = [RecipeReader(t.recipe) for t in srcs]
        for n in _bands_of_rows(lead, sum(widths)):
            pieces = [np.frombuffer(r.read(n * w), dtype=np.uint8).reshape(n, w)
                      for r, w in zip(readers, widths, strict=True)]
            yield np.ascontiguousarray(np.concatenate(pieces, axis=1))

    inputs = [k for t in parts for k in inputs_of(t)]
    meta = {"source": inputs, "joined_columns": [t.key for t in parts]}
    return OutputTensor(key, dtype, shape, Compute(produce, "concat-columns", inputs), parts[0].shard, meta)


def split_columns(t: OutputTensor, pieces: list[tuple[str, int]]) -> list[OutputTensor]:
    """``t`` cut along its last axis into ``(key, width)`` pieces, in order (inverse of ``concat_columns``)."""
    if not t.shape or sum(w for _, w in pieces) != t.shape[-1]:
        raise PlanError(f"{t.key}: shape {list(t.shape)} does not split into widths {[w for _, w in pieces]}",
                        rule="concat-columns")
    lead, widths = _column_layout([(*t.shape[:-1], w) for _, w in pieces], t.dtype, t.key)
    total = sum(widths)
    offsets = [sum(widths[:k]) for k in range(len(widths))]
    src = t
    out = []
    for (key, width), off, wb in zip(pieces, offsets, widths, strict=True):
        def produce(off=off, wb=wb):
            import numpy as np

            reader = RecipeReader(src.recipe)
            for n in _bands_of_rows(lead, total):
                band = np.frombuffer(reader.read(n * total), dtype=np.uint8).reshape(n, total)
                yield np.ascontiguousarray(band[:, off:off + wb])

        out.append(OutputTensor(key, t.dtype, (*lead, width), Compute(produce, "split-columns", inputs_of(t),
                                                                     {"columns": [off, off + wb]}),
                                t.shard, dict(t.meta)))
    return out


def inputs_of(t: OutputTensor) -> list[str]:
    """The source keys a planned tensor is read from: its computation's inputs, else its ``source`` meta, else
    its own key (a byte copy of a stored tensor)."""
    r = t.recipe
    if isinstance(r, Compute):
        return list(r.inputs)
    return list(t.meta.get("source", [])) or [t.key]
