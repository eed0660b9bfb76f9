"""Per-core copy and hash rates, the inputs of the 16-core projection in BENCHMARKS.md.

``python benchmarks/hashrate.py TMPFS_DIR SHARD...`` prints JSON: bytes per second of one
thread for each way of moving or hashing the same bytes (the shards' first ``LIMIT`` bytes,
warm in the page cache), the median of ``PASSES`` passes:

- ``sendfile``: the input into a tmpfs file in the kernel (the tmpfs floor's copy);
- ``buffered_copy``: ``preadv`` into a ``COPY_CHUNK`` buffer and ``write`` - what ckpt's writer
  does when ``copy_file_range`` refuses to cross filesystems (disk -> tmpfs);
- ``blake3``, ``sha256``: ``preadv`` of ``HASH_CHUNK`` pieces of that tmpfs file and ``update``,
  what one hash thread of the writer does;
- ``blake3_x2``, ``sha256_x2``: the same on two threads at once, each on half the bytes (their sum:
  does hashing scale with threads here?).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from blake3 import blake3

from ckpt_tools.io.safetensors_io import COPY_CHUNK
from ckpt_tools.stream.writer import HASH_CHUNK

LIMIT = 1 << 30
PASSES = 3
ALGOS = {"blake3": blake3, "sha256": hashlib.sha256}


def _ranges(shards: list[str], limit: int) -> list[tuple[str, int]]:
    out, left = [], limit
    for s in shards:
        n = min(left, os.path.getsize(s))
        if n:
            out.append((s, n))
        left -= n
    return out


def _copy(ranges: list[tuple[str, int]], dst: Path, buffered: bool) -> None:
    buf = memoryview(bytearray(COPY_CHUNK))
    fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for src, n in ranges:
            fd_in = os.open(src, os.O_RDONLY)
            try:
                done = 0
                while done < n:
                    if buffered:
                        k = os.preadv(fd_in, [buf[: min(len(buf), n - done)]], done)
                        view = buf[:k]
                        while len(view):
                            view = view[os.write(fd_out, view):]
                    else:
                        k = os.sendfile(fd_out, fd_in, done, n - done)
                    if k <= 0:
                        raise OSError(f"{src}: short read at {done}")
                    done += k
            finally:
                os.close(fd_in)
    finally:
        os.close(fd_out)


def _hash(path: Path, algo: str, offset: int, length: int) -> None:
    h = ALGOS[algo]()
    mv = memoryview(bytearray(HASH_CHUNK))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            k = os.preadv(fd, [mv[: min(len(mv), length - done)]], offset + done)
            if k <= 0:
                raise OSError(f"{path}: short read at {offset + done}")
            h.update(mv[:k])
            done += k
    finally:
        os.close(fd)
    h.hexdigest()


def _hash_threads(path: Path, algo: str, total: int, threads: int) -> None:
    part = total // threads
    ts = [threading.Thread(target=_hash, args=(path, algo, i * part, part)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _rate(nbytes: int, fn) -> float:
    times = []
    for _ in range(PASSES):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def measure(tmpfs: Path, shards: list[str], limit: int = LIMIT) -> dict:
    ranges = _ranges(shards, limit)
    total = sum(n for _, n in ranges)
    tmpfs.mkdir(parents=True, exist_ok=True)
    dst = tmpfs / "rates.bin"
    try:
        rates = {"buffered_copy": _rate(total, lambda: _copy(ranges, dst, buffered=True)),
                 "sendfile": _rate(total, lambda: _copy(ranges, dst, buffered=False))}
        for algo in ALGOS:
            rates[algo] = _rate(total, lambda a=algo: _hash(dst, a, 0, total))
            rates[f"{algo}_x2"] = _rate(total, lambda a=algo: _hash_threads(dst, a, total, 2))
    finally:
        dst.unlink(missing_ok=True)
    return {"bytes": total, "passes": PASSES, "bytes_per_s": rates}


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print("usage: python benchmarks/hashrate.py TMPFS_DIR SHARD...", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(measure(Path(sys.argv[1]), sys.argv[2:])))
