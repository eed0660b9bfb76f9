"""Numeric decoders for quantized linear weights, in numpy, one band of rows at a time.

Every shipped scheme decodes the same way (schema.DecoderDef)::

    W[r, c] = fl32( (value(code[r, c]) - zero_point[tile]) * s[tile] )       one float32 rounding
    s       = scale[tile] | fl32(scale[tile] / g) (compressed-tensors NVFP4) | fl32(scale[tile] * g) (ModelOpt)

then one round-to-nearest-even cast to the output dtype, as the reference implementations compute
(an e4m3, e2m1 or int code has at most 9 significant bits, so the product is exact in float32).

Codes: ``e4m3`` / ``e5m2`` (one per byte), ``e2m1`` and 4-bit ``int`` (two per byte, low nibble
first), 8-bit ``int`` (unsigned with ``offset``, or signed). Packed I32 containers are read as their
little-endian bytes. Scale tiles ``[tr, tc]`` (group, channel, tensor, block) may be partial at the
edges; large FP8 tiles use decode_fp8, everything else expands the scale per band.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...arrays import Scratch, decode_floats, numpy_storage_dtype
from ...arrays import encode_floats as encode
from ...errors import PlanError
from ...io.prefetch import prefetched
from ...parallel import decode_threads, in_pool, ordered_map, run_all
from .decode_fp8 import OUT_DTYPES, BandDequantizer, band_rows, bands, thread_scratch, whole_stream
from .decode_fp8 import TABLES as FP8_TABLES
from .finite import first_nonfinite

if TYPE_CHECKING:
    from .schema import DecoderDef

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)
FP8_TABLE_LIMIT = 1 << 22  # per-block output tables up to this many entries per matrix (16 MB of float32)
PAIR_TABLE_MIN = 1 << 18  # two-codes-a-byte matrices of at least this many elements use pair tables (PairTables)


# code kinds added from outside the package (register_codes): name -> [256, k] float32 values
REGISTERED_CODES: dict[str, np.ndarray] = {}


def register_codes(name: str, values: Any) -> np.ndarray:
    """Add the decoder of a new code kind, named by a scheme table's ``decoder: {codes: name}``: ``values``
    [256] or [256, k] (k = 1 or 2), the float32 value of each of the k codes a stored byte holds, in order
    (low nibble first for two). The rest of decoding is the table's (scale tiles, global scale, zero point,
    one float32 product, one rounding). A name already taken is refused."""
    from .schema import CODES

    if name in CODES or name in REGISTERED_CODES:
        raise ValueError(f"a code kind named {name!r} already exists")
    table = np.array(values, dtype=np.float32)
    table = table.reshape(256, 1) if table.shape == (256,) else table
    if table.shape not in ((256, 1), (256, 2)):
        raise ValueError(f"code values must be [256] or [256, 1 or 2], got {list(table.shape)}")
    table.flags.writeable = False
    REGISTERED_CODES[name] = table
    return table


def unregister_codes(name: str) -> None:
    """Remove code kind ``name`` (a table that names it is refused from the next ``tables.all_schemes``)."""
    REGISTERED_CODES.pop(name, None)


def code_table(codes: str, bits: int = 8, offset: int = 0, weight_dtype: str | None = None) -> np.ndarray:
    """[256, k] float32: the values of the k codes each byte holds (k = 8 // bits), in order."""
    if codes in REGISTERED_CODES:
        return REGISTERED_CODES[codes]
    b = np.arange(256)
    if codes == "fp8":
        codes = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}.get(weight_dtype or "", "")
        if not codes:
            raise PlanError(f"an fp8 decoder cannot read {weight_dtype} weights", rule="dequant")
    if codes in ("e4m3", "e5m2"):
        return FP8_TABLES["F8_E4M3" if codes == "e4m3" else "F8_E5M2"].reshape(256, 1)
    if codes == "e2m1":
        return np.stack([E2M1[b & 15], E2M1[b >> 4]], axis=1)
    if codes == "int" and bits == 8:
        return ((b - 256 * (b >= 128)) if offset == 0 else (b - offset)).astype(np.float32).reshape(256, 1)
    if codes == "int" and bits == 4:
        lo, hi = b & 15, b >> 4
        if offset == 0:  # signed nibbles
            lo, hi = lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)
        else:
            lo, hi = lo - offset, hi - offset
        return np.stack([lo, hi], axis=1).astype(np.float32)
    raise PlanError(f"no decoder for {codes} codes of {bits} bits", rule="dequant")


