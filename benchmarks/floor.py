"""The floor: move exactly the bytes a verb must move, the way ``cp`` does, and nothing else.

``python -m benchmarks.floor JOB.json [--fsync]``. JOB lists output files, each made
of byte ranges of input files (``pieces``: [source, offset, length]) laid end to end,
or a hard link to a source (``link``). Ranges are copied in the kernel with
``copy_file_range`` (what GNU cp uses), so no byte enters user space; with
``"copy": "sendfile"`` in the job, with ``sendfile`` (which, unlike copy_file_range,
crosses filesystems in the kernel: a disk into tmpfs). ``reads`` ([source, offset,
length]) are byte ranges the verb must bring into memory to look at (stitch compares the
draft's tensors with the verifier's): they are read with ``preadv`` into one buffer
before anything is written. With ``--fsync`` every file and directory written is
fsynced, as our writer does.

Standard library only, so that it starts as fast as ``cp``.
"""

from __future__ import annotations

import json
import os
import sys

READ_BUFFER = 8 << 20


def copy_range(fd_in: int, fd_out: int, offset: int, length: int) -> None:
    done = 0
    while done < length:
        n = os.copy_file_range(fd_in, fd_out, length - done, offset + done)
        if n == 0:
            raise OSError(f"short copy: {done} of {length} bytes")
        done += n


def send_range(fd_in: int, fd_out: int, offset: int, length: int) -> None:
    done = 0
    while done < length:
        n = os.sendfile(fd_out, fd_in, offset + done, length - done)
        if n == 0:
            raise OSError(f"short sendfile: {done} of {length} bytes")
        done += n


COPIERS = {"copy_file_range": copy_range, "sendfile": send_range}


def read_ranges(ranges: list[list], buf: memoryview) -> int:
    """Bring every range into ``buf`` (overwritten chunk by chunk): the floor of looking at bytes."""
    total = 0
    opened: dict[str, int] = {}
    try:
        for src, offset, length in ranges:
            if src not in opened:
                opened[src] = os.open(src, os.O_RDONLY)
            done = 0
            while done < length:
                n = os.preadv(opened[src], [buf[: min(len(buf), length - done)]], offset + done)
                if n <= 0:
                    raise OSError(f"short read: {src} at {offset + done}")
                done += n
            total += length
    finally:
        for fd in opened.values():
            os.close(fd)
    return total


def run_job(job: dict, fsync: bool) -> int:
    """Bytes copied (reads not included)."""
    copy = COPIERS[job.get("copy", "copy_file_range")]
    if job.get("reads"):
        read_ranges(job["reads"], memoryview(bytearray(READ_BUFFER)))
    total = 0
    dirs: set[str] = set()
    for f in job["files"]:
        path = f["path"]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        dirs.add(os.path.dirname(path) or ".")
        if "link" in f:
            os.link(f["link"], path)
            continue
        fd_out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            opened: dict[str, int] = {}
            try:
                for src, offset, length in f["pieces"]:
                    if src not in opened:
                        opened[src] = os.open(src, os.O_RDONLY)
                    copy(opened[src], fd_out, offset, length)
                    total += length
            finally:
                for fd in opened.values():
                    os.close(fd)
            if fsync:
                os.fsync(fd_out)
        finally:
            os.close(fd_out)
    if fsync:
        for d in sorted(dirs):
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return total


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python -m benchmarks.floor JOB.json [--fsync]", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        job = json.load(fh)
    n = run_job(job, "--fsync" in argv[1:])
    print(f"copied {n} bytes, read {sum(r[2] for r in job.get('reads', []))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
