"""Moving bytes into the output while hashing them: each source byte is read once (read, hash, write).

The manifest's digests used to be computed by reading back what landed (a second read of every byte
written); here the bytes are hashed from the buffer they are written from. The hash of chunk i runs on a
hasher thread while chunk i is written and chunk i+1 read into the other buffer (both release the GIL), so
on two cores hashing is off the critical path; with no threads (``CKPT_HASH_THREADS=0``) it runs inline.

A tensor may also carry a value check (``plan.OutputTensor.check``: graft's ``nonfinite`` rule on the
source's MTP values), fed the same chunks on the same thread as the hash: the values are judged from the
bytes being copied, not from a separate read.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Protocol

from ..io.safetensors_io import IO_STATS, Segment

# measured on 1 GB: 0.5-1 MiB chunks stay in the cache from read to hash to write; 2 MiB and more cost 2-4x the CPU
CHUNK = 1 << 20


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
    """Copies byte ranges and computed chunks into an output file descriptor, each chunk fed to a sink."""

    def __init__(self, pool: Executor, chunk: int = CHUNK) -> None:
        self.pool = pool
        self._bufs = (memoryview(bytearray(chunk)), memoryview(bytearray(chunk)))
        self._turn = 0
        self._pending: Future | None = None

    def _feed(self, sink: Sink, data: memoryview) -> None:
        self.wait()  # in order: the previous update is done before this one starts (and its buffer is free)
        self._pending = self.pool.submit(sink.update, data)

    def wait(self) -> None:
        """Every chunk given so far has been fed (a failed update raises here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

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
            buf = self._bufs[self._turn]
            self._turn ^= 1  # the other buffer may still be hashed meanwhile
            n = min(len(buf), seg.length - done)
            seg.source.readinto(seg.offset + done, buf[:n])
            self._feed(sink, buf[:n])
            write(buf[:n])
            done += n

    def chunk(self, sink: Sink, data: memoryview, write: Callable[[memoryview], None]) -> None:
        """A chunk someone else owns (a computed tensor's): fed while it is written, done before returning
        (its producer may reuse the buffer)."""
        self._feed(sink, data)
        write(data)
        self.wait()