def _e8m0_table(top: float) -> np.ndarray:
    """float32 value of every E8M0 byte: 2**(e - 127); e = 255 is ``top`` (2**128 is no float32)."""
    out = np.ldexp(np.float32(1.0), np.arange(255, dtype=np.int32) - 127).astype(np.float32)
    return np.append(out, np.float32(top))


_E8M0_NAN, _E8M0_INF = _e8m0_table(np.nan), _e8m0_table(np.inf)


def scale_values(raw: np.ndarray, dtype: str, encoding: str = "float", top: str = "nan") -> np.ndarray:
    """float32 values of a scale tensor's storage array (exact)."""
    if encoding == "e8m0" or dtype == "F8_E8M0":
        nan_top = dtype == "F8_E8M0" or top == "nan"
        return np.take(_E8M0_NAN if nan_top else _E8M0_INF, raw.view(np.uint8))  # take: a third of indexing's time
    if dtype == "F8_E4M3":
        return np.take(FP8_TABLES["F8_E4M3"], raw.view(np.uint8))
    if dtype in ("F32", "BF16", "F16"):
        return decode_floats(np.ascontiguousarray(raw).tobytes(), dtype).astype(np.float32).reshape(raw.shape)
    raise PlanError(f"scale dtype {dtype} is not one this decoder reads", rule="dequant")


def zero_point_values(raw: np.ndarray, dtype: str, bits: int, offset: int, packed: str, rows: int) -> np.ndarray:
    """[..., rows, groups] float32 zero points: plain ints, or compressed-tensors' row-packed I32 words."""
    if packed == "none" or dtype != "I32":
        return raw.astype(np.float32)
    per = 32 // bits
    *lead, words, groups = raw.shape
    table = code_table("int", bits, offset)  # [256, 8 // bits]
    vals = table[np.ascontiguousarray(raw).view(np.uint8)]  # [..., words, groups, 4, 8 // bits]
    vals = vals.reshape(*lead, words, groups, per)
    vals = np.moveaxis(vals, -1, -2).reshape(*lead, words * per, groups)
    return np.ascontiguousarray(vals[..., :rows, :])


def _e4m3_lut() -> np.ndarray:
    """float32 bits >> 20 of every e4m3 value (NaN aside) -> its byte; 0xFFFF elsewhere (the values are distinct
    there: an e4m3 value has at most 3 significant bits, so its float32's low 20 bits are zero)."""
    bits = FP8_TABLES["F8_E4M3"].view(np.uint32)
    ok = ~np.isnan(FP8_TABLES["F8_E4M3"])
    lut = np.full(1 << 12, 0xFFFF, dtype=np.uint16)
    lut[bits[ok] >> 20] = np.arange(256, dtype=np.uint16)[ok]
    return lut


_E4M3_LUT = _e4m3_lut()


def e4m3_keys(scale: np.ndarray) -> np.ndarray | None:
    """``byte * 256`` (uint16) of every scale when each is an e4m3 value (NVFP4's tile scales), else None."""
    b = np.ascontiguousarray(scale, dtype=np.float32).view(np.uint32)
    k = np.take(_E4M3_LUT, b >> 20)
    if (k == 0xFFFF).any() or (b & 0xFFFFF).any():
        return None
    return k << 8


