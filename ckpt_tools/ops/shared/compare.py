"""Streaming comparison of two tensors: byte identity first, numeric statistics when they differ.

Used by `ckpt diff` and by stitch's gate and report. Both sides are read in matching
chunks, so memory stays bounded whatever the tensor size. Equal bytes are settled by a
byte comparison alone; statistics (max |a - b|, relative L2, cosine, the two L2 norms)
are computed only for tensors that differ, decoding floats with numpy (bf16 by a bit
shift), so no arithmetic library is loaded for an unchanged checkpoint.

Infinities and NaN are counted, never folded into a finite number: a position where
either side is NaN counts in ``nan_count`` and makes max |a - b| NaN; a position where
either side is infinite counts in ``inf_count`` and makes max |a - b| infinite unless
both sides hold the same infinity. Relative L2, cosine and the norms are taken over the
positions where both sides are finite.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

from ...arrays import Scratch, decode_floats
from ...dtypes import DTYPES, FLOAT_DTYPES, FP8_DTYPES
from ...errors import InputError
from ...io.safetensors_io import TensorRef
from ...stream.plan import CopyBytes, Recipe
from .tensor_diff import TensorDiff  # noqa: F401 - re-exported: compare's result

if TYPE_CHECKING:
    import numpy as np  # imported where values are compared: byte-identical tensors need none

CHUNK_ELEMS = 1 << 20  # elements per chunk when comparing bytes or counting NaN/Inf
STATS_CHUNK_ELEMS = 1 << 16  # elements per statistics chunk: its temporaries stay in the CPU cache
_RESCALE_ABOVE = 2.0**480  # float64 squares of larger values overflow: such chunks are scaled by a power of two


class Cancelled(Exception):
    """A comparison stopped because its ``stop`` event was set (the caller is failing anyway)."""


def recipe_of(ref: TensorRef) -> Recipe:
    return CopyBytes([ref.segment()])


class Tap:
    """The digest of B's bytes, taken by a comparison that reads all of them (stitch: the draft's tensor digest for
    its fingerprint, without another read). A pass that stops early leaves no digest."""

    def __init__(self) -> None:
        self.digest: str | None = None
        self._h = None

    def start(self) -> None:
        from ...io import digest

        self._h, self.digest = digest.new(), None

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)

    def complete(self) -> None:
        if self._h is not None:
            self.digest, self._h = self._h.hexdigest(), None


def compare(key: str, a_dtype: str, a_shape, a: Recipe, b_dtype: str, b_shape, b: Recipe, *, stats: bool = True,
            finite: bool = True, decode_a=None, decode_b=None, stop=None, tap: Tap | None = None) -> TensorDiff:
    """Compare two tensors given as recipes (A = before, B = after).

    ``decode_a``/``decode_b`` optionally turn a chunk's raw bytes into float32 values
    (e.g. FP8 dequantization: ``decode(buf, first_element, n)``); by default floats are
    decoded by dtype and other dtypes compare as bytes only. ``stop`` (a threading.Event)
    ends a running comparison with ``Cancelled`` at its next chunk. ``tap``: fed B's bytes by the pass that reads
    all of them.
    """
    d = TensorDiff(key, "unchanged", a_dtype, b_dtype, list(a_shape), list(b_shape))
    if list(a_shape) != list(b_shape):
        d.status = "shape-changed"
        return d
    readers = None
    if a_dtype == b_dtype and decode_a is None and decode_b is None:
        readers = _same_bytes(a, b, a_dtype, a_shape, stop, tap)
        if readers is None:
            return d
    d.status = "replaced" if a_dtype == b_dtype else "dtype-changed"
    decodable_a = decode_a is not None or a_dtype in FLOAT_DTYPES
    decodable_b = decode_b is not None or b_dtype in FLOAT_DTYPES
    if decodable_b and (stats or finite):
        _statistics(d, a, b, a_dtype, b_dtype, a_shape, decode_a, decode_b, stats and decodable_a, stop, tap,
                    readers)
    return d


def count_nonfinite(recipe: Recipe, dtype: str, shape) -> int:
    """NaN and Inf values a float tensor's recipe produces (0 for other dtypes)."""
    import numpy as np

    from ...numeric.transforms import RecipeReader

    if dtype not in FLOAT_DTYPES:
        return 0
    reader, numel, done, bad = RecipeReader(recipe), math.prod(shape), 0, 0
    while done < numel:
        n = min(CHUNK_ELEMS, numel - done)
        bad += int(np.count_nonzero(~np.isfinite(decode_floats(reader.read(DTYPES[dtype].nbytes(n)), dtype))))
        done += n
    return bad


