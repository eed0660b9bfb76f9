"""One digest for a checkpoint's tensors: what a probe report measured, and what ``ckpt push`` publishes.

``sha256`` over one line per tensor, sorted by name: ``NAME DTYPE SHAPE BLAKE3\\n`` (shape as comma-separated
dimensions), where BLAKE3 is the digest of the tensor's stored bytes, as ``ckpt_manifest.json`` records it per
tensor. The manifest's per-tensor digest is taken over when its dtype and shape are the header's and the shard is
the file the manifest described (``file_stats``: same size, mtime, inode, device; see ``known_digests``);
every other tensor is hashed. Either way the value depends on the tensors alone, so a checkpoint's digest is the
same with or without a manifest, and its other files (README, reports) do not enter it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ...io import digest
from ...io.checkpoint import Checkpoint
from ...io.safetensors_io import iter_chunks
from ...stream.known_digests import same_file

ALGO = "blake3"  # per tensor: the manifest's default algorithm, so its entries are taken over
_CHUNK = 8 << 20


@dataclass(frozen=True)
class TensorsDigest:
    sha256: str
    tensors: int
    from_manifest: int  # tensors whose digest came from the manifest (the rest were hashed)

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "tensors": self.tensors, "from_manifest": self.from_manifest}


def tensors_digest(path: str | os.PathLike) -> TensorsDigest:
    """The digest of the tensors of the checkpoint at ``path`` (see the module docstring)."""
    with Checkpoint.open(path) as ckpt:
        trusted = _manifest_digests(ckpt)
        lines = []
        for key in sorted(ckpt.tensors):
            ref = ckpt.tensors[key]
            value = trusted.get(key)
            if value is None:
                h = digest.new(ALGO)
                for chunk in iter_chunks(ref.segment(), _CHUNK):
                    h.update(chunk)
                value = h.hexdigest()
            lines.append(f"{key} {ref.dtype} {','.join(map(str, ref.shape))} {value}\n")
        return TensorsDigest(hashlib.sha256("".join(lines).encode()).hexdigest(), len(lines),
                             sum(1 for k in ckpt.tensors if k in trusted))


def _manifest_digests(ckpt: Checkpoint) -> dict[str, str]:
    """key -> the manifest's BLAKE3 of that tensor, for tensors in shards the manifest described as they are now."""
    manifest, d = ckpt.manifest, ckpt.local_dir
    if not isinstance(manifest, Mapping) or d is None:
        return {}
    entries, stats = manifest.get("tensors"), manifest.get("file_stats")
    if not isinstance(entries, Mapping) or not isinstance(stats, Mapping):
        return {}
    unchanged: set[str] = set()
    for name in ckpt.headers:
        recorded = stats.get(name)
        try:
            if isinstance(recorded, Mapping) and same_file(os.stat(d / name), dict(recorded)):
                unchanged.add(name)
        except OSError:
            continue
    shard = {id(src): name for name, src in ckpt.sources.items()}
    out: dict[str, str] = {}
    for key, ref in ckpt.tensors.items():
        entry = entries.get(key)
        if (isinstance(entry, Mapping) and entry.get("file") in unchanged
                and entry.get("file") == shard.get(id(ref.source))
                and entry.get("dtype") == ref.dtype and entry.get("shape") == list(ref.shape)
                and digest.well_formed(entry.get(ALGO))):
            out[key] = entry[ALGO]
    return out
