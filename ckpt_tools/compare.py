"""Streaming comparison of two tensors: byte identity first, numeric statistics when they differ.

Used by `ckpt diff` and by stitch's validation report. Both sides are read in matching
chunks, so memory stays bounded whatever the tensor size. Equal bytes are settled by a
byte comparison alone; statistics (max |a - b|, relative L2, cosine, NaN/Inf count)
are computed only for tensors that differ, decoding floats with numpy (bf16 by a bit
shift), so no arithmetic library is loaded for an unchanged checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .dtypes import DTYPES, FLOAT_DTYPES, FP8_DTYPES
from .numeric import Scratch, decode_floats
from .plan import CopyBytes, Recipe
from .safetensors_io import TensorRef

CHUNK_ELEMS = 1 << 20  # elements per chunk when comparing bytes or counting NaN/Inf
STATS_CHUNK_ELEMS = 1 << 16  # elements per statistics chunk: its temporaries stay in the CPU cache


@dataclass
class TensorDiff:
    key: str
    status: str  # unchanged | replaced | added | removed | dtype-changed | shape-changed
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: list | None = None
    shape_b: list | None = None
    max_abs: float | None = None
    rel_l2: float | None = None
    cosine: float | None = None
    nonfinite: int = 0  # NaN / Inf count on the B side (the written side in stitch)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and not (k == "nonfinite" and v == 0)}


def recipe_of(ref: TensorRef) -> Recipe:
    return CopyBytes([ref.segment()])


def compare(key: str, a_dtype: str, a_shape, a: Recipe, b_dtype: str, b_shape, b: Recipe, *, stats: bool = True,
            finite: bool = True, decode_a=None, decode_b=None) -> TensorDiff:
    """Compare two tensors given as recipes (A = before, B = after).

    ``decode_a``/``decode_b`` optionally turn a chunk's raw bytes into float32 values
    (e.g. FP8 dequantization: ``decode(buf, first_element, n)``); by default floats are
    decoded by dtype and other dtypes compare as bytes only.
    """
    d = TensorDiff(key, "unchanged", a_dtype, b_dtype, list(a_shape), list(b_shape))
    if list(a_shape) != list(b_shape):
        d.status = "shape-changed"
        return d
    if a_dtype == b_dtype and decode_a is None and decode_b is None and _same_bytes(a, b, a_dtype, a_shape):
        return d
    d.status = "replaced" if a_dtype == b_dtype else "dtype-changed"
    decodable_a = decode_a is not None or a_dtype in FLOAT_DTYPES
    decodable_b = decode_b is not None or b_dtype in FLOAT_DTYPES
    if decodable_b and (stats or finite):
        _statistics(d, a, b, a_dtype, b_dtype, a_shape, decode_a, decode_b, stats and decodable_a)
    return d


def count_nonfinite(recipe: Recipe, dtype: str, shape) -> int:
    """NaN and Inf values a float tensor's recipe produces (0 for other dtypes)."""
    from .transforms import RecipeReader

    if dtype not in FLOAT_DTYPES:
        return 0
    reader, numel, done, bad = RecipeReader(recipe), math.prod(shape), 0, 0
    while done < numel:
        n = min(CHUNK_ELEMS, numel - done)
        bad += int(np.count_nonzero(~np.isfinite(decode_floats(reader.read(DTYPES[dtype].nbytes(n)), dtype))))
        done += n
    return bad


def _same_bytes(a: Recipe, b: Recipe, dtype: str, shape) -> bool:
    from .transforms import RecipeReader

    nbytes = DTYPES[dtype].nbytes(math.prod(shape))
    chunk = DTYPES[dtype].nbytes(CHUNK_ELEMS) or CHUNK_ELEMS
    ra, rb = RecipeReader(a), RecipeReader(b)
    done = 0
    while done < nbytes:
        n = min(chunk, nbytes - done)
        if ra.read(n) != rb.read(n):
            return False
        done += n
    return True


