"""FP8 block dequantization in numpy: the band kernel the scheme decoders run for FP8 codes.

The arithmetic (``encode_block`` documents the format)::

    W[r, c] = float32(Q[r, c]) * scale_inv[r // br, c // bc]     (one float32 rounding)

then one round-to-nearest-even cast to the output dtype, as DeepSeek's kernel and transformers'
``Fp8Dequantize`` compute it (tests/test_fp8.py holds it to a float64 oracle and to transformers).
numpy, not torch: importing torch costs more than dequantizing an MTP layer takes.

Every e4m3 / e5m2 value is exact in float32 and an element's result depends on its code and its
block's scale alone: each block gets a 256-entry table of finished output values, and a band is
decoded with one lookup per element (``BandDequantizer``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ...arrays import Scratch, encode_floats, numpy_storage_dtype
from ...errors import PlanError

BAND_ELEMS = 1 << 18  # elements per compute step: a few MB of scratch, cache-resident
OUT_DTYPES = ("BF16", "F16", "F32")


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


def _check_format(fmt: str, what: str = "") -> None:
    if fmt not in TABLES:
        raise PlanError(f"{what}cannot dequantize {fmt}; expected one of {', '.join(TABLES)}", rule="fp8-dtype")


def check_grid(shape, scale_shape, block: tuple[int, int], what: str = "", path: str | None = None
               ) -> tuple[int, ...]:
    """The scale grid a ``shape`` weight has in ``block`` tiles; refused (fp8-scale-shape) when ``scale_shape``
    is another. ``what`` prefixes the message (e.g. the scale's key)."""
    *lead, rows, cols = shape
    br, bc = block
    grid = (*lead, math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale_shape) != grid:
        raise PlanError(f"{what}scale grid {list(scale_shape)} does not fit a {list(shape)} weight in {br}x{bc} "
                        f"blocks (needs {list(grid)})", rule="fp8-scale-shape", path=path)
    return grid


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
    """Dequantizes row bands of one weight with one table lookup per element.

    Every element of a block is a function of its code and the block's scale alone, so each
    block gets a 256-entry table of finished output values (``encode(fl(value * scale))``,
    exactly what the element-wise computation gives), and a band is decoded by indexing
    those tables with ``code + 256 * block``: one pass over the codes, whatever the output
    dtype, NaN and Inf included.
    """

    def __init__(self, fmt: str, scale: np.ndarray, shape: tuple[int, ...], block: tuple[int, int],
                 out_dtype: str, scratch: Scratch | None = None) -> None:
        """``scratch``: where the index buffer lives (shared by dequantizers used one after another)."""
        _check_format(fmt)
        if out_dtype not in OUT_DTYPES:
            raise PlanError(f"cannot dequantize to {out_dtype}; expected one of {', '.join(OUT_DTYPES)}",
                            rule="dequant-dtype")
        *_, rows, cols = shape
        br, bc = block
        grid = check_grid(shape, scale.shape, block)
        self.values, self.out_dtype, self.block = TABLES[fmt], out_dtype, block
        self.rows, self.cols = rows, cols
        self.scale = scale.reshape(-1, *grid[-2:]).astype(np.float32, copy=False)
        self.step = band_rows(cols, br)
        self.col_offset = (np.arange(cols, dtype=np.intp) // bc) * 256  # table of each column's block
        self.row_stride = grid[-1] * 256  # tables of one block row
        # the column's table inside its block row, as 16-bit indices when a block row has at most 256 blocks
        self.col_offset16 = self.col_offset.astype(np.uint16) if self.row_stride <= 1 << 16 else None
        self._scratch = scratch  # None: each decoding thread's own (bands may be decoded on several threads)
        self._tables: tuple[int, np.ndarray] | None = None
        # every table built so far writes no Inf, and NaN only as 0xFFFF (bf16; see ``vouches``)
        self._nan_top = out_dtype == "BF16"

    def dequant(self, codes: np.ndarray, lead: int, r0: int, out: np.ndarray) -> np.ndarray:
        """Values of the ``codes`` band [n, cols] at rows ``r0``.. of matrix ``lead``, written to
        ``out`` ([n, cols], C-contiguous, the output dtype's storage: uint16 for bf16)."""
        n, cols = codes.shape
        br = self.block[0]
        tables = self._block_tables(lead)
        scratch = self._scratch or thread_scratch()
        if self.col_offset16 is not None:  # a block row's tables fit 16-bit indices: a quarter of the index bytes
            index16 = scratch.take("index16", n * cols, np.uint16).reshape(n, cols)
            a = 0
            while a < n:  # rows of one block row share their tables
                brow = (r0 + a) // br
                b = min(n, (brow + 1) * br - r0)
                np.add(codes[a:b], self.col_offset16, out=index16[a:b], casting="unsafe")
                row_tables = tables[brow * self.row_stride:(brow + 1) * self.row_stride]
                np.take(row_tables, index16[a:b], out=out[a:b], mode="clip")  # in range; "raise" would buffer
                a = b
            return out
        index = scratch.take("index", n * cols, np.intp).reshape(n, cols)
        a = 0
        while a < n:  # rows of one block row share their tables
            brow = (r0 + a) // br
            b = min(n, (brow + 1) * br - r0)
            np.add(codes[a:b], self.col_offset + brow * self.row_stride, out=index[a:b])
            a = b
        np.take(tables, index, out=out, mode="clip")  # indices are in range; "raise" would buffer
        return out

    def _block_tables(self, lead: int) -> np.ndarray:
        """[gr * gc * 256] output values of every code in every block of matrix ``lead``."""
        tables = self._tables  # read once: another thread may replace it meanwhile
        if tables is None or tables[0] != lead:
            with np.errstate(over="ignore", invalid="ignore"):  # Inf and NaN are kept, as torch keeps them
                products = self.scale[lead][:, :, None] * self.values  # float32: one rounding, as per element
            table = encode_floats(products, self.out_dtype).reshape(-1)
            if self._nan_top and bool((table[(table & 0x7FFF) >= 0x7F80] != 0xFFFF).any()):
                self._nan_top = False  # before a band is decoded with it (then yielded and judged)
            tables = self._tables = (lead, table)
        return tables[1]

    def vouches(self, band: np.ndarray) -> bool:
        """True when ``band`` (bf16 storage decoded by this) holds no NaN / Inf, known from its maximum alone: every
        table so far writes no Inf and NaN only as 0xFFFF, and a finite bf16 is below 0xFF80 (-Inf), so one
        reduction replaces the masked scan (``finite.first_nonfinite``, which then names the index)."""
        return self._nan_top and int(band.max()) < 0xFF80


_THREAD = threading.local()


def thread_scratch() -> Scratch:
    """This thread's buffers, reused across the dequantizers of consecutive expert pieces."""
    if not hasattr(_THREAD, "scratch"):
        _THREAD.scratch = Scratch()
    return _THREAD.scratch


def whole_stream(read: Callable[[int], Any], stored: tuple[int, int, int], cols: int, out_dtype: str,
                 band_list: Iterable[tuple[int, int, int]], kernel: Callable[[np.ndarray, int, int, np.ndarray], Any],
                 short: Callable[[str], Exception], fill: Callable[[memoryview], bool] | None = None
                 ) -> Iterator[np.ndarray]:
    """A weight of ``stored`` [lead, rows, row bytes] uint8 read at once and decoded band by band on this thread
    (``kernel(raw, lead, r0, out)`` over ``band_list``) into one [lead, rows, cols] ``out_dtype`` array: a small
    tensor on a pool thread (stream.lookahead), the same bytes as the streamed bands. ``short(message)``: the
    error of a short read. ``fill(buffer)``: reads the bytes into this thread's scratch instead (no fresh zeroed
    buffer per tensor); False when it does not hold exactly that many (``read`` then says what is wrong)."""
    lead, rows, row_bytes = stored
    total = lead * rows * row_bytes
    data: Any = thread_scratch().take("raw", total, np.uint8) if fill is not None else None
    if data is None or not fill(memoryview(data)):  # type: ignore[misc]
        data = read(total) if total else b""
    if len(data) != total:
        raise short(f"short read: {len(data)} of {total} bytes")
    raw = np.frombuffer(data, dtype=np.uint8).reshape(lead, rows, row_bytes)
    out = np.empty((lead, rows, cols), dtype=numpy_storage_dtype(out_dtype))
    for li, r0, r1 in band_list:
        kernel(raw[li, r0:r1], li, r0, out[li, r0:r1])
    yield out


__all__ = ["BAND_ELEMS", "BandDequantizer", "TABLES", "band_rows", "bands", "check_grid", "thread_scratch",
           "whole_stream"]
