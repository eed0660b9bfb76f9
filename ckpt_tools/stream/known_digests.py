"""Digests an input's own manifest already vouches for: a whole shard carried over is not hashed again.

Every local output's manifest records, per shard, the file as it landed (``file_stats``: size,
mtime_ns, inode, device). When a later run copies or hard-links that shard whole, the digest
the input's manifest holds for it - the whole-file digest of a shard it carried, or the
per-tensor digests of a shard it wrote - is taken over instead of hashing the bytes again,
provided the file as stat'ed now is the file the manifest described: same size, mtime_ns,
inode and device before the copy (and after it: not changed while read), and for a hard link
the output's inode is the input's. Anything else (no manifest, an older manifest without
``file_stats``, a copied directory, a touched or replaced file, another digest algorithm) is
hashed as before.

The proof is the one ``make`` and ``rsync`` rely on: a write changes the mtime, a replacement
the inode. A file rewritten in place with its mtime set back by hand is not detected -
``ckpt verify-manifest`` rehashes everything and still catches it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..io import digest
from ..io.safetensors_io import Header

STAT_FIELDS = ("size", "mtime_ns", "ino", "dev")


def file_stat(st: os.stat_result) -> dict[str, int]:
    """What ``file_stats`` records of a file: enough to tell that it was neither rewritten nor replaced."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def same_file(st: os.stat_result, recorded: dict) -> bool:
    return file_stat(st) == {k: recorded.get(k) for k in STAT_FIELDS}


@dataclass(frozen=True)
class KnownDigest:
    """A shard's digest as its input's manifest records it, and the file that manifest described."""

    manifest: str  # where it was read: the output names it as the digest's origin
    stat: dict[str, int]
    whole: str | None = None  # the whole-file digest (a shard the input carried whole)
    tensors: dict[str, str] | None = None  # else key -> digest of every tensor (a shard the input wrote)


def from_manifest(manifest: dict | None, name: str, header: Header | None, where: Path) -> KnownDigest | None:
    """The digest ``manifest`` records for shard ``name`` in the current algorithm, when it has one and the file's
    stat; per tensor only when every tensor of ``header`` has one, in that file, with the header's dtype and shape."""
    if not manifest or header is None:
        return None
    stats = manifest.get("file_stats")
    recorded = stats.get(name) if isinstance(stats, dict) else None
    if not isinstance(recorded, dict) or not all(type(recorded.get(k)) is int for k in STAT_FIELDS):
        return None
    stat = {k: recorded[k] for k in STAT_FIELDS}
    algo = digest.manifest_algo()
    files, tensors = manifest.get("files"), manifest.get("tensors")
    about = files.get(name) if isinstance(files, dict) else None
    if isinstance(about, dict) and digest.well_formed(about.get(algo)) and about.get("size") == stat["size"]:
        return KnownDigest(str(where), stat, whole=about[algo])
    if not isinstance(tensors, dict) or not header.tensors:
        return None
    per: dict[str, str] = {}
    for key, info in header.tensors.items():
        entry = tensors.get(key)
        if not (isinstance(entry, dict) and entry.get("file") == name and digest.well_formed(entry.get(algo))
                and entry.get("dtype") == info.dtype and entry.get("shape") == list(info.shape)):
            return None
        per[key] = entry[algo]
    return KnownDigest(str(where), stat, tensors=per)
