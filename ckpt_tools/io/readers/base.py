"""What the readers share: tensor files as byte sources, the bounded cache of loaded tensors, weight sets."""

from __future__ import annotations

import bisect
import io
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ...dtypes import DTYPES, from_torch
from ...errors import InputError
from ..safetensors_io import IO_STATS, LocalFile, Segment, TensorRef

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
DCP_METADATA = ".metadata"  # a torch distributed checkpoint's metadata file
CACHE_BYTES = 256 << 20  # loaded tensors kept beyond the one being read (small ones are reused by interleaved reads)

Confine = Callable[[str], Path]  # a name relative to the checkpoint directory -> its path, refusing escapes
ReadIndex = Callable[[Path], dict]  # an index JSON file -> its checked contents


# ---------------------------------------------------------------------------
# Tensor bytes


class Part(Protocol):
    """The bytes of one tensor, in safetensors' order (C-contiguous, little-endian)."""

    nbytes: int

    def readinto(self, offset: int, buf: memoryview) -> None: ...


@dataclass
class FileSpans:
    """A tensor stored as it is: one or more byte ranges of local files, read with pread."""

    spans: list[Segment]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(s.length for s in self.spans)

    def readinto(self, offset: int, buf: memoryview) -> None:
        done = 0
        for s in self.spans:
            if done == len(buf):
                return
            if offset >= s.length:
                offset -= s.length
                continue
            n = min(s.length - offset, len(buf) - done)
            s.source.readinto(s.offset + offset, buf[done:done + n])
            done += n
            offset = 0


class TensorCache:
    """Tensors torch had to load: the one being read, plus others up to ``budget`` bytes, least recent out first.

    Room is made before a load, so memory peaks at about one loaded tensor (the largest) plus ``budget``.
    """

    def __init__(self, budget: int = CACHE_BYTES) -> None:
        self.budget = budget
        self._items: OrderedDict[LoadedTensor, object] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()  # the writer reads ahead in a worker thread

    def get(self, owner: LoadedTensor):
        with self._lock:
            t = self._items.get(owner)
            if t is not None:
                self._items.move_to_end(owner)
                return t
            while self._items and self._held + owner.nbytes > self.budget:
                old, _ = self._items.popitem(last=False)
                self._held -= old.nbytes
            t = owner.materialise()
            self._items[owner] = t
            self._held += owner.nbytes
            return t

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._held = 0


class LoadedTensor:
    """A tensor torch must load; ``load`` returns it with any strides, checked against what was declared."""

    def __init__(self, load: Callable[[], object], dtype: str, shape: tuple[int, ...], cache: TensorCache,
                 where: str) -> None:
        self.load, self.dtype, self.shape, self.cache, self.where = load, dtype, shape, cache, where
        self.nbytes = tensor_nbytes(dtype, shape)

    def materialise(self):
        import torch

        t = self.load()
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != self.shape or \
                torch_dtype_name(t.dtype, self.where) != self.dtype:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"loads as {got}, declared {self.dtype} {list(self.shape)}", rule="tensor-mismatch",
                             path=self.where)
        return t.detach()

    def readinto(self, offset: int, buf: memoryview) -> None:
        read_c_order(self.cache.get(self), offset, buf)
        IO_STATS.add_read(len(buf))


PIECE_BYTES = 16 << 20  # a non-contiguous tensor is made contiguous at most this much (or one row) at a time


def _as_bytes(t):
    """A contiguous tensor's bytes as a flat uint8 view (a one-element tensor may carry any stride)."""
    import torch

    return t.reshape(-1).as_strided((t.numel(),), (1,)).view(torch.uint8)


def read_c_order(t, offset: int, out: memoryview) -> None:
    """Bytes [offset, offset + len(out)) of tensor ``t`` in C order; a strided ``t`` is copied piece by piece.

    ``t`` may live on a GPU: only the bytes asked for are copied to the CPU (``.cpu()`` is free on the CPU).
    """
    if t.is_contiguous():
        out[:] = _as_bytes(t)[offset:offset + len(out)].cpu().numpy()
        return
    unit = t[0].numel() * t.element_size()  # bytes per index of the first axis
    first, end = offset // unit, -(-(offset + len(out)) // unit)
    if t.dim() == 1 or (end - first) * unit <= PIECE_BYTES:
        lo = offset - first * unit
        out[:] = _as_bytes(t[first:end].contiguous())[lo:lo + len(out)].cpu().numpy()
        return
    done = 0
    while done < len(out):  # rows too large to copy at once: one row at a time, recursively
        row, lo = divmod(offset + done, unit)
        n = min(unit - lo, len(out) - done)
        read_c_order(t[row], lo, out[done:done + n])
        done += n


class Deferred:
    """A part decided on first read (DCP: byte ranges when the chunks allow it, else a load)."""

    def __init__(self, nbytes: int, resolve: Callable[[], Part]) -> None:
        self.nbytes = nbytes
        self._resolve = resolve
        self._part: Part | None = None
        self._lock = threading.Lock()

    def readinto(self, offset: int, buf: memoryview) -> None:
        with self._lock:
            if self._part is None:
                self._part = self._resolve()
        self._part.readinto(offset, buf)