def _statistics(d: TensorDiff, a: Recipe, b: Recipe, a_dtype: str, b_dtype: str, shape, decode_a, decode_b,
                with_a: bool) -> None:
    """Second pass over both tensors: NaN/Inf on B, and (``with_a``) the difference statistics."""
    from .transforms import RecipeReader

    numel = math.prod(shape)
    ra, rb = RecipeReader(a), RecipeReader(b)
    sa, sb = DTYPES[a_dtype], DTYPES[b_dtype]
    scratch_a, scratch_b = Scratch(), Scratch()  # decoded chunks reuse two buffers
    acc = _Acc()
    done = 0
    while done < numel:
        n = min(STATS_CHUNK_ELEMS, numel - done)
        ba, bb = ra.read(sa.nbytes(n)), rb.read(sb.nbytes(n))
        vb = decode_b(bb, done, n) if decode_b else decode_floats(bb, b_dtype, scratch_b)
        vb = np.asarray(vb, dtype=np.float32) if not isinstance(vb, np.ndarray) else vb
        if with_a:
            va = decode_a(ba, done, n) if decode_a else decode_floats(ba, a_dtype, scratch_a)
            acc.add(np.asarray(va, dtype=np.float32) if not isinstance(va, np.ndarray) else va, vb)
        else:
            acc.nonfinite += int(np.count_nonzero(~np.isfinite(vb)))
        done += n
    d.nonfinite = acc.nonfinite
    if with_a:
        d.max_abs, d.rel_l2, d.cosine = acc.result()


class _Acc:
    """Running sums for max |a - b|, ||a - b|| / ||a|| and cosine(a, b).

    Each chunk is small enough to stay in the CPU cache (see STATS_CHUNK_ELEMS): the squares
    are taken in the inputs' precision (at least float32, rounding each by at most 2^-24)
    and summed pairwise in float64, so a cosine of 0.99999 is told from 0.999999 without
    widening every value to float64 in memory. The cosine comes from the norms,
    1 - cos = (||a - b||^2 - (||a|| - ||b||)^2) / (2 ||a|| ||b||), which stays accurate
    where a direct a.b / (||a|| ||b||) would round to 1. Sums of squares are finite when
    every value is, so the NaN/Inf scan runs only for chunks that have some.
    """

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.diff2 = 0.0
        self.a2 = 0.0
        self.b2 = 0.0
        self.nonfinite = 0
        self._scratch = Scratch()

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        a, b = a.reshape(-1), b.reshape(-1)
        work = np.result_type(a.dtype, b.dtype, np.float32)
        diff, square = self._buffers(work, a.size)
        a2, b2 = _sum_squares(a, square), _sum_squares(b, square)
        if not (math.isfinite(a2) and math.isfinite(b2)):  # rare: count the damage, keep the statistics finite
            self.nonfinite += int(np.count_nonzero(~np.isfinite(b)))
            a = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
            b = np.nan_to_num(b.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
            diff, square = np.empty_like(a), np.empty_like(a)
            a2, b2 = _sum_squares(a, square), _sum_squares(b, square)
        np.subtract(a, b, out=diff)
        if diff.size:  # two plain reductions: np.abs(...).max() is several times slower
            self.max_abs = max(self.max_abs, float(diff.max()), -float(diff.min()))
        self.diff2 += _sum_squares(diff, square)
        self.a2 += a2
        self.b2 += b2

    def _buffers(self, dtype: np.dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self._scratch.take("diff", n, dtype), self._scratch.take("square", n, dtype)

    def result(self) -> tuple[float, float, float]:
        na, nb = math.sqrt(self.a2), math.sqrt(self.b2)
        rel = math.sqrt(self.diff2) / na if na > 0 else (0.0 if self.diff2 == 0 else math.inf)
        if na > 0 and nb > 0:
            cos = 1.0 - (self.diff2 - (na - nb) ** 2) / (2.0 * na * nb)
        else:
            cos = 1.0 if na == nb == 0 else 0.0
        return self.max_abs, rel, min(1.0, max(-1.0, cos))


def _sum_squares(x: np.ndarray, out: np.ndarray) -> float:
    np.multiply(x, x, out=out)
    return float(out.sum(dtype=np.float64))


__all__ = ["TensorDiff", "compare", "count_nonfinite", "decode_floats", "recipe_of", "FP8_DTYPES"]
