"""Deterministic initial values: a pure function of (seed, tensor name), streamed in bands.

Every initialised tensor draws from its own generator,
``numpy.random.default_rng([seed, crc32(name)])`` (PCG64), producing float32 standard
normals in C order, scaled by ``std`` in float32, then cast to the stored dtype by torch
(round to nearest even). Values are generated band by band from that one stream; numpy's
generator continues where the previous band stopped, so the bytes do not depend on the
band size, the output sharding or the order tensors are written in.

``InitSource`` lays initialised tensors end to end as a read-only byte source (the draft readers'
``TensorFile``), so that every recipe built for real checkpoints - renames, expert re-layouts, half
swaps - applies unchanged to tensors that exist only as recipes.
"""

from __future__ import annotations

import bisect
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..arrays import encode_floats as encode
from ..dtypes import DTYPES, torch_dtype
from ..io.readers.base import TensorFile

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


class _Streams:
    """The open normal streams of a set of tensors, least recently read out first: memory is one band plus a
    constant, and reading a tensor forward (what copies, re-layouts and casts do) continues its stream."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._open: OrderedDict[int, _Stream] = OrderedDict()

    def at(self, recipe: InitRecipe, elem: int) -> _Stream:
        """``recipe``'s stream positioned at element ``elem`` (reading backwards restarts it)."""
        s = self._open.pop(id(recipe), None)
        if s is None or s.pos > elem:
            s = _Stream(recipe)
        s.skip_to(elem)
        self._open[id(recipe)] = s
        while len(self._open) > self.most:
            self._open.popitem(last=False)
        return s


class _InitPart:
    """One initialised tensor's bytes, generated when read (a ``Part`` of a ``TensorFile``)."""

    def __init__(self, recipe: InitRecipe, streams: _Streams) -> None:
        self.recipe = recipe
        self.nbytes = recipe.nbytes
        self._streams = streams

    def readinto(self, lo: int, out: memoryview) -> None:
        """Bytes [lo, lo + len(out)) of the tensor."""
        recipe = self.recipe
        size = recipe.itemsize
        first = lo // size
        last = -(-(lo + len(out)) // size)
        skip = lo - first * size
        pos = 0
        elem = first
        while elem < last:
            k = min(BAND_ELEMS, last - elem)
            chunk = self._streams.at(recipe, elem).take(k) if recipe.method == "normal" else _constant(recipe, k)
            raw = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))[skip:]
            take = min(len(raw), len(out) - pos)
            out[pos:pos + take] = raw[:take]
            pos += take
            skip = 0
            elem += k


class InitSource(TensorFile):
    """Initialised tensors laid end to end as one virtual, read-only byte source, generated when read."""

    MAX_STREAMS = 64

    def __init__(self, recipes: list[InitRecipe], name: str = "<init>") -> None:
        self.recipes = list(recipes)
        streams = _Streams(self.MAX_STREAMS)
        super().__init__(name, [_InitPart(r, streams) for r in self.recipes])

    def offset_of(self, index: int) -> int:
        return self.starts[index]

    def recipe_at(self, offset: int) -> InitRecipe | None:
        """The (non-empty) tensor that starts at ``offset``, if any."""
        i = bisect.bisect_right(self.starts, offset) - 1
        return self.recipes[i] if i >= 0 and self.starts[i] == offset else None
