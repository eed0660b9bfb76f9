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
from .plan import CopyBytes, Recipe
from .safetensors_io import TensorRef

CHUNK_ELEMS = 1 << 20  # elements per compared chunk


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
    acc = _Acc()
    done = 0
    while done < numel:
        n = min(CHUNK_ELEMS, numel - done)
        ba, bb = ra.read(sa.nbytes(n)), rb.read(sb.nbytes(n))
        vb = decode_b(bb, done, n) if decode_b else decode_floats(bb, b_dtype)
        vb = np.asarray(vb, dtype=np.float32) if not isinstance(vb, np.ndarray) else vb
        if with_a:
            va = decode_a(ba, done, n) if decode_a else decode_floats(ba, a_dtype)
            acc.add(np.asarray(va, dtype=np.float32) if not isinstance(va, np.ndarray) else va, vb)
        else:
            acc.nonfinite += int(np.count_nonzero(~np.isfinite(vb)))
        done += n
    d.nonfinite = acc.nonfinite
    if with_a:
        d.max_abs, d.rel_l2, d.cosine = acc.result()


def decode_floats(buf: bytearray, dtype: str) -> np.ndarray:
    """float32 values of a float tensor's raw bytes (bf16 widened by a 16-bit shift: exact)."""
    if dtype == "BF16":
        return (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype in ("F16", "F32", "F64"):
        return np.frombuffer(buf, dtype={"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype])
    raise ValueError(f"{dtype} is not a float dtype numpy can decode")


class _Acc:
    """Running sums for max |a - b|, ||a - b|| / ||a|| and cosine(a, b).

    Chunks are widened to float64 once and reduced with BLAS dot products: a cosine of
    0.99999 must be told from 0.999999, which float32 sums over a million values cannot.
    """

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.diff2 = 0.0
        self.a2 = 0.0
        self.b2 = 0.0
        self.ab = 0.0
        self.nonfinite = 0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        a = a.astype(np.float32, copy=False)
        b = b.astype(np.float32, copy=False)
        bad = int(np.count_nonzero(~np.isfinite(b)))
        if bad or not np.isfinite(a).all():  # rare: keep the statistics finite and count the damage
            self.nonfinite += bad
            a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
            b = np.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0)
        a = a.astype(np.float64)
        b = b.astype(np.float64)
        diff = a - b
        if diff.size:  # two plain reductions: np.abs(...).max() is several times slower
            self.max_abs = max(self.max_abs, float(diff.max()), -float(diff.min()))
        self.diff2 += float(np.dot(diff, diff))
        self.a2 += float(np.dot(a, a))
        self.b2 += float(np.dot(b, b))
        self.ab += float(np.dot(a, b))

    def result(self) -> tuple[float, float, float]:
        rel = math.sqrt(self.diff2) / math.sqrt(self.a2) if self.a2 > 0 else (0.0 if self.diff2 == 0 else math.inf)
        denom = math.sqrt(self.a2) * math.sqrt(self.b2)
        cos = self.ab / denom if denom > 0 else (1.0 if self.a2 == self.b2 == 0 else 0.0)
        return self.max_abs, rel, min(1.0, max(-1.0, cos))


__all__ = ["TensorDiff", "compare", "count_nonfinite", "decode_floats", "recipe_of", "FP8_DTYPES"]
