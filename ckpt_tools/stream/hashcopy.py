"""Moving bytes into the output while hashing them: each source byte is read once (read, hash, write).

The manifest's digests used to be computed by reading back what landed (a second read of every byte
written); here the bytes are hashed from the buffer they are written from. ``pool`` says where the hash runs: the
writer passes an inline executor (measured on 2 cores: a hash thread fed 512 KiB chunks cost a thread switch per
chunk, more than it overlapped); with a one-thread pool the hash of chunk i runs while the next chunks are read
and written into other buffers, in order.

A tensor may also carry a value check (``plan.OutputTensor.check``: graft's ``nonfinite`` rule on the
source's MTP values), fed the same chunks on the same thread as the hash: the values are judged from the
bytes being copied, not from a separate read.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Protocol

from ..io.safetensors_io import IO_STATS, Segment

# measured on 1 GB (read, hash, write, fsync): 256 KiB-1 MiB chunks cost 0.6 s of CPU; 4 MiB ones 1.8 s (a chunk
# read is no longer in the cache when it is hashed and written)
CHUNK = 512 << 10
BUFFERS = 4  # chunks read ahead of the hash (it runs behind the reads and writes, in order)


class Sink(Protocol):
    def update(self, data: memoryview, /) -> object: ...


class Feed:
    """Several sinks fed the same chunks, in order (a hash and a value check)."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def update(self, data: memoryview) -> None:
        for s in self.sinks:
            s.update(data)


class HashingCopier:
    """Copies byte ranges and computed chunks into an output file descriptor, each chunk fed to a sink.

    ``pool`` runs the feeds in the order they are submitted (one thread, or inline): chunk i+1 is read and
    written while chunks up to i are still being hashed, and a buffer is reused only once its feed is done.
    """

    def __init__(self, pool: Executor, chunk: int = CHUNK, buffers: int = BUFFERS) -> None:
        self.pool = pool
        self._bufs = [memoryview(bytearray(chunk)) for _ in range(buffers)]
        self._fed: list[Future | None] = [None] * buffers  # each buffer's feed, while it may be running
        self._turn = 0
        self._last: Future | None = None

    def wait(self) -> None:
        """Every chunk given so far has been fed (a failed feed raises here)."""
        for i, f in enumerate(self._fed):
            if f is not None:
                self._fed[i] = None
                f.result()
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def segment(self, seg: Segment, sink: Sink, write: Callable[[memoryview], None]) -> None:
        """``seg``'s bytes through ``write``, each fed to ``sink`` (read errors are the source's InputError)."""
        stream = getattr(seg.source, "stream", None)
        if stream is not None:  # a remote source: its chunks as they arrive
            for chunk in stream(seg.offset, seg.length):
                self.chunk(sink, memoryview(chunk), write)
            IO_STATS.add_copied(seg.length)
            return
        done = 0
        while done < seg.length:
            i, self._turn = self._turn, (self._turn + 1) % len(self._bufs)
            fed = self._fed[i]
            if fed is not None:  # this buffer's previous chunk must be hashed before it is read into again
                self._fed[i] = None
                fed.result()
            buf = self._bufs[i]
            n = min(len(buf), seg.length - done)
            seg.source.readinto(seg.offset + done, buf[:n])
            self._fed[i] = self._last = self.pool.submit(sink.update, buf[:n])
            write(buf[:n])
            done += n

    def chunk(self, sink: Sink, data: memoryview, write: Callable[[memoryview], None]) -> None:
        """A chunk someone else owns (a computed tensor's): fed while it is written, done before returning
        (its producer may reuse the buffer)."""
        fed = self.pool.submit(sink.update, data)
        write(data)
        fed.result()
