"""Ranged reads through any fsspec filesystem: split into parts, read in parallel, memory bounded.

A ByteSource (see ``safetensors_io``) for one remote file. ``readinto`` fills the caller's
buffer with parts read in parallel; ``stream`` yields a long range in order while a bounded
window of parts is in flight (at most ``WINDOW`` x ``PART`` bytes held), so a multi-GB tensor
copies at the store's parallel bandwidth in O(window) memory. A plan announces the ranges it
will copy (``schedule``): they are coalesced (small gaps merged) into parts that are fetched
ahead of the writer, ``AHEAD_BYTES`` at most, so hundreds of small tensors cost a few large
requests instead of one round trip each. Every byte fetched is counted in ``DOWNLOADS``; a
failure is an InputError naming the URL.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from ...errors import InputError
from ..safetensors_io import IO_STATS
from .backends import read_error
from .stats import DOWNLOADS

PART = 8 << 20  # bytes per request: large enough to amortise a request, small enough to parallelise
WINDOW = 8  # parts in flight per stream: caps memory at WINDOW * PART (64 MiB)
WORKERS = 16
AHEAD_BYTES = 64 << 20  # scheduled parts fetched ahead of the writer, at most (bounded memory)
MAX_GAP = 1 << 20  # coalesce: merge ranges separated by at most this many bytes ...
GAP_FRACTION = 32  # ... and by at most 1/32 of the bytes they hold (over-read stays under ~3%)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """One shared pool for every remote read of the process (threads are started lazily)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckpt-fetch")
        return _pool


def coalesce_ranges(ranges: list[tuple[int, int]], max_gap: int = MAX_GAP) -> list[tuple[int, int]]:
    """Sorted ``(start, end)`` ranges with small gaps merged: fewer requests, a bounded over-read."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out:
            a, b = out[-1]
            gap = start - b
            if gap <= 0 or gap <= min(max_gap, (b - a + end - start) // GAP_FRACTION):
                out[-1] = (a, max(b, end))
                continue
        out.append((start, end))
    return out


def split(start: int, end: int, part: int | None = None) -> list[tuple[int, int]]:
    part = part or PART
    return [(s, min(s + part, end)) for s in range(start, end, part)]


class ReadAhead:
    """The ranges a plan copies from one file, as coalesced parts fetched ahead of the consumer.

    A read inside the scheduled parts is served from them; the parts after it are fetched while
    it is consumed (``AHEAD_BYTES`` in flight), parts before it are dropped. A read outside the
    schedule returns None (the caller reads it directly).
    """

    def __init__(self, src: RangedFile, ranges: list[tuple[int, int]]) -> None:
        self.src = src
        self.parts = [p for a, b in coalesce_ranges(ranges) for p in split(a, b)]
        self.starts = [p[0] for p in self.parts]
        self.fetched: dict[int, Future] = {}
        self.lock = threading.Lock()

    def _covering(self, offset: int, length: int) -> list[int] | None:
        i = bisect.bisect_right(self.starts, offset) - 1
        out, pos, end = [], offset, offset + length
        while pos < end:
            if i < 0 or i >= len(self.parts) or not self.parts[i][0] <= pos < self.parts[i][1]:
                return None
            out.append(i)
            pos = self.parts[i][1]
            i += 1
        return out

    def _window(self, first: int) -> None:
        with self.lock:
            for j in [j for j in self.fetched if j < first]:  # the consumer moved past them
                self.fetched.pop(j).cancel()
            held = sum(self.parts[j][1] - self.parts[j][0] for j in self.fetched)
            j = first
            while j < len(self.parts) and (j == first or held < AHEAD_BYTES):
                if j not in self.fetched:
                    self.fetched[j] = pool().submit(self.src.fetch, *self.parts[j])
                    held += self.parts[j][1] - self.parts[j][0]
                j += 1

    def read(self, offset: int, length: int) -> Iterator[bytes] | None:
        idx = self._covering(offset, length)
        return None if idx is None else self._serve(idx, offset, offset + length)

    def _serve(self, idx: list[int], offset: int, end: int) -> Iterator[bytes]:
        for i in idx:
            self._window(i)
            with self.lock:
                fut = self.fetched[i]
            a, b = self.parts[i]
            data = fut.result()
            yield memoryview(data)[max(offset, a) - a:min(end, b) - a]


class RangedFile:
    """A remote file read by byte ranges (a ByteSource): subclasses give ``fetch(start, end) -> bytes``."""

    name: str
    _size: int
    _ahead: ReadAhead | None = None

    @property
    def size(self) -> int:
        return self._size

    def local_fd(self) -> int | None:
        return None

    def fetch(self, start: int, end: int) -> bytes:
        raise NotImplementedError

    def schedule(self, ranges: list[tuple[int, int]]) -> None:
        """The ``(start, end)`` ranges a plan will copy from this file (replacing any earlier schedule)."""
        self._ahead = ReadAhead(self, ranges) if ranges else None

    def _check(self, offset: int, n: int) -> None:
        if offset < 0 or offset + n > self._size:
            raise InputError(f"read of bytes {offset}-{offset + n - 1} past the end ({self._size} bytes)",
                             rule="short-read", path=self.name)

    def readinto(self, offset: int, buf: memoryview) -> None:
        n = len(buf)
        if n == 0:
            return
        self._check(offset, n)
        pos = 0
        for chunk in self._parts(offset, n):  # not the schedule: a read to compare must not start the copy's
            buf[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        IO_STATS.add_read(n)

    def read_all(self) -> bytes:
        buf = bytearray(self._size)
        self.readinto(0, memoryview(buf))
        return bytes(buf)

    def stream(self, offset: int, length: int) -> Iterator[bytes]:
        """``length`` bytes from ``offset``, in order: from the schedule when it holds them, else directly."""
        self._check(offset, length)
        ahead = self._ahead.read(offset, length) if self._ahead is not None else None
        return ahead if ahead is not None else self._parts(offset, length)

    def _parts(self, offset: int, length: int) -> Iterator[bytes]:
        """``length`` bytes from ``offset``, in order, with up to WINDOW parts fetched ahead."""
        self._check(offset, length)
        parts = split(offset, offset + length)
        if len(parts) == 1:
            yield self.fetch(*parts[0])
            return
        ex = pool()
        todo = iter(parts)
        inflight: deque[Future] = deque()
        try:
            for rng in todo:
                inflight.append(ex.submit(self.fetch, *rng))
                if len(inflight) >= WINDOW:
                    break
            while inflight:
                data = inflight.popleft().result()
                nxt = next(todo, None)
                if nxt is not None:
                    inflight.append(ex.submit(self.fetch, *nxt))
                yield data
        finally:
            for f in inflight:  # an error or an early stop: nothing more is fetched
                f.cancel()


class FsFile(RangedFile):
    """One file of an fsspec filesystem, read by byte ranges (``fs.cat_file(path, start, end)``)."""

    def __init__(self, fs, path: str, url: str, size: int, origin: str) -> None:
        self.fs = fs
        self.path = path
        self.name = url
        self._size = size
        self._origin = origin

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``: exactly those, or an InputError naming the URL."""
        try:
            data = self.fs.cat_file(self.path, start=start, end=end)
        except Exception as e:
            raise read_error(e, self.name, f"reading bytes {start}-{end - 1}") from e
        DOWNLOADS.add(len(data), origin=self._origin)
        if len(data) != end - start:
            raise InputError(f"asked for bytes {start}-{end - 1}, got {len(data)} bytes", rule="short-read",
                             path=self.name)
        return data
