"""FP8 block dequantization in numpy, for the streaming paths (``extract --dequant``).

Same arithmetic as ``fp8.dequantize`` (the torch implementation, which stitch, diff and
the tests use and which the tests hold this one to, byte for byte)::

    W[r, c] = float32(Q[r, c]) * scale_inv[r // br, c // bc]     (one float32 rounding)

then one round-to-nearest-even cast to the output dtype. Why a second implementation:
importing torch costs 1.5-2.5 s on a small machine, more than dequantizing a 4 GB
checkpoint's MTP layer takes, and nothing else on the extract path needs torch.

FP8 codes are decoded through a 256-entry float32 table (every e4m3 / e5m2 value is
exact in float32), multiplied by per-column scale factors in cache-sized row bands,
and bf16 is produced by integer rounding of the float32 bits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .errors import InputError, PlanError
from .prefetch import prefetched

BAND_ELEMS = 1 << 18  # elements per compute step: a few MB of scratch, cache-resident
OUT_DTYPES = ("BF16", "F16", "F32")
_BF16_NAN = np.uint16(0xFFFF)  # the NaN torch's float32 -> bfloat16 cast produces (its vectorised kernel)


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte: bias 7, subnormals, NaN at 0x7f / 0xff, no infinities."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * np.exp2(exp - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(codes & 0x7F) == 0x7F] = np.nan
    return out


def _e5m2_table() -> np.ndarray:
    """float32 value of every e5m2 byte: the top byte of a float16 (infinities and NaN included)."""
    return (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)


TABLES = {"F8_E4M3": _e4m3_table(), "F8_E5M2": _e5m2_table()}
# NaN codes are the top of the positive and of the negative range: e4m3fn 0x7f / 0xff, e5m2 0x7d-0x7f / 0xfd-0xff
FIRST_NAN_CODE = {"F8_E4M3": 0x7F, "F8_E5M2": 0x7D}


def scale_to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Scale grid values as float32 (exact for every scale dtype) from their storage array."""
    if dtype == "F32":
        return raw.view(np.float32)
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "F8_E8M0":  # 2 ** (b - 127); 0xff is NaN
        b = raw.view(np.uint8)
        return np.where(b == 0xFF, np.float32(np.nan), np.ldexp(np.float32(1.0), b.astype(np.int32) - 127))
    raise PlanError(f"scale dtype {dtype} is not one of F32, BF16, F16, F8_E8M0", rule="fp8-scale-dtype")


