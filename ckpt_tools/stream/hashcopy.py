"""Moving bytes into the output while hashing them: each source byte is read once (read, hash, write).

The manifest's digests used to be computed by reading back what landed (a second read of every byte
written); here the bytes are hashed from the buffer they are written from, on the writing thread (measured on 2 cores: a
hash thread fed 512 KiB chunks cost a thread switch per chunk, more than it overlapped).

A tensor may also carry a value check (``plan.OutputTensor.check``: graft's ``nonfinite`` rule on the
source's MTP values), fed the same chunks on the same thread as the hash: the values are judged from the
bytes being copied, not from a separate read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..io.safetensors_io import IO_STATS, Segment

# measured on 1 GB (read, hash, write, fsync): 256 KiB-1 MiB chunks cost 0.6 s of CPU; 4 MiB ones 1.8 s (a chunk
# read is no longer in the cache when it is hashed and written)
CHUNK = 512 << 10


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
    """Copies byte ranges and computed chunks into an output, each chunk fed to a sink as it is written, on the
    writing thread (one buffer, reused chunk after chunk)."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self._buf = memoryview(bytearray(chunk))

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
            n = min(len(self._buf), seg.length - done)
            part = self._buf[:n]
            seg.source.readinto(seg.offset + done, part)
            sink.update(part)
            write(part)
            done += n

    def chunk(self, sink: Sink, data: memoryview, write: Callable[[memoryview], None]) -> None:
        """A chunk someone else owns (a computed tensor's): fed, then written."""
        sink.update(data)
        write(data)