_SCRATCH = threading.local()


class FiniteCheck:
    """Counts the NaN / Inf of a float tensor's bytes as they are written (``OutputTensor.check``: the values
    ``count_nonfinite`` counts, judged from the writer's chunks instead of a separate read); ``finish`` refuses
    them (rule ``nonfinite``), naming ``what``, the key and the file the bytes come from."""

    def __init__(self, key: str, dtype: str, path: str, what: str) -> None:
        from ...model.quant.finite import _BITS  # NaN / Inf: the exponent bits all ones, as decoded bands are judged

        self.key, self.path, self.what = key, path, what
        self.view, self.mask, self.top = _BITS[dtype]
        self.size = self.view(0).itemsize
        self.bad = 0
        self._carry = b""  # a chunk that ended inside a value (chunks of a remote source)

    def update(self, data: memoryview, /) -> None:
        import numpy as np  # here: planning (and a dry run) imports no numpy

        if self._carry:
            data = memoryview(self._carry + bytes(data))
        cut = len(data) - len(data) % self.size
        v = np.frombuffer(data[:cut], dtype=self.view)
        if v.size:  # masked into a reused buffer (no page faults), counted only when its largest value is bad
            scratch = _SCRATCH.__dict__.setdefault("scratch", Scratch())  # per thread: a copier's, the writer's
            bits = np.bitwise_and(v, self.view(self.mask), out=scratch.take("finite", v.size, v.dtype))
            if bits.max() >= self.top:
                self.bad += int(np.count_nonzero(bits >= self.top))
        self._carry = bytes(data[cut:])

    def finish(self) -> None:
        if self.bad:
            raise InputError(f"{self.what}: {self.key} ({self.bad} NaN/Inf)", rule="nonfinite", path=self.path)


class _Held:
    """A reader that first serves bytes already read (``held``), then continues from ``reader``."""

    def __init__(self, held: bytes | bytearray, reader) -> None:
        self._held, self._at, self._reader = memoryview(held), 0, reader

    def read(self, n: int):
        if self._at >= len(self._held):
            return self._reader.read(n)
        out = self._held[self._at:self._at + n]  # a view: the held bytes are not copied again
        self._at += len(out)
        if len(out) < n:
            out = bytearray(out) + self._reader.read(n - len(out))
        return out


def _same_bytes(a: Recipe, b: Recipe, dtype: str, shape, stop=None, tap: Tap | None = None):
    """None when both recipes give the same bytes (``tap`` then holds B's digest); else the readers the statistics
    pass continues with: when the very first chunk differs (a tensor of one chunk, or any changed weight), those
    bytes are held and not read again; a difference found later starts the statistics from fresh readers."""
    from ...numeric.transforms import RecipeReader

    nbytes = DTYPES[dtype].nbytes(math.prod(shape))
    chunk = DTYPES[dtype].nbytes(CHUNK_ELEMS) or CHUNK_ELEMS
    ra, rb = RecipeReader(a), RecipeReader(b)
    done = 0
    if tap is not None:
        tap.start()
    while done < nbytes:
        _check(stop)
        n = min(chunk, nbytes - done)
        ba, bb = ra.read(n), rb.read(n)
        if ba != bb:
            return (_Held(ba, ra), _Held(bb, rb)) if done == 0 else (RecipeReader(a), RecipeReader(b))
        if tap is not None:
            tap.update(bb)
        done += n
    if tap is not None:
        tap.complete()
    return None


