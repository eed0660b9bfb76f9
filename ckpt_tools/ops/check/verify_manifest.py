"""`ckpt verify-manifest`: every tensor of the output accounted for, every digest recomputed.

The manifest lists every tensor of the output with its file, dtype and shape, and proves its
bytes one of two ways: its own digest (tensors the writer wrote), or the whole-file digest of
the shard it sits in (``files``: shards copied or linked as they were; one whose input's manifest
had its digests per tensor keeps them per tensor, ``"digests": "per-tensor"``). A digest is ``blake3``
(what the writer records) or ``sha256`` (manifests of earlier versions); each is recomputed with
its own algorithm (``digest.recorded``). Verification streams
each tensor range or whole file through the hash in fixed-size chunks (memory stays at one
chunk), file by file in offset order. A tensor the checkpoint holds but the manifest does not
list is a problem (``unlisted``), as is a listed tensor without any digest (``no-hash``).
Shards left on the Hub (``stitch --link remote``) cannot be verified locally: they are counted
and the report is not OK. A GGUF sidecar directory is verified by ``verify_gguf``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from ...errors import InputError
from ...io import digest
from ...io.checkpoint import MANIFEST_NAME, Checkpoint, open_lenient
from ...io.safetensors_io import Segment, iter_chunks
from ...stream.progress import Progress
from .verify_gguf import gguf_manifest, verify_gguf
from .verify_report import HASH_CHUNK, Mismatch, VerifyReport


def load_manifest(ckpt: Checkpoint) -> dict:
    """The whole manifest, checked to have a ``tensors`` object; InputError (exit 3) when unusable."""
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
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tensors"), dict):
        raise InputError("the manifest has no 'tensors' object", rule="manifest-json", path=where)
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise InputError("the manifest's 'files' must map file names to objects", rule="manifest-json", path=where)
    return manifest


def _file_name(ckpt: Checkpoint, source) -> str:
    return next((name for name, src in ckpt.sources.items() if src is source), source.name)


def _hash(seg: Segment, algo: str, progress: Progress) -> str:
    """The ``algo`` digest of a byte range, streamed in chunks."""
    h = digest.new(algo)
    for chunk in iter_chunks(seg, HASH_CHUNK):
        h.update(chunk)
        progress.advance(len(chunk))
    return h.hexdigest()


def open_output(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at ``path``; shards its manifest says were left on the Hub may be absent."""
    try:
        return Checkpoint.open(path)
    except InputError as e:
        if e.rule != "missing-shard" or "://" in str(path):
            raise
    opened = open_lenient(path)
    remote = set((opened.ckpt.manifest or {}).get("remote_files") or {})
    for err in opened.errors:
        if not (err.rule == "missing-shard" and err.path and os.path.basename(err.path) in remote):
            opened.ckpt.close()
            raise err
    return opened.ckpt


def verify_manifest(path: str | os.PathLike, progress: Progress | None = None) -> VerifyReport:
    if "://" not in str(path) and (sidecar := gguf_manifest(Path(path))) is not None:
        return verify_gguf(Path(path), sidecar, progress or Progress())
    with open_output(path) as ckpt:
        return _verify(ckpt, load_manifest(ckpt), progress or Progress())