def band_rows(cols: int, block_rows: int, band_elems: int | None = None) -> int:
    """Rows per band, about ``band_elems`` (default BAND_ELEMS) elements: part of one block row,
    or whole block rows."""
    rows = max(1, (BAND_ELEMS if band_elems is None else band_elems) // max(cols, 1))
    return rows if rows < block_rows else rows // block_rows * block_rows


def bands(lead: int, rows: int, block_rows: int, step: int) -> Iterator[tuple[int, int, int]]:
    """(lead, r0, r1) bands in C order, never spanning two matrices of a stack. A band either
    lies inside one block row or starts on a block-row boundary (``step`` from ``band_rows``)."""
    for li in range(lead):
        if step >= block_rows:
            for r0 in range(0, rows, step):
                yield li, r0, min(r0 + step, rows)
            continue
        for b0 in range(0, rows, block_rows):
            b1 = min(b0 + block_rows, rows)
            for r0 in range(b0, b1, step):
                yield li, r0, min(r0 + step, b1)


class BandDequantizer:
    """Dequantizes row bands of one weight into reused scratch buffers."""

    def __init__(self, fmt: str, scale: np.ndarray, shape: tuple[int, ...], block: tuple[int, int],
                 out_dtype: str, thread_scratch: bool = False) -> None:
        """``thread_scratch``: borrow this thread's scratch buffers (for a dequantizer used start to
        finish without another one running in between on the same thread)."""
        if fmt not in TABLES:
            raise PlanError(f"cannot dequantize {fmt}; expected one of {', '.join(TABLES)}", rule="fp8-dtype")
        if out_dtype not in OUT_DTYPES:
            raise PlanError(f"cannot dequantize to {out_dtype}; expected one of {', '.join(OUT_DTYPES)}",
                            rule="dequant-dtype")
        *_, rows, cols = shape
        br, bc = block
        grid = (*shape[:-2], math.ceil(rows / br), math.ceil(cols / bc))
        if tuple(scale.shape) != grid:
            raise PlanError(f"scale grid {list(scale.shape)} does not fit a {list(shape)} weight in {br}x{bc} blocks",
                            rule="fp8-scale")
        self.table, self.out_dtype, self.block = TABLES[fmt], out_dtype, block
        self.rows, self.cols = rows, cols
        self.scale = scale.reshape(-1, *grid[-2:]).astype(np.float32, copy=False)
        self.step = band_rows(cols, br)
        self.first_nan_code = FIRST_NAN_CODE[fmt]
        self.finite_scales = bool(np.isfinite(self.scale).all())  # else inf x 0 or NaN scales make NaN
        n = self.step * cols
        self._values = _scratch("values", n, np.float32) if thread_scratch else np.empty(n, dtype=np.float32)
        self._bits = _scratch("bits", n, np.uint32) if thread_scratch else np.empty(n, dtype=np.uint32)
        self._half = _scratch("half", n, np.uint16) if thread_scratch else np.empty(n, dtype=np.uint16)
        self._factors: tuple[int, np.ndarray] | None = None

    def dequant(self, codes: np.ndarray, lead: int, r0: int) -> np.ndarray:
        """Values of the ``codes`` band [n, cols] at rows ``r0``.. of matrix ``lead``, in the output
        dtype's storage (uint16 for bf16). A view of a scratch buffer (valid until the next call)
        unless the output is F16."""
        n, cols = codes.shape
        values = self._values[: n * cols].reshape(n, cols)
        np.take(self.table, codes, out=values, mode="clip")  # codes < 256: nothing to clip; "raise" buffers
        with np.errstate(over="ignore", invalid="ignore"):  # Inf and NaN are kept, as torch keeps them
            self._scale(values, lead, r0)
        return self._encode(values, maybe_nan=not self.finite_scales or self._has_nan_code(codes))

    def _has_nan_code(self, codes: np.ndarray) -> bool:
        """Two byte reductions instead of a float pass: NaN codes are the largest of each sign."""
        if codes.size == 0:
            return False
        return bool(codes.view(np.int8).max() >= self.first_nan_code or codes.max() >= 0x80 | self.first_nan_code)

    def _scale(self, values: np.ndarray, lead: int, r0: int) -> None:
        n, cols = values.shape
        br = self.block[0]
        factors = self._column_factors(lead)[r0 // br : (r0 + n - 1) // br + 1] if n else None
        if n and factors.shape[0] == 1:
            values *= factors[0]
        elif n:
            full = (r0 + n) // br * br - r0  # bands of whole block rows start on a boundary: r0 % br == 0
            if full:
                values[:full].reshape(full // br, br, cols)[...] *= factors[: full // br, None, :]
            if full < n:
                values[full:] *= factors[-1]

    def _column_factors(self, lead: int) -> np.ndarray:
        """[gr, cols] per-column scale of matrix ``lead`` (edge block cropped), kept for its bands."""
        if self._factors is None or self._factors[0] != lead:
            bc = self.block[1]
            self._factors = (lead, np.repeat(self.scale[lead], bc, axis=-1)[:, : self.cols])
        return self._factors[1]

    def _encode(self, values: np.ndarray, maybe_nan: bool) -> np.ndarray:
        if self.out_dtype == "F32":
            return values
        if self.out_dtype == "F16":
            with np.errstate(over="ignore"):  # overflow to +-inf, as torch does
                return values.astype(np.float16)  # numpy rounds to nearest even, like torch
        # bf16: round to nearest even on the float32 bits; every NaN becomes torch's 0xFFFF
        bits = self._bits[: values.size].reshape(values.shape)
        u = values.view(np.uint32)
        np.right_shift(u, 16, out=bits)
        np.bitwise_and(bits, 1, out=bits)
        bits += 0x7FFF
        bits += u
        np.right_shift(bits, 16, out=bits)
        out = self._half[: values.size].reshape(values.shape)
        np.copyto(out, bits, casting="unsafe")  # the top 16 bits are zero after the shift
        if maybe_nan:
            nan = np.isnan(values)
            out[nan] = _BF16_NAN
        return out


_SCRATCH = threading.local()


def _scratch(name: str, n: int, dtype) -> np.ndarray:
    """A per-thread buffer of at least ``n`` elements, reused across dequantizers: fresh multi-MB
    arrays per expert piece cost more in page faults than the arithmetic."""
    pool = _SCRATCH.__dict__
    buf = pool.get(name)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = pool[name] = np.empty(max(n, 1), dtype=dtype)
    return buf


def dequant_array(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int], fmt: str, out_dtype: str,
                  scale_dtype: str = "F32") -> np.ndarray:
    """A whole [..., rows, cols] FP8 weight (uint8 storage) -> values in ``out_dtype`` storage."""
    codes = np.ascontiguousarray(codes).view(np.uint8)
    kern = BandDequantizer(fmt, scale_to_f32(np.ascontiguousarray(scale), scale_dtype), codes.shape, block,
                           out_dtype, thread_scratch=True)
    rows, cols = codes.shape[-2:]
    flat = codes.reshape(-1, rows, cols)
    out = np.empty(flat.shape, dtype=_storage(out_dtype))
    for li, r0, r1 in bands(flat.shape[0], rows, block[0], kern.step):
        out[li, r0:r1] = kern.dequant(flat[li, r0:r1], li, r0)
    return out.reshape(codes.shape)


def dequant_stream(read: Callable[[int], Any], shape: tuple[int, ...], fmt: str, scale: np.ndarray,
                   out_dtype: str = "BF16", block: tuple[int, int] = (128, 128)) -> Iterator[np.ndarray]:
    """Dequantize a weight whose bytes come from a sequential reader (``read(n)`` -> the next
    ``n`` bytes, C order), band by band, one worker thread ahead of the consumer.

    ``scale`` is the whole (small) float32 scale grid. Yields fresh storage arrays."""
    shape = tuple(shape)
    kern = BandDequantizer(fmt, scale, shape, block, out_dtype)
    rows, cols = shape[-2:]
    lead = math.prod(shape[:-2])

    def produce() -> Iterator[np.ndarray]:
        for li, r0, r1 in bands(lead, rows, block[0], kern.step):
            n = (r1 - r0) * cols
            data = read(n) if n else b""
            if len(data) != n:
                raise InputError(f"short read: {len(data)} of {n} bytes", rule="fp8-stream")
            codes = np.frombuffer(data, dtype=np.uint8).reshape(r1 - r0, cols)
            yield np.array(kern.dequant(codes, li, r0), copy=True)

    return prefetched(produce)


def _storage(out_dtype: str) -> np.dtype:
    return np.dtype({"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[out_dtype])


__all__ = ["BAND_ELEMS", "BandDequantizer", "TABLES", "band_rows", "bands", "dequant_array", "dequant_stream",
           "scale_to_f32"]