def _check(stop) -> None:
    if stop is not None and stop.is_set():
        raise Cancelled


def _statistics(d: TensorDiff, a: Recipe, b: Recipe, a_dtype: str, b_dtype: str, shape, decode_a, decode_b,
                with_a: bool, stop=None, tap: Tap | None = None, readers=None) -> None:
    """A pass over both tensors: NaN/Inf on B, and (``with_a``) the difference statistics (``readers``: where the
    byte comparison left off, its bytes held)."""
    import numpy as np

    from ...numeric.transforms import RecipeReader

    numel = math.prod(shape)
    ra, rb = readers if readers is not None else (RecipeReader(a), RecipeReader(b))
    sa, sb = DTYPES[a_dtype], DTYPES[b_dtype]
    scratch_a, scratch_b = Scratch(), Scratch()  # decoded chunks reuse two buffers
    acc = _Acc()
    done = 0
    if tap is not None:
        tap.start()
    with np.errstate(all="ignore"):  # overflow and inf - inf are expected here, and handled: never a warning
        while done < numel:
            _check(stop)
            n = min(STATS_CHUNK_ELEMS, numel - done)
            ba, bb = ra.read(sa.nbytes(n)), rb.read(sb.nbytes(n))
            if tap is not None:
                tap.update(bb)
            vb = decode_b(bb, done, n) if decode_b else decode_floats(bb, b_dtype, scratch_b)
            vb = np.asarray(vb, dtype=np.float32) if not isinstance(vb, np.ndarray) else vb
            if with_a:
                va = decode_a(ba, done, n) if decode_a else decode_floats(ba, a_dtype, scratch_a)
                acc.add(np.asarray(va, dtype=np.float32) if not isinstance(va, np.ndarray) else va, vb)
            else:
                acc.b_nonfinite += int(np.count_nonzero(~np.isfinite(vb)))
            done += n
    if tap is not None:
        tap.complete()
    d.nonfinite = acc.b_nonfinite
    if with_a:
        d.nan_count, d.inf_count = acc.nan, acc.inf
        d.max_abs, d.rel_l2, d.cosine, d.norm_a, d.norm_b = acc.result()


