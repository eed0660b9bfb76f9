"""`ckpt verify-manifest` of a GGUF sidecar directory (``extract --format gguf``): its manifest names one GGUF
file (name, size), every tensor's type and shape, and each tensor's BLAKE3 of its data bytes as written. Each is
checked against the file as it is now: a tensor of the file the manifest does not list, one it lists that the
file lacks, another type or shape, a changed byte, a file of another size. Same report as for safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import InputError
from ...io import digest
from ...io.checkpoint import MANIFEST_NAME
from ...stream.progress import Progress
from .verify_report import HASH_CHUNK, Mismatch, VerifyReport

KIND = "mtp-gguf-sidecar"


def gguf_manifest(path: Path) -> dict | None:
    """The manifest of the GGUF sidecar directory at ``path``; None when it is not one."""
    file = path / MANIFEST_NAME
    if not path.is_dir() or not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_bytes())
    except (ValueError, RecursionError):
        return None  # the safetensors path reports unreadable manifests
    return manifest if isinstance(manifest, dict) and manifest.get("kind") == KIND else None


def verify_gguf(root: Path, manifest: dict, progress: Progress) -> VerifyReport:
    from ...io.gguf_file import read_gguf

    about, listed, digests = manifest.get("file"), manifest.get("tensors"), manifest.get("tensor_blake3")
    if not (isinstance(about, dict) and isinstance(listed, dict) and isinstance(digests, dict)):
        raise InputError("a GGUF sidecar manifest needs 'file', 'tensors' and 'tensor_blake3' objects",
                         rule="manifest-json", path=str(root / MANIFEST_NAME))
    name = str(about.get("name"))
    report = VerifyReport(str(root), listed=len(listed))
    path = root / name
    if Path(name).name != name or not path.is_file():
        report.mismatches.append(Mismatch(name, "missing", name, "the sidecar the manifest names", "absent"))
        return report
    if about.get("size") != path.stat().st_size:
        report.mismatches.append(Mismatch(name, "file-size", name, str(about.get("size")), str(path.stat().st_size)))
    gguf = read_gguf(path)
    for key in sorted(set(gguf.tensors) - set(listed)):
        report.mismatches.append(Mismatch(key, "unlisted", name, "listed", "not in the manifest"))
        report.unlisted += 1
    todo = []
    for key, entry in listed.items():
        t = gguf.tensors.get(key)
        if t is None:
            report.mismatches.append(Mismatch(key, "missing", name, "listed", "absent"))
            continue
        entry = entry if isinstance(entry, dict) else {}
        bad = [(what, want, got) for what, want, got in (("dtype", entry.get("type"), t.type_name),
                                                          ("shape", entry.get("shape"), list(t.shape))) if want != got]
        for what, want, got in bad:
            report.mismatches.append(Mismatch(key, what, name, str(want), str(got)))
        want = digests.get(key)
        if not digest.well_formed(want):
            report.mismatches.append(Mismatch(key, "no-hash", name, None if want is None else str(want)[:80], None))
        elif not bad:
            todo.append((t, want))
    todo.sort(key=lambda item: item[0].offset)
    progress.phase("hashing", sum(t.nbytes for t, _ in todo))
    try:
        for t, want in todo:
            h = digest.new("blake3")
            for chunk in t.chunks(path, HASH_CHUNK):
                h.update(chunk)
                progress.advance(len(chunk))
            report.bytes_hashed += t.nbytes
            if h.hexdigest() == want:
                report.verified += 1
            else:
                report.mismatches.append(Mismatch(t.name, "digest", name, f"blake3 {want}", f"blake3 {h.hexdigest()}"))
    finally:
        progress.stop()
    report.files_verified = int(not report.mismatches)
    report.mismatches.sort(key=lambda m: m.key)
    return report
