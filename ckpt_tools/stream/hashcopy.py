"""Moving bytes into the output while hashing them: no source byte crosses into user space twice.

A large local byte range moves by ``copy_file_range`` (in the kernel, no user-space buffer), and its
digest is taken from a read-only mapping of the source's range - the page cache the kernel copies
from - by one thread beside the copies, in order (``CKPT_HASH_THREADS=0``: inline, after each piece).
Smaller ranges, remote sources and a kernel that refuses the copy (EXDEV on old kernels) are read,
hashed and written from one buffer on the writing thread.

A tensor may also carry a value check (``plan.OutputTensor.check``: graft's ``nonfinite`` rule on the
source's MTP values), fed the same bytes in the same order as its hash: the values are judged from the
bytes being copied, not from a separate read.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from ..io import digest
from ..io import safetensors_io as sio
from ..io.safetensors_io import IO_STATS, Segment

# measured on 1 GB (read, hash, write, fsync): 256 KiB-1 MiB chunks cost 0.6 s of CPU; 4 MiB ones 1.8 s (a chunk
# read is no longer in the cache when it is hashed and written)
CHUNK = 512 << 10
KERNEL_MIN = 4 << 20  # smaller ranges are read, hashed and written: a mapping and a hand-off cost more
PIECE = 8 << 20  # copied, then handed to the hashing thread
AHEAD = 4  # pieces copied ahead of their hash


class Sink(Protocol):
    def update(self, data: memoryview, /) -> object: ...


class Feed:
    """Several sinks fed the same chunks, in order (a hash and a value check)."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def update(self, data: memoryview) -> None:
        for s in self.sinks:
            s.update(data)


class Split:
    """One stream of bytes fed to consecutive sinks, ``sizes[i]`` bytes to the i-th (tensors copied by one copy)."""

    def __init__(self, parts: list[tuple[int, Sink]]) -> None:
        self.parts = deque(parts)
        self.left = parts[0][0]

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(self.left, len(data))
            self.parts[0][1].update(data[:take])
            data, self.left = data[take:], self.left - take
            if self.left == 0 and len(self.parts) > 1:
                self.parts.popleft()
                self.left = self.parts[0][0]


class HashingCopier:
    """Copies byte ranges and computed chunks into an output, each byte fed to a sink: a large local range
    copied by the kernel and hashed from the page cache (on ``threads``: 0 inline, else one thread, in order);
    anything else read into one buffer, fed and written on the writing thread."""

    def __init__(self, chunk: int = CHUNK, threads: int = 0) -> None:
        self._buf = memoryview(bytearray(chunk))
        self._pool = digest.executor(min(threads, 1), "ckpt-pagecache-hash")
        self._last: Future | None = None
        self._ahead: deque[Future] = deque()
        self._last_sink: Sink | None = None
        self._error: BaseException | None = None

    def segment(self, seg: Segment, sink: Sink, write: Callable[[memoryview], None], fd: int | None = None) -> None:
        """``seg``'s bytes through ``write`` (or a kernel copy into ``fd``), each fed to ``sink`` (read errors are
        the source's InputError)."""
        stream = getattr(seg.source, "stream", None)
        if stream is not None:  # a remote source: its chunks as they arrive
            for chunk in stream(seg.offset, seg.length):
                self.chunk(sink, memoryview(chunk), write)
            IO_STATS.add_copied(seg.length)
            return
        if fd is not None and seg.length >= KERNEL_MIN:
            done = self._kernel(seg, fd, sink)
            if done == seg.length:
                return
            seg = Segment(seg.source, seg.offset + done, seg.length - done)
        if sink is self._last_sink:
            self.drain()  # its queued pieces come first
        done = 0
        while done < seg.length:
            n = min(len(self._buf), seg.length - done)
            part = self._buf[:n]
            seg.source.readinto(seg.offset + done, part)
            sink.update(part)
            write(part)
            done += n

    def _kernel(self, seg: Segment, fd: int, sink: Sink) -> int:
        """Copy ``seg`` into ``fd`` with copy_file_range, each piece then hashed from a read-only mapping of the
        source's range; the bytes done (fewer: the rest goes through the buffer - a kernel that refuses, a source
        that shrank). At most ``AHEAD`` pieces wait for their hash: the mappings stay few."""
        src = seg.source.local_fd()
        if not sio._CFR_OK or src is None:
            return 0
        done, own = 0, os.dup(src)  # the hashing thread's own: the source may be closed before its hash is done
        try:
            while done < seg.length:
                n = os.copy_file_range(src, fd, min(PIECE, seg.length - done), seg.offset + done)
                if n == 0:
                    break
                self._queue(sink, lambda at=seg.offset + done, n=n: feed_mapped(sink, own, seg.source.name, at, n))
                done += n
        except OSError as e:
            if e.errno in sio._CFR_WRITE_ERRORS:
                raise
            if e.errno in sio._CFR_UNSUPPORTED and not done:
                sio._CFR_OK = False  # not on this system: do not ask again
        finally:
            self._pool.submit(os.close, own)  # after its pieces, whatever became of them
        IO_STATS.add_copied(done)
        return done

    def _queue(self, sink: Sink, job: Callable[[], Any]) -> None:
        while len(self._ahead) >= AHEAD:
            self._ahead.popleft().exception()
        self._last_sink = sink
        self._last = self._pool.submit(self._run, job)
        self._ahead.append(self._last)

    def _run(self, job: Callable[[], Any]) -> Any:
        if self._error is None:
            try:
                return job()
            except BaseException as e:
                self._error = e
        raise self._error

    def later(self, job: Callable[[], Any]) -> Future:
        """``job()`` once every piece queued so far is fed (its result, or the first error of those pieces); at
        once, on this thread, when none is pending."""
        self._last_sink = None
        if self._last is not None and not self._last.done():
            self._last = self._pool.submit(self._run, job)
            return self._last
        fut: Future = Future()
        try:
            fut.set_result(self._run(job))
        except BaseException as e:  # delivered by .result(), as the thread's would be
            fut.set_exception(e)
        return fut

    def drain(self) -> None:
        """Wait for the pieces queued so far; the first error of theirs (a value check's refusal) is raised."""
        if self._last is not None:
            self._last.exception()
        self._last_sink = None
        if self._error is not None:
            raise self._error

    def chunk(self, sink: Sink, data: memoryview, write: Callable[[memoryview], None]) -> None:
        """A chunk someone else owns (a computed tensor's): fed, then written."""
        sink.update(data)
        write(data)

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # every queued piece: each closes what it opened


def feed_mapped(sink: Sink, fd: int, name: str, at: int, n: int) -> None:
    """``sink`` fed the ``n`` bytes at ``at`` of ``fd`` from a read-only mapping (the page cache, no copy). A source
    truncated by someone else between this mapping and its hash is a SIGBUS, as for any reader of a mapping."""
    start = at - at % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, at + n - start, prot=mmap.PROT_READ, offset=start)
    except ValueError:  # shorter than what was just copied: it shrank
        raise sio.short_read(name, at) from None
    part = memoryview(m)[at - start :]
    try:
        sink.update(part)
    finally:
        # a sink's error may hold a view of the mapping (its traceback's frames): closing then raises BufferError,
        # which would hide that error; the mapping is unmapped when the last view goes instead
        del part
        with contextlib.suppress(BufferError):
            m.close()
