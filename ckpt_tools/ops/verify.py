"""`ckpt verify-manifest`: recompute the sha256 of every tensor ckpt_manifest.json lists, and compare.

The manifest records, per tensor written, its file, dtype, shape and the sha256 of its bytes.
Verification streams each tensor's byte range through the hash in fixed-size chunks (memory
stays at one chunk whatever the tensor size), file by file in offset order so reads are
sequential. Tensors the checkpoint holds but the manifest does not list (a stitch copies
untouched verifier shards whole) are counted, not judged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field

from ..checkpoint import MANIFEST_NAME, Checkpoint
from ..errors import InputError
from ..safetensors_io import COPY_CHUNK, TensorRef, iter_chunks
from ..writer import Progress

_SHA256 = re.compile(r"[0-9a-f]{64}")
HASH_CHUNK = min(COPY_CHUNK, 8 << 20)


@dataclass
class Mismatch:
    key: str
    problem: str  # sha256 | missing | file | dtype | shape | no-hash
    file: str | None
    expected: str | None
    actual: str | None

    def to_json(self) -> dict:
        return {"key": self.key, "problem": self.problem, "file": self.file, "expected": self.expected,
                "actual": self.actual}


@dataclass
class VerifyReport:
    root: str
    listed: int = 0  # tensors in the manifest
    verified: int = 0  # hashed and matching
    bytes_hashed: int = 0
    unlisted: int = 0  # tensors of the checkpoint the manifest does not list
    unhashed_copies: int = 0  # listed as copied unchanged from an input, without a hash of their own
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict:
        return {"root": self.root, "ok": self.ok, "listed": self.listed, "verified": self.verified,
                "bytes_hashed": self.bytes_hashed, "unlisted": self.unlisted,
                "unhashed_copies": self.unhashed_copies,
                "mismatches": [m.to_json() for m in self.mismatches]}


def load_manifest(ckpt: Checkpoint) -> dict:
    """The manifest's ``tensors`` object; InputError (exit 3) when there is none or it is unusable."""
    where = str(ckpt.local_dir / MANIFEST_NAME) if ckpt.local_dir is not None else f"{ckpt.root}/{MANIFEST_NAME}"
    manifest = ckpt.manifest
    if ckpt.local_dir is not None:
        path = ckpt.local_dir / MANIFEST_NAME
        if not path.is_file():
            raise InputError(f"no {MANIFEST_NAME}: nothing to verify against", rule="no-manifest", path=str(ckpt.root))
        try:
            manifest = json.loads(path.read_bytes())
        except (ValueError, RecursionError) as e:
            raise InputError(f"not valid JSON: {e}", rule="manifest-json", path=where) from None
    elif manifest is None:
        raise InputError(f"no readable {MANIFEST_NAME}: nothing to verify against", rule="no-manifest",
                         path=ckpt.root)
    tensors = manifest.get("tensors") if isinstance(manifest, dict) else None
    if not isinstance(tensors, dict):
        raise InputError("the manifest has no 'tensors' object", rule="manifest-json", path=where)
    return tensors


def _file_name(ckpt: Checkpoint, ref: TensorRef) -> str:
    for name, src in ckpt.sources.items():
        if src is ref.source:
            return name
    return ref.file


def hash_ref(ref: TensorRef, progress: Progress | None = None) -> str:
    """sha256 of a tensor's bytes, streamed in chunks."""
    h = hashlib.sha256()
    for chunk in iter_chunks(ref.segment(), HASH_CHUNK):
        h.update(chunk)
        if progress is not None:
            progress.advance(len(chunk))
    return h.hexdigest()


def verify_manifest(path: str | os.PathLike, progress: Progress | None = None) -> VerifyReport:
    ckpt = Checkpoint.open(path)
    entries = load_manifest(ckpt)
    progress = progress or Progress()
    report = VerifyReport(ckpt.root, listed=len(entries))
    report.unlisted = sum(1 for k in ckpt.tensors if k not in entries)

    todo: list[tuple[str, TensorRef, str]] = []
    for key, entry in entries.items():
        entry = entry if isinstance(entry, dict) else {}
        ref = ckpt.tensors.get(key)
        if ref is None:
            report.mismatches.append(Mismatch(key, "missing", entry.get("file"), "listed", "absent"))
            continue
        fname = _file_name(ckpt, ref)
        checks = (("file", entry.get("file"), fname), ("dtype", entry.get("dtype"), ref.dtype),
                  ("shape", entry.get("shape"), list(ref.shape)))
        bad = [(what, want, got) for what, want, got in checks if want is not None and want != got]
        for what, want, got in bad:
            report.mismatches.append(Mismatch(key, what, fname, str(want), str(got)))
        sha = entry.get("sha256")
        if sha is None and entry.get("copied_from"):
            report.unhashed_copies += 1  # bytes copied unchanged from an input (stitch); nothing to compare
            continue
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            report.mismatches.append(Mismatch(key, "no-hash", fname, None if sha is None else str(sha)[:80], None))
        elif not bad:
            todo.append((sha, ref, fname))

    todo.sort(key=lambda t: (t[2], t[1].offset))  # file by file, in offset order: sequential reads
    progress.start(sum(ref.nbytes for _, ref, _ in todo), "verify")
    try:
        for sha, ref, fname in todo:
            got = hash_ref(ref, progress)
            report.bytes_hashed += ref.nbytes
            if got == sha:
                report.verified += 1
            else:
                report.mismatches.append(Mismatch(ref.key, "sha256", fname, sha, got))
    finally:
        progress.stop()
    report.mismatches.sort(key=lambda m: (m.file or "", m.key))
    return report
