"""Streaming comparison of two tensors: byte identity plus numeric statistics.

Used by `ckpt diff` and by stitch's validation report. Both sides are read in
matching chunks, so memory stays bounded whatever the tensor size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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
            decode_a=None, decode_b=None) -> TensorDiff:
    """Compare two tensors given as recipes (A = before, B = after).

    ``decode_a``/``decode_b`` optionally turn a chunk's raw bytes into float32 values
    (e.g. FP8 dequantization); by default floats are decoded by dtype and other types
    compare as bytes only.
    """
    from .transforms import RecipeReader

    d = TensorDiff(key, "unchanged", a_dtype, b_dtype, list(a_shape), list(b_shape))
    if list(a_shape) != list(b_shape):
        d.status = "shape-changed"
        return d
    numel = math.prod(a_shape)
    ra, rb = RecipeReader(a), RecipeReader(b)
    sa, sb = DTYPES[a_dtype], DTYPES[b_dtype]
    same_bytes = a_dtype == b_dtype
    numeric = stats and (a_dtype in FLOAT_DTYPES | FP8_DTYPES or decode_a) and (b_dtype in FLOAT_DTYPES | FP8_DTYPES
                                                                                 or decode_b)
    acc = _Acc() if numeric else None
    done = 0
    while done < numel:
        n = min(CHUNK_ELEMS, numel - done)
        ba = ra.read(sa.nbytes(n))
        bb = rb.read(sb.nbytes(n))
        if same_bytes and ba != bb:
            same_bytes = False
        if acc is not None:
            va = decode_a(ba, done, n) if decode_a else _decode(ba, a_dtype)
            vb = decode_b(bb, done, n) if decode_b else _decode(bb, b_dtype)
            if va is not None and vb is not None:
                acc.add(va, vb)
        elif b_dtype in FLOAT_DTYPES:
            vb = _decode(bb, b_dtype)
            acc_nf = int((~vb.isfinite()).sum())
            d.nonfinite += acc_nf
        done += n
    if acc is not None:
        d.nonfinite = acc.nonfinite
        d.max_abs, d.rel_l2, d.cosine = acc.result()
    if a_dtype != b_dtype:
        d.status = "dtype-changed"
    elif not same_bytes:
        d.status = "replaced"
    return d


def _decode(buf: bytearray, dtype: str):
    from .numeric import bytes_to_torch

    if dtype not in FLOAT_DTYPES and dtype not in FP8_DTYPES:
        return None
    t = bytes_to_torch(buf, dtype, (len(buf) // DTYPES[dtype].nbytes(1),))
    return t.float()


class _Acc:
    """Running float64 sums for max |a - b|, ||a - b|| / ||a|| and cosine(a, b)."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.diff2 = 0.0
        self.a2 = 0.0
        self.b2 = 0.0
        self.ab = 0.0
        self.nonfinite = 0

    def add(self, a, b) -> None:
        import torch

        finite = torch.isfinite(b)
        self.nonfinite += int((~finite).sum())
        a64, b64 = a.double(), b.double()
        diff = (a64 - b64).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.abs().max()))
        self.diff2 += float((diff * diff).sum())
        self.a2 += float((a64 * a64).nan_to_num().sum())
        self.b2 += float((b64 * b64).nan_to_num().sum())
        self.ab += float((a64 * b64).nan_to_num().sum())

    def result(self) -> tuple[float, float, float]:
        rel = math.sqrt(self.diff2) / math.sqrt(self.a2) if self.a2 > 0 else (0.0 if self.diff2 == 0 else math.inf)
        denom = math.sqrt(self.a2) * math.sqrt(self.b2)
        cos = self.ab / denom if denom > 0 else (1.0 if self.a2 == self.b2 == 0 else 0.0)
        return self.max_abs, rel, cos
