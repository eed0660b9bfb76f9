"""Deterministic initial values: a pure function of (seed, tensor name), streamed in bands.

Every initialised tensor draws from its own generator,
``numpy.random.default_rng([seed, crc32(name)])`` (PCG64), producing float32 standard
normals in C order, scaled by ``std`` in float32, then cast to the stored dtype by torch
(round to nearest even). Values are generated band by band from that one stream; numpy's
generator continues where the previous band stopped, so the bytes do not depend on the
band size, the output sharding or the order tensors are written in.

``InitSource`` exposes a set of initialised tensors as a read-only byte source (the same
interface as a local file), so that every recipe built for real checkpoints - renames,
expert re-layouts, half swaps - applies unchanged to tensors that exist only as recipes.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..dtypes import DTYPES, torch_dtype
from .fp8_decode import encode

METHODS = ("normal", "zeros", "ones")
BAND_ELEMS = 1 << 20  # values generated at a time: 4 MiB of float32
RNG_DESCRIPTION = "numpy.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(dtype=float32) * std"


@dataclass(frozen=True)
class InitRecipe:
    """How one tensor is initialised; ``name`` seeds its values."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    method: str  # normal | zeros | ones
    std: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown init method {self.method!r}")
        if self.dtype not in ("F16", "BF16", "F32", "F64"):
            raise ValueError(f"{self.name}: cannot initialise a {self.dtype} tensor")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].nbytes(1)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def describe(self) -> dict:
        d = {"init": self.method, "seed": self.seed, "seed_name": self.name}
        if self.method == "normal":
            d["std"] = self.std
        return d


def generator(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the stored dtype's bytes, rounded to nearest even as torch's casts round
    (numpy on the bits: an init-draft run never imports torch, which alone costs ~250 MB of RSS)."""
    if dtype == "F64":
        return values.astype(np.float64)  # every float32 is a float64: exact
    return encode(values, dtype)


def _constant(recipe: InitRecipe, n: int) -> np.ndarray:
    value = 0.0 if recipe.method == "zeros" else 1.0
    return _encode(np.full(n, value, dtype=np.float32), recipe.dtype)


class _Stream:
    """The normal stream of one tensor, read forward from any element position."""

    def __init__(self, recipe: InitRecipe) -> None:
        self.recipe = recipe
        self.rng = generator(recipe.seed, recipe.name)
        self.pos = 0  # elements drawn so far
        self.std = np.float32(recipe.std)

    def skip_to(self, elem: int) -> None:
        while self.pos < elem:
            k = min(BAND_ELEMS, elem - self.pos)
            self.rng.standard_normal(k, dtype=np.float32)
            self.pos += k

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` values, encoded (``n`` is at most one band)."""
        v = self.rng.standard_normal(n, dtype=np.float32)
        v *= self.std
        self.pos += n
        return _encode(v, self.recipe.dtype)


def produce(recipe: InitRecipe, band: int = BAND_ELEMS) -> Iterator[np.ndarray]:
    """The tensor's bytes in C order, one band of at most ``band`` values at a time."""
    n = recipe.numel
    stream = _Stream(recipe) if recipe.method == "normal" else None
    done = 0
    while done < n:
        k = min(band, n - done)
        yield stream.take(k) if stream is not None else _constant(recipe, k)
        done += k


def values(recipe: InitRecipe) -> np.ndarray:
    """The whole tensor as float32 (tests and small tensors only)."""
    import torch

    raw = b"".join(bytes(memoryview(c).cast("B")) for c in produce(recipe))
    if recipe.dtype == "F32":
        return np.frombuffer(raw, dtype=np.float32).reshape(recipe.shape)
    t = torch.frombuffer(bytearray(raw), dtype=torch_dtype(recipe.dtype)).to(torch.float32)
    return t.numpy().reshape(recipe.shape)


class InitSource:
    """Initialised tensors laid end to end as one virtual, read-only byte source.

    ``readinto`` generates the bytes it is asked for; reading a tensor forward (what copies,
    re-layouts and casts do) continues its stream, reading backwards restarts it. At most
    ``MAX_STREAMS`` streams stay open, so memory is one band plus a constant.
    """

    MAX_STREAMS = 64

    def __init__(self, recipes: list[InitRecipe], name: str = "<init>") -> None:
        self.name = name
        self.recipes = list(recipes)
        self.offsets: list[int] = []
        pos = 0
        for r in self.recipes:
            self.offsets.append(pos)
            pos += r.nbytes
        self._size = pos
        self._streams: OrderedDict[int, _Stream] = OrderedDict()

    @property
    def size(self) -> int:
        return self._size

    def local_fd(self) -> int | None:
        return None

    def offset_of(self, index: int) -> int:
        return self.offsets[index]

    def recipe_at(self, offset: int) -> InitRecipe | None:
        """The (non-empty) tensor that starts at ``offset``, if any."""
        import bisect

        i = bisect.bisect_right(self.offsets, offset) - 1
        return self.recipes[i] if i >= 0 and self.offsets[i] == offset else None

    def readinto(self, offset: int, buf: memoryview) -> None:
        import bisect

        if offset < 0 or offset + len(buf) > self._size:
            raise ValueError(f"{self.name}: read of {len(buf)} bytes at {offset} is outside {self._size} bytes")
        out = memoryview(buf).cast("B")
        done = 0
        while done < len(out):
            at = offset + done
            i = bisect.bisect_right(self.offsets, at) - 1
            lo = at - self.offsets[i]
            n = min(len(out) - done, self.recipes[i].nbytes - lo)
            self._fill(i, lo, out[done:done + n])
            done += n

    def _fill(self, i: int, lo: int, out: memoryview) -> None:
        """Bytes [lo, lo + len(out)) of tensor ``i``."""
        recipe = self.recipes[i]
        size = recipe.itemsize
        first = lo // size
        last = -(-(lo + len(out)) // size)
        skip = lo - first * size
        pos = 0
        elem = first
        while elem < last:
            k = min(BAND_ELEMS, last - elem)
            chunk = self._stream(i, elem).take(k) if recipe.method == "normal" else _constant(recipe, k)
            raw = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))[skip:]
            take = min(len(raw), len(out) - pos)
            out[pos:pos + take] = raw[:take]
            pos += take
            skip = 0
            elem += k

    def _stream(self, i: int, elem: int) -> _Stream:
        s = self._streams.pop(i, None)
        if s is None or s.pos > elem:
            s = _Stream(self.recipes[i])
        s.skip_to(elem)
        self._streams[i] = s
        while len(self._streams) > self.MAX_STREAMS:
            self._streams.popitem(last=False)
        return s