@dataclass(frozen=True)
class Decoding:
    """One stored weight's decoding: what every band needs, resolved at plan time."""

    spec: DecoderDef
    weight_dtype: str
    shape: tuple[int, ...]  # logical [..., rows, cols]
    stored_cols: int  # bytes per stored row = stored_cols * itemsize
    row_bytes: int
    tile: tuple[int, int]
    out_dtype: str

    @property
    def lead(self) -> int:
        return math.prod(self.shape[:-2])

    @property
    def rows(self) -> int:
        return self.shape[-2]

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def grid(self) -> tuple[int, int]:
        return -(-self.rows // self.tile[0]), -(-self.cols // self.tile[1])


class BandDecoder:
    """Decodes row bands of one weight (``decode``); the scale, global scale and zero point are
    given whole (they are small) as float32 arrays of shape [lead, gr, gc], [lead] and [lead, gr, gc]."""

    def __init__(self, d: Decoding, scale: np.ndarray, global_scale: np.ndarray | None = None,
                 zero_point: np.ndarray | None = None, scratch: Scratch | None = None) -> None:
        if d.out_dtype not in OUT_DTYPES:
            raise PlanError(f"cannot dequantize to {d.out_dtype}; use one of {', '.join(OUT_DTYPES)}",
                            rule="dequant-dtype")
        if sys.byteorder != "little":
            raise PlanError("packed quantized weights are decoded on little-endian hosts only", rule="dequant")
        self.d = d
        s = scale.reshape(d.lead, *d.grid).astype(np.float32, copy=False)
        if global_scale is not None:
            g = np.asarray(global_scale, dtype=np.float32).reshape(-1)
            g = np.broadcast_to(g, (d.lead,)).reshape(d.lead, 1, 1)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                s = s / g if d.spec.global_scale.op == "divide" else s * g  # float32: one rounding
        self.scale = np.ascontiguousarray(s, dtype=np.float32)
        self.zero = None if zero_point is None else zero_point.reshape(d.lead, *d.grid).astype(np.float32)
        self.table = code_table(d.spec.codes, d.spec.bits, d.spec.offset, d.weight_dtype)
        self.per_byte = self.table.shape[1]
        self.items = np.ascontiguousarray(self.table).view({1: np.float32, 2: np.float64}[self.per_byte]).reshape(256)
        self.step = band_rows(d.cols, d.tile[0])
        self.scratch = scratch  # None: each decoding thread's own (bands may be decoded on several threads)
        self._fast = None
        tr, tc = d.tile
        gr, gc = d.grid
        if self.per_byte == 1 and self.zero is None and d.spec.codes in ("fp8", "e4m3", "e5m2") \
                and gr * gc * 256 <= FP8_TABLE_LIMIT and d.stored_cols == d.cols:
            fmt = "F8_E5M2" if d.weight_dtype == "F8_E5M2" or d.spec.codes == "e5m2" else "F8_E4M3"
            self._fast = BandDequantizer(fmt, self.scale.reshape(*d.shape[:-2], gr, gc), d.shape, (tr, tc),
                                         d.out_dtype, scratch=scratch)
            self.step = self._fast.step
        # two codes a byte, scales that are e4m3 values (NVFP4): a tile's byte decodes with one lookup in a table
        # of finished output pairs per (scale byte, code byte), the products and casts of the band path
        self._keys = None
        self._g = None if global_scale is None else g
        self._pairs: tuple[int, np.ndarray] | None = None
        if self._fast is None and self.per_byte == 2 and self.zero is None and tc % 2 == 0 and d.cols % tc == 0 \
                and d.row_bytes * 2 == d.cols and d.rows * d.cols >= PAIR_TABLE_MIN:
            self._keys = e4m3_keys(scale.reshape(d.lead, gr, gc))
        # every band decoded so far came from tables without a NaN / Inf entry (``vouches_finite``)
        self._finite_tables = self._keys is not None

    def _pair_tables(self, lead: int) -> np.ndarray:
        """[256 * 256] output pairs of matrix ``lead``: entry ``key * 256 + byte`` holds the byte's two codes times
        the scale whose e4m3 byte is ``key`` (divided or multiplied by the global scale as in ``__init__``)."""
        pairs = self._pairs  # read once: another thread may replace it meanwhile
        if pairs is None or pairs[0] != lead:
            assert self._keys is not None
            # only the scale bytes this matrix uses (a few dozen of 256): building the table cost more than
            # decoding a small matrix with it; the other rows are never indexed
            used = np.flatnonzero(np.bincount((self._keys[lead] >> 8).reshape(-1), minlength=256))
            s = FP8_TABLES["F8_E4M3"]
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                if self._g is not None:
                    g = self._g[lead]  # float32 [1, 1]: the same float32 operation as the band path's scale
                    s = (s / g if self.d.spec.global_scale.op == "divide" else s * g).reshape(256)
                products = s[used, None, None] * self.table[None, :, :]  # [key, byte, code]: one float32 rounding
            out = np.ascontiguousarray(encode(products, self.d.out_dtype))
            if first_nonfinite(out, self.d.out_dtype) is not None:
                self._finite_tables = False
            pair = {2: np.uint32, 4: np.uint64}[out.itemsize]
            table = np.zeros((256, 256), dtype=pair)
            table[used] = out.view(pair).reshape(len(used), 256)
            pairs = self._pairs = (lead, table.reshape(256 * 256))
        return pairs[1]

    def _decode_pairs(self, raw: np.ndarray, lead: int, r0: int, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        d = self.d
        assert self._keys is not None
        n = raw.shape[0]
        tr, tc = d.tile
        gc, tb = d.grid[1], tc // 2  # tiles per row, bytes per tile
        tables = self._pair_tables(lead)
        index = scratch.take("pairs16", raw.size, np.uint16).reshape(n, gc * tb)
        codes = raw.reshape(n, gc * tb)
        # each tile's key repeated over its bytes first: a flat add, not one broadcast over tb bytes at a time
        if tr == 1:
            np.add(codes, _spread(self._keys[lead, r0:r0 + n], tb, scratch), out=index)
        else:
            a = 0
            while a < n:  # rows of one tile row share their scales
                trow = (r0 + a) // tr
                b = min(n, (trow + 1) * tr - r0)
                np.add(codes[a:b], np.repeat(self._keys[lead, trow], tb), out=index[a:b])
                a = b
        np.take(tables, index.reshape(n, -1), out=out.view(tables.dtype).reshape(n, -1), mode="clip")
        return out

    def vouches_finite(self, band: np.ndarray) -> bool:
        """True when ``band``, decoded by this, is known to hold no NaN / Inf without a scan (``finite.finite_bands``):
        every band decoded so far came from tables of finished outputs that hold none (the pair tables), or from
        FP8 tables whose one non-finite output is bf16 0xFFFF, which its maximum shows (``BandDequantizer``)."""
        return self._finite_tables or (self._fast is not None and self._fast.vouches(band))

    def bands(self) -> Iterator[tuple[int, int, int]]:
        """(lead, r0, r1) in C order: inside one tile row, or starting on a tile-row boundary."""
        return bands(self.d.lead, self.d.rows, self.d.tile[0], self.step)

    def decode(self, raw: np.ndarray, lead: int, r0: int, out: np.ndarray | None = None) -> np.ndarray:
        """Values of stored rows ``r0..r0+n`` of matrix ``lead`` (``raw``: their bytes as uint8 [n, row_bytes])
        in the output dtype's storage array [n, cols]."""
        d = self.d
        n = raw.shape[0]
        out = np.empty((n, d.cols), dtype=numpy_storage_dtype(d.out_dtype)) if out is None else out
        if self._fast is not None:
            return self._fast.dequant(raw, lead, r0, out)
        per_row = d.row_bytes * self.per_byte
        scratch = self.scratch or thread_scratch()
        if self._keys is not None:
            return self._decode_pairs(raw, lead, r0, out, scratch)
        # one lookup per byte gives every code it holds: the table's rows read as one item each
        # (float32, or a float32 pair as 8 bytes), indices widened first (numpy's fast take path)
        index = scratch.take("index", raw.size, np.intp).reshape(raw.shape)
        np.copyto(index, raw, casting="unsafe")
        codes = scratch.take("codes", n * per_row, np.float32)
        np.take(self.items, index, out=codes.view(self.items.dtype).reshape(raw.shape), mode="clip")
        vals = codes.reshape(n, per_row)
        if per_row != d.cols:  # padding of the last packed word (compressed-tensors pack format)
            vals = np.ascontiguousarray(vals[:, : d.cols])
        tr, tc = d.tile
        if tr == 1:  # a scale row per weight row (group, channel): the whole band at once
            if self.zero is not None:
                _tiles(vals, self.zero[lead, r0:r0 + n], tc, np.subtract)
            _tiles(vals, self.scale[lead, r0:r0 + n], tc, np.multiply)
        else:
            a = 0
            while a < n:  # rows of one tile row share their scales (bands hold whole tile rows or part of one)
                trow = (r0 + a) // tr
                b = min(n, (trow + 1) * tr - r0)
                if self.zero is not None:
                    _tiles(vals[a:b], self.zero[lead, trow:trow + 1], tc, np.subtract)
                _tiles(vals[a:b], self.scale[lead, trow:trow + 1], tc, np.multiply)
                a = b
        encode(vals, d.out_dtype, out, scratch)
        return out


def _spread(keys: np.ndarray, tb: int, scratch: Scratch) -> np.ndarray:
    """[n, gc] uint16 ``keys``, each repeated over its tile's ``tb`` bytes: [n, gc * tb]. With ``tb`` a multiple of
    4, four copies of a key fill one uint64 (key * 0x0001000100010001: equal lanes, whatever the byte order), copied
    tb / 4 times: ``np.repeat`` copies 2 bytes at a time, a quarter of the pair decode's index cost."""
    n, gc = keys.shape
    if tb % 4:
        return np.repeat(keys, tb, axis=1)
    k64 = scratch.take("keys64", n * gc, np.uint64).reshape(n, gc)
    np.multiply(keys, np.uint64(0x0001000100010001), out=k64, casting="unsafe")
    spread = scratch.take("keys-spread", n * gc * (tb // 4), np.uint64).reshape(n, gc, tb // 4)
    for j in range(tb // 4):
        spread[:, :, j] = k64
    return spread.view(np.uint16).reshape(n, gc * tb)


def _tiles(block: np.ndarray, per_tile: np.ndarray, tc: int, op) -> None:
    """``block[r, c] = op(block[r, c], per_tile[r or 0, c // tc])`` in place (float32)."""
    rows, cols = block.shape
    full = cols // tc
    if full:
        # a strided 3-D view of the whole tiles (a reshape would copy when a partial tile follows)
        item = block.itemsize
        view = np.lib.stride_tricks.as_strided(block, (rows, full, tc), (block.strides[0], tc * item, item))
        op(view, per_tile[:, :full, None], out=view)
    if cols % tc:
        tail = block[:, full * tc:]
        op(tail, per_tile[:, full:full + 1], out=tail)


def decode_stream(read: Callable[[int], Any], dec: BandDecoder, fill: Callable[[memoryview], bool] | None = None
                  ) -> Iterator[np.ndarray]:
    """Decode a weight whose stored bytes come from a sequential reader (``read(n)``: the next n bytes),
    band by band, one worker thread ahead of the consumer. Yields fresh storage arrays. ``fill``: reads the
    whole weight into a buffer (``whole_stream``)."""
    d = dec.d
    threads = decode_threads()

    def raw_bands() -> Iterator[tuple[np.ndarray, int, int]]:
        for li, r0, r1 in dec.bands():
            n = (r1 - r0) * d.row_bytes
            data = read(n) if n else b""
            if len(data) != n:
                raise PlanError(f"short read: {len(data)} of {n} bytes", rule="dequant")
            yield np.frombuffer(data, dtype=np.uint8).reshape(r1 - r0, d.row_bytes), li, r0

    def one(band: tuple[np.ndarray, int, int]) -> np.ndarray:
        return dec.decode(*band)

    if in_pool():  # a tensor decoded whole on a pool thread (stream.lookahead): inline, one read, one array
        return whole_stream(read, (d.lead, d.rows, d.row_bytes), d.cols, d.out_dtype, dec.bands(), dec.decode,
                            lambda msg: PlanError(msg, rule="dequant"), fill)
    # bands read in order on one thread, decoded on ``threads`` (in order), one step ahead of the consumer
    return prefetched(lambda: ordered_map(one, raw_bands(), threads))


def decode_array(d: Decoding, weight: np.ndarray, scale: np.ndarray, global_scale: np.ndarray | None = None,
                 zero_point: np.ndarray | None = None) -> np.ndarray:
    """A whole stored weight (any storage dtype, [..., rows, stored_cols]) decoded at once (tests, small tensors)."""
    dec = BandDecoder(d, scale, global_scale, zero_point)
    raw = np.ascontiguousarray(weight).view(np.uint8).reshape(d.lead, d.rows, d.row_bytes)
    out = np.empty((d.lead, d.rows, d.cols), dtype=numpy_storage_dtype(d.out_dtype))

    def one(band: tuple[int, int, int]) -> None:
        li, r0, r1 = band
        dec.decode(raw[li, r0:r1], li, r0, out[li, r0:r1])

    run_all(one, dec.bands())
    return out.reshape(d.shape)
