"""What `ckpt verify-manifest` reports, for a safetensors checkpoint or a GGUF sidecar."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...io.safetensors_io import COPY_CHUNK

HASH_CHUNK = min(COPY_CHUNK, 8 << 20)


@dataclass
class Mismatch:
    key: str  # a tensor key, or a file name for whole-file problems
    problem: str  # digest | missing | file | dtype | shape | no-hash | unlisted | file-digest | file-size
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
    verified: int = 0  # proven by their own digest or by their file's
    bytes_hashed: int = 0
    unlisted: int = 0  # tensors of the checkpoint the manifest does not list (each one a mismatch too)
    files_verified: int = 0  # shards proven by their whole-file digest
    remote_tensors: int = 0  # listed in shards left on the Hub: not verifiable locally
    remote_files: list[str] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.remote_files

    def to_json(self) -> dict:
        return {"root": self.root, "ok": self.ok, "listed": self.listed, "verified": self.verified,
                "bytes_hashed": self.bytes_hashed, "unlisted": self.unlisted, "files_verified": self.files_verified,
                "remote_tensors": self.remote_tensors, "remote_files": self.remote_files,
                "mismatches": [m.to_json() for m in self.mismatches]}