class TensorFile:
    """Tensors' bytes laid end to end as one read-only ByteSource: an input file (or DCP folder) of a draft
    reader, or tensors that exist only as recipes (``numeric.init_values.InitSource``).

    Offsets are virtual, so there is no file descriptor to copy from. ``files`` are the local files the parts
    read (closed with it), ``cache`` the loaded tensors they share (cleared with it).
    """

    def __init__(self, name: str, parts: list[Part], files: list[LocalFile] | None = None,
                 cache: TensorCache | None = None) -> None:
        self.name = name
        self.parts = parts
        self.starts: list[int] = []
        pos = 0
        for p in parts:
            self.starts.append(pos)
            pos += p.nbytes
        self._size = pos
        self._files = files or []
        self._cache = cache

    @property
    def size(self) -> int:
        return self._size

    @property
    def paths(self) -> list[str]:
        """The files on disk holding these tensors (a DCP folder's ``*.distcp``)."""
        return [f.name for f in self._files]

    def local_fd(self) -> int | None:
        return None

    def readinto(self, offset: int, buf: memoryview) -> None:
        if offset < 0 or offset + len(buf) > self._size:
            raise InputError(f"read of {len(buf)} bytes at {offset} is outside its {self._size} bytes",
                             rule="short-read", path=self.name)
        out = memoryview(buf).cast("B")
        done = 0
        while done < len(out):
            at = offset + done
            i = bisect.bisect_right(self.starts, at) - 1  # the last part starting here: empty ones come before it
            lo = at - self.starts[i]
            n = min(len(out) - done, self.parts[i].nbytes - lo)
            self.parts[i].readinto(lo, out[done:done + n])
            done += n

    def close(self) -> None:
        if self._cache is not None:
            self._cache.clear()
        for f in self._files:
            f.close()


class RangeReader(io.RawIOBase):
    """Bytes [offset, offset + length) of a ByteSource as a read-only, seekable file (for torch.load, zipfile)."""

    def __init__(self, source, offset: int, length: int) -> None:
        super().__init__()
        self.source, self.base, self.length, self.pos = source, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, pos if whence == io.SEEK_SET else self.pos + pos if whence == io.SEEK_CUR else
                       self.length + pos)
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        if n:
            self.source.readinto(self.base + self.pos, memoryview(buf).cast("B")[:n])
            self.pos += n
        return n


# ---------------------------------------------------------------------------
# What a reader returns


@dataclass
class Tensor:
    """One tensor a reader found: its name as stored, what it is, and where its bytes come from."""

    key: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    part: Part


@dataclass
class WeightSet:
    """Tensors read from non-safetensors files, shaped like a Checkpoint's (``sources``, ``shard_keys``)."""

    reader: str  # the name of the reader that read them (registry.READERS)
    files: dict[str, TensorFile]  # input file (relative name) -> its source
    keys: dict[str, list[str]]  # input file -> the keys it holds, in address order
    tensors: dict[str, TensorRef]
    notes: list[str] = field(default_factory=list)  # what was unwrapped or ignored, for reports
    consumed: set[str] = field(default_factory=set)  # side files read as part of the weights (never carried)
    carries_files: bool = True  # False for DCP: nothing beside a training step belongs in an output


def build_weight_set(reader: str, found: dict[str, list[Tensor]], open_files: dict[str, list[LocalFile]],
                     cache: TensorCache, notes: list[str], consumed: set[str] | None = None,
                     carries_files: bool = True) -> WeightSet:
    """Lay each file's tensors end to end in a ``TensorFile`` and reference them."""
    files: dict[str, TensorFile] = {}
    keys: dict[str, list[str]] = {}
    tensors: dict[str, TensorRef] = {}
    for name, items in found.items():
        src = TensorFile(name, [t.part for t in items], open_files.get(name, []), cache)
        files[name] = src
        keys[name] = [t.key for t in items]
        for t, start in zip(items, src.starts, strict=True):
            if t.key in tensors:
                raise InputError(f"tensor {t.key!r} appears twice", rule="duplicate-tensor", path=name)
            tensors[t.key] = TensorRef(src, t.key, t.dtype, t.shape, start, t.part.nbytes)
    return WeightSet(reader, files, keys, tensors, notes, consumed or set(), carries_files)


# ---------------------------------------------------------------------------
# Shared checks


def torch_dtype_name(dtype, where: str, key: str | None = None) -> str:
    """The safetensors name of a torch dtype; InputError for those safetensors cannot express."""
    try:
        return from_torch(dtype)
    except KeyError:
        what = f"tensor {key!r} is" if key else "is"
        raise InputError(f"{what} {str(dtype).removeprefix('torch.')}, which safetensors cannot store",
                         rule="unsupported-dtype", path=where, key=key) from None


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPES[dtype].nbytes(numel(shape))


def check_dims(value: object, what: str, where: str) -> tuple[int, ...]:
    """A shape or offset list from a file: non-negative integers, nothing else."""
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) and
                                                         0 <= d < 2**63 for d in value):
        raise InputError(f"{what} {value!r:.80} is not a list of non-negative integers", rule="bad-shape",
                         path=where)
    return tuple(value)