def _verify(ckpt: Checkpoint, manifest: dict, progress: Progress) -> VerifyReport:
    entries: dict = manifest["tensors"]
    files: dict[str, dict] = manifest.get("files", {})
    remote = {n for n, f in files.items() if "remote" in f} | set(manifest.get("remote_files") or {})
    report = VerifyReport(ckpt.root, listed=len(entries))
    for key in sorted(k for k in ckpt.tensors if k not in entries):
        report.mismatches.append(Mismatch(key, "unlisted", _file_name(ckpt, ckpt.tensors[key].source),
                                          "listed", "not in the manifest"))
        report.unlisted += 1

    by_file: dict[str, int] = {}  # tensors each whole-file digest vouches for
    todo: list[tuple[tuple[str, str], str, Segment, str]] = []  # ((algo, expected), key, bytes, file)
    for key, entry in entries.items():
        entry = entry if isinstance(entry, dict) else {}
        if entry.get("file") in remote:
            report.remote_tensors += 1
            continue
        ref = ckpt.tensors.get(key)
        if ref is None:
            report.mismatches.append(Mismatch(key, "missing", entry.get("file"), "listed", "absent"))
            continue
        fname = _file_name(ckpt, ref.source)
        checks = (("file", entry.get("file"), fname), ("dtype", entry.get("dtype"), ref.dtype),
                  ("shape", entry.get("shape"), list(ref.shape)))
        bad = [(what, want, got) for what, want, got in checks if want is not None and want != got]
        report.mismatches += [Mismatch(key, what, fname, str(want), str(got)) for what, want, got in bad]
        own = digest.recorded(entry)
        if own is None and (digest.recorded(files.get(fname, {})) is not None or _store_copy(files.get(fname))):
            by_file[fname] = by_file.get(fname, 0) + (not bad)
        elif own is None or not digest.well_formed(own[1]):
            report.mismatches.append(Mismatch(key, "no-hash", fname, None if own is None else str(own[1])[:80], None))
        elif not bad:
            todo.append((own, key, ref.segment(), fname))
    wholes = list(_whole_files(ckpt, files, remote, report))
    for name in _etag_files(ckpt, files, report):  # server-side copies: vouched for by the store's ETag
        report.files_verified += 1
        report.verified += by_file.get(name, 0)
    report.remote_files = sorted(n for n in remote if n in files or n in (manifest.get("remote_files") or {}))

    todo.sort(key=lambda t: (t[3], t[2].offset))  # file by file, in offset order: sequential reads
    progress.phase("hashing", sum(seg.length for _, _, seg, _ in todo) + sum(seg.length for _, seg, _ in wholes))
    try:
        for (algo, want), key, seg, fname in todo:
            got = _hash(seg, algo, progress)
            report.bytes_hashed += seg.length
            if got == want:
                report.verified += 1
            else:
                report.mismatches.append(Mismatch(key, "digest", fname, f"{algo} {want}", f"{algo} {got}"))
        for name, seg, (algo, want) in wholes:
            got = _hash(seg, algo, progress)
            report.bytes_hashed += seg.length
            if got == want:
                report.files_verified += 1
                report.verified += by_file.get(name, 0)
            else:
                report.mismatches.append(Mismatch(name, "file-digest", name, f"{algo} {want}", f"{algo} {got}"))
    finally:
        progress.stop()
    report.mismatches.sort(key=lambda m: (m.file or "", m.key))
    return report


def _store_copy(about: dict | None) -> bool:
    """A file an object-store output copied server-side: listed with the store's ETag, no digest of ours."""
    return bool(about) and about.get("link") == "server-copy" and bool(about.get("etag"))


def _etag_files(ckpt: Checkpoint, files: dict[str, dict], report: VerifyReport) -> list[str]:
    """Names of the server-side copies whose object still carries the ETag the manifest recorded."""
    ok = []
    for name, about in sorted(files.items()):
        if not _store_copy(about):
            continue
        fs, url_of = getattr(ckpt, "fs", None), getattr(ckpt, "url_of", None)
        if fs is None or url_of is None:
            report.mismatches.append(Mismatch(name, "no-hash", name, f"etag {about['etag']}",
                                              "not in an object store: its ETag cannot be checked"))
            continue
        info = fs.info(url_of(name))
        got = info.get("ETag") or info.get("etag")
        if got == about["etag"] and info.get("size") == about.get("size"):
            ok.append(name)
        else:
            report.mismatches.append(Mismatch(name, "file-digest", name, f"etag {about['etag']}, {about.get('size')} B",
                                              f"etag {got}, {info.get('size')} B"))
    return ok


def _whole_files(ckpt: Checkpoint, files: dict[str, dict], remote: set[str], report: VerifyReport
                 ) -> Iterator[tuple[str, Segment, tuple[str, str]]]:
    """(name, the whole file, (algorithm, expected digest)) of each shard the manifest vouches for as a whole."""
    for name, about in sorted(files.items()):
        if name in remote or _store_copy(about):
            continue
        found, size = digest.recorded(about), about.get("size")
        src = ckpt.sources.get(name)
        if src is None:
            report.mismatches.append(Mismatch(name, "missing", name, "a shard of the checkpoint", "absent"))
        elif size is not None and size != src.size:
            report.mismatches.append(Mismatch(name, "file-size", name, str(size), str(src.size)))
        elif found is None and about.get("digests") == "per-tensor":
            continue  # carried whole, its digests per tensor (known_digests): each tensor is checked by its own
        elif found is None or not digest.well_formed(found[1]):
            report.mismatches.append(Mismatch(name, "no-hash", name, None if found is None else str(found[1])[:80],
                                              None))
        else:
            yield name, Segment(src, 0, src.size), found