class _Acc:
    """Running sums for max |a - b|, ||a - b|| / ||a||, cosine(a, b) and the norms.

    Each chunk is small enough to stay in the CPU cache (see STATS_CHUNK_ELEMS): the squares
    are taken in the inputs' precision (at least float32, rounding each by at most 2^-24)
    and summed pairwise in float64, so a cosine of 0.99999 is told from 0.999999 without
    widening every value to float64 in memory. The cosine comes from the norms,
    1 - cos = (||a - b||^2 - (||a|| - ||b||)^2) / (2 ||a|| ||b||), which stays accurate
    where a direct a.b / (||a|| ||b||) would round to 1.

    A chunk whose sums of squares are not finite (a NaN or infinity on either side, or a
    square that overflows) takes the careful path: NaN and infinite positions are counted
    and left out of the sums, the rest is summed in float64, scaled by a power of two when
    its values are too large to square. The sums share one scale ``2**(2 * shift)``.
    """

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.diff2 = 0.0
        self.a2 = 0.0
        self.b2 = 0.0
        self.shift = 0  # the sums are of (x * 2**-shift)**2
        self.nan = 0
        self.inf = 0
        self.b_nonfinite = 0
        self.pairs = 0  # positions where both sides are finite
        self._scratch = Scratch()

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        import numpy as np

        a, b = a.reshape(-1), b.reshape(-1)
        work = np.result_type(a.dtype, b.dtype, np.float32)
        diff, square = self._buffers(work, a.size)
        np.subtract(a, b, out=diff)
        a2, b2, d2 = _sum_squares(a, square), _sum_squares(b, square), _sum_squares(diff, square)
        if not (math.isfinite(a2) and math.isfinite(b2) and math.isfinite(d2)) or self.shift:
            self._careful(a, b)
            return
        if diff.size:  # two plain reductions: np.abs(...).max() is several times slower
            self.max_abs = max(self.max_abs, float(diff.max()), -float(diff.min()))
        self.diff2 += d2
        self.a2 += a2
        self.b2 += b2
        self.pairs += a.size

    def _careful(self, a: np.ndarray, b: np.ndarray) -> None:
        import numpy as np

        a, b = a.astype(np.float64), b.astype(np.float64)
        nan = np.isnan(a) | np.isnan(b)
        inf = (np.isinf(a) | np.isinf(b)) & ~nan
        self.nan += int(np.count_nonzero(nan))
        self.inf += int(np.count_nonzero(inf))
        self.b_nonfinite += int(np.count_nonzero(~np.isfinite(b)))
        if self.nan:
            self.max_abs = math.nan
        elif np.any(a[inf] != b[inf]):  # one side infinite, or opposite infinities
            self.max_abs = math.inf
        ok = ~(nan | inf)
        a, b = a[ok], b[ok]
        self.pairs += a.size
        if not a.size:
            return
        top = max(float(np.abs(a).max()), float(np.abs(b).max()))
        if top > _RESCALE_ABOVE:
            self._rescale(math.frexp(top)[1])
        a, b = np.ldexp(a, -self.shift), np.ldexp(b, -self.shift)  # exact: a power of two
        diff = a - b
        if not math.isnan(self.max_abs):
            self.max_abs = max(self.max_abs, _ldexp(float(np.abs(diff).max()), self.shift))
        self.diff2 += float(np.dot(diff, diff))
        self.a2 += float(np.dot(a, a))
        self.b2 += float(np.dot(b, b))

    def _rescale(self, shift: int) -> None:
        if shift <= self.shift:
            return
        f = math.ldexp(1.0, -2 * (shift - self.shift))
        self.diff2, self.a2, self.b2 = self.diff2 * f, self.a2 * f, self.b2 * f
        self.shift = shift

    def _buffers(self, dtype: np.dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self._scratch.take("diff", n, dtype), self._scratch.take("square", n, dtype)

    def result(self) -> tuple[float, float | None, float | None, float | None, float | None]:
        """max |a - b|, relative L2, cosine, ||a||, ||b|| (the last four over finite pairs; None without any)."""
        if not self.pairs:
            return self.max_abs, None, None, None, None
        na, nb = math.sqrt(self.a2), math.sqrt(self.b2)
        norm_a, norm_b = _ldexp(na, self.shift), _ldexp(nb, self.shift)
        rel = math.sqrt(self.diff2) / na if na > 0 else (0.0 if self.diff2 == 0 else math.inf)
        if na > 0 and nb > 0:
            cos = 1.0 - (self.diff2 - (na - nb) ** 2) / (2.0 * na * nb)
        else:
            cos = 1.0 if na == nb == 0 else 0.0
        return self.max_abs, rel, min(1.0, max(-1.0, cos)), norm_a, norm_b


def _ldexp(x: float, e: int) -> float:
    """x * 2**e, infinite where that exceeds float64 (a difference of two values near the float64 maximum)."""
    try:
        return math.ldexp(x, e)
    except OverflowError:
        return math.inf


def _sum_squares(x: np.ndarray, out: np.ndarray) -> float:
    import numpy as np

    np.multiply(x, x, out=out)
    return float(out.sum(dtype=np.float64))


__all__ = ["Cancelled", "TensorDiff", "compare", "count_nonfinite", "decode_floats", "recipe_of",
           "FP8_DTYPES"]
