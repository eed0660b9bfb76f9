"""Content digests: BLAKE3 for what the manifest vouches for, sha256 where a consumer needs it.

Every byte an output holds is hashed into its manifest, so the digest's speed bounds the writer's:
on 2-core VMs sha256 runs 1.1 GB/s a core, BLAKE3 4.8 GB/s on one thread and 7.8 GB/s on two.
The manifest therefore records ``blake3``; ``sha256`` stays where a consumer compares it (the Hub's
LFS oid, manifests of earlier versions), and ``verify-manifest`` checks either.

Two environment knobs reproduce the older writer, for before/after benchmarks:
``CKPT_MANIFEST_DIGEST`` (``blake3``, the default, or ``sha256``) and ``CKPT_HASH_THREADS`` (threads
hashing files linked whole, default 2; kernel-copied ranges are hashed from the page cache on one more,
stream/hashcopy.py; ``0`` hashes both inline). They are
read when used (``MANIFEST_ALGO`` is computed on access), so a bad value is a usage error, not a
traceback at import.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Protocol

from ..errors import UsageError

ALGOS = ("blake3", "sha256")  # the fields verify-manifest understands, preferred first
DEFAULT_ALGO = "blake3"
DEFAULT_HASH_THREADS = 2  # two copied shards hash at once while the writing thread keeps the kernel copying
ALGO_ENV = "CKPT_MANIFEST_DIGEST"
THREADS_ENV = "CKPT_HASH_THREADS"
_MAX_THREADS = 256
_HEX64 = re.compile(r"[0-9a-f]{64}")


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def manifest_algo() -> str:
    """The algorithm the manifest records (the field name written into ckpt_manifest.json)."""
    value = os.environ.get(ALGO_ENV, "").strip().lower() or DEFAULT_ALGO
    if value not in ALGOS:
        raise UsageError(f"{ALGO_ENV}={value!r}: use one of {', '.join(ALGOS)}", rule="env")
    return value


def hash_threads() -> int:
    """Threads that hash what lands in the output beside the copies; 0: inline, on the writing thread.

    Checks ``CKPT_MANIFEST_DIGEST`` too: the writer asks before its first shard, so a bad knob stops it there.
    """
    manifest_algo()
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return DEFAULT_HASH_THREADS
    if not text.isdigit() or int(text) > _MAX_THREADS:
        raise UsageError(f"{THREADS_ENV}={text!r}: use a whole number from 0 (inline) to {_MAX_THREADS}", rule="env")
    return int(text)


def __getattr__(name: str) -> str:
    # ``digest.MANIFEST_ALGO`` reads the knob when used (PEP 562), for the modules that name the field
    if name == "MANIFEST_ALGO":
        return manifest_algo()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def new(algo: str | None = None) -> Hasher:
    """A fresh hasher (default: the manifest's); both algorithms release the GIL while they hash, so threads overlap."""
    algo = algo or manifest_algo()
    if algo == "blake3":
        from blake3 import blake3  # imported on first use: commands that write nothing never pay for it

        return blake3()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest {algo!r}")


class _Inline(Executor):
    """Runs each job as it is submitted: hashing on the caller's thread (``CKPT_HASH_THREADS=0``)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # delivered by .result(), as a pool's would be
            fut.set_exception(e)
        return fut


def executor(threads: int, name: str = "ckpt-hash") -> Executor:
    """Where hashes run: a pool of ``threads`` beside the copies, or inline when 0."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name) if threads > 0 else _Inline()


def recorded(entry: dict) -> tuple[str, object] | None:
    """(algorithm, value) of the digest a manifest entry records, preferring BLAKE3; None when it has none."""
    for algo in ALGOS:
        if algo in entry:
            return algo, entry[algo]
    return None


def well_formed(value: object) -> bool:
    """Both algorithms give 32 bytes, written as 64 lowercase hex digits."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a whole file, read in 8 MiB chunks (what the Hub's LFS pointers and our GGUF matching name)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
