"""The writer's check of an output as planned, on a thread while the kernel copies its whole files.

It starts once the files the writer writes itself, the small files and the links are in place; a file
still being copied whole is read from its input in its place (``StandIn``: the bytes the copy lands) and
the manifest is the one about to be written. Before the completion marker, what landed is proven to be
what was checked: every byte read in a copy's place is read again from the copy, its size compared, and
the manifest written says what the checked one said. Anything unproven (a check that took a stand-in's
descriptor, reading ranges not kept; a byte that differs) is checked again as it landed (``proven``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import CkptError
from ..io import digest
from ..io.safetensors_io import IO_STATS, LocalFile

SWITCH = 0.0002  # seconds: the interpreter's switch interval while the check runs


class StandIn(LocalFile):
    """An input file read in place of its copy in the output: every range read is kept as its digest, to be
    compared: memory stays bounded by the largest range, whatever share of a copy the check reads (scales the
    input's gate did not vouch for, a release's ~160 MB of them, are read whole)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: list[tuple[int, int, str]] = []  # (offset, length, digest)
        self.unrecorded = False  # its descriptor was handed out: reads not kept

    def readinto(self, offset: int, buf: memoryview) -> None:
        super().readinto(offset, buf)
        self.reads.append((offset, len(buf), _digest(buf)))

    def local_fd(self) -> int | None:
        self.unrecorded = True
        return super().local_fd()


class EarlyCheck:
    """``run(stand_ins)`` on a thread once ``ready`` is done; ``stand_ins``: output file -> the input it copies."""

    def __init__(self, run: Callable[[dict[str, Callable[[], StandIn]]], dict], copies: dict[str, Path],
                 ready: Future) -> None:
        self.copies = copies
        self.stands: dict[str, StandIn] = {}
        # what the check read of the manifest (``run``'s result) as one digest: the manifest itself has an entry
        # per tensor (~0.5 KB each), not to be held until the written one is compared
        self.checked: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-check")
        self._future = self._pool.submit(self._run, run, ready)
        self._pool.shutdown(wait=False)

    def _run(self, run: Callable[[dict[str, Callable[[], StandIn]]], dict], ready: Future) -> None:
        IO_STATS.quiet()  # it reads the output (and inputs in place of copies), not what the verb reads
        ready.result()  # the files written so far in place
        # the writer takes the GIL back after each kernel copy: it waits for this thread at most this long (5 ms by
        # default: a copy of 8 MiB takes about 3 ms, so the copies would crawl beside the check)
        was = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH)
        try:
            self.checked = _as_checked(run({name: lambda n=name, p=path: self._stand(n, p)
                                            for name, path in self.copies.items()}))
        finally:
            sys.setswitchinterval(was)

    def _stand(self, name: str, path: Path) -> StandIn:
        self.stands[name] = StandIn(path)
        return self.stands[name]

    def passed(self) -> bool:
        """Wait for the check: whether it found the output valid. A refusal is not reported from here: it judged
        inputs in the copies' place, so the writer judges what landed again and reports that (its bytes, its
        names); anything else (a crash) is raised."""
        try:
            self._future.result()
        except CkptError:
            return False
        return True

    def wait(self) -> None:
        """Wait for the check, whatever came of it."""
        self._future.exception()

    def proven(self, out: Path, manifest: dict) -> bool:
        """What landed is what was checked: each copy holds the bytes read in its place, at its size, and
        ``manifest`` (written) says what the checked one said."""
        if self.checked is None or _as_checked(manifest) != self.checked:
            return False
        for name, stand in self.stands.items():
            if stand.unrecorded:
                return False
            try:
                fd = os.open(out / name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return False
            try:
                if os.fstat(fd).st_size != stand.size:
                    return False
                if any(_digest(os.pread(fd, n, at)) != want for at, n, want in stand.reads):
                    return False
            finally:
                os.close(fd)
        return True


def _digest(data: bytes | memoryview) -> str:
    h = digest.new("blake3")
    h.update(data)
    return h.hexdigest()


def _as_checked(manifest: dict) -> str:
    """The digest of what a check reads of a manifest: all but the digests and what only the bytes that landed say
    (canonical JSON: keys sorted, so two manifests that are equal there have the same digest)."""
    rest = {k: v for k, v in manifest.items() if k not in ("inputs", "files", "tensors", "file_stats")}
    tensors = {k: (e.get("file"), e.get("dtype"), e.get("shape")) for k, e in manifest.get("tensors", {}).items()}
    return _digest(json.dumps([rest, tensors], sort_keys=True, default=repr).encode())
