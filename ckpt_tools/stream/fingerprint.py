"""Input fingerprints: what each input of a plan was when it was planned.

A fingerprint proves identity without reading tensor data the plan does not read: ``root`` (the
absolute path, or ``hf://org/repo@commit``); ``files`` (per shard its size, mtime, the sha256 of its
header bytes, the Hub's LFS sha256); ``side_files`` (sha256 of config.json, index, manifest);
``other_files`` (size and mtime of the non-weight files); ``tensors`` (the count and combined BLAKE3 of
the tensors the plan takes: computed when the plan is written, never for a dry run; a tensor the output
copies whole is hashed as it is written, not read for it: ``TakenTensors``).

``record_inputs`` puts them in ``Plan.fingerprints`` (``--resume`` refuses when any differs) and
describes the shards an output copies whole: their header, and the digest the input's manifest holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..io import digest
from ..io.artefacts import MANIFEST_NAME
from ..io.checkpoint import Checkpoint
from ..io.safetensors_io import COPY_CHUNK, Segment, TensorRef, iter_chunks
from .known_digests import from_manifest
from .plan import Plan

HASH_THREADS = 2  # reads and hashlib release the GIL


def fingerprint(ckpt: Checkpoint, tensor_keys: Iterable[str], plan: Plan,
                known: Mapping[Segment, str] | None = None) -> dict:
    """The identity of ``ckpt`` (see the module docstring); ``tensor_keys``: tensors taken from it.

    Their digest (which reads their bytes) is left to ``plan`` (``TakenTensors``): a ``--dry-run`` of a
    release's 15 GB MTP layer reads nothing. ``known``: digests of byte ranges already read whole (stitch's
    comparison), not read again.
    """
    lfs = getattr(ckpt, "lfs_sha256", {})
    files: dict[str, dict] = {}
    for name, header in ckpt.headers.items():
        src = ckpt.sources[name]
        entry: dict = {"size": src.size, "header_sha256": header.sha256}
        fd = src.local_fd()
        if fd is not None:
            st = os.fstat(fd)
            entry.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
        elif name in lfs:
            entry["sha256"] = lfs[name]
        files[name] = entry
    fp: dict = {"root": root_of(ckpt), "files": files, "side_files": dict(sorted(ckpt.digests.items())),
                "other_files": _other_files(ckpt)}
    keys = sorted(set(tensor_keys))
    if keys:
        plan.pending_fingerprints.append(TakenTensors(fp, [ckpt.tensors[k] for k in keys], dict(known or {})))
    return fp


class TakenTensors:
    """The tensors a plan takes from an input, and their combined digest (``fp["tensors"]``), each tensor's bytes
    read at most once. A tensor the output copies whole (one byte range) is hashed as the writer copies it: its
    digest is left out of the plan's digest and the resume record (``planned``), which are written before it, and
    taken from what was written (``settle``); ``--resume`` reads it again (``copies``)."""

    def __init__(self, fp: dict, refs: list[TensorRef], known: dict[Segment, str]) -> None:
        self.fp, self.refs, self.known = fp, refs, known  # known: byte range -> digest, as they are had

    def planned(self, copied: set[Segment]) -> dict:
        """``fp`` as known before writing: the tensors not copied whole hashed (read now), the others counted."""
        rest = [r for r in self.refs if r.segment() in self.known or r.segment() not in copied]
        return {**self.fp, "tensors": {"count": len(self.refs), "copied": len(self.refs) - len(rest),
                                       digest.MANIFEST_ALGO: self._digest(rest)}}

    def copies(self, copied: set[Segment]) -> dict[Segment, str]:
        """The digests of the tensors copied whole, read from the input now (what ``--resume`` proves against)."""
        taken = [r for r in self.refs if r.segment() in copied]
        self._digest(taken)
        return {r.segment(): self.known[r.segment()] for r in taken}

    def settle(self, written: Mapping[Segment, str]) -> None:
        """``fp["tensors"]``, from the digests of the byte ranges the output copied whole (``written``), the
        ones already had and (the rest) the input's bytes."""
        self.known = {**written, **self.known}  # a range read from the input (--resume) is what it holds now
        self.fp["tensors"] = {"count": len(self.refs), digest.MANIFEST_ALGO: self._digest(self.refs)}

    def _digest(self, refs: list[TensorRef]) -> str:
        missing = [r for r in refs if r.segment() not in self.known]
        self.known.update(zip((r.segment() for r in missing), _read_digests(missing), strict=True))
        return combined(refs, [self.known[r.segment()] for r in refs])


def root_of(ckpt: Checkpoint) -> str:
    if ckpt.local_dir is None:
        return ckpt.root  # hf://org/repo@commit: pinned to a commit when opened
    return str(Path(ckpt.root).resolve())


def _other_files(ckpt: Checkpoint) -> dict[str, dict]:
    out: dict[str, dict] = {}
    sizes = getattr(ckpt, "file_sizes", {})
    for name in ckpt.files:
        if ckpt.local_dir is None:
            out[name] = {"size": sizes.get(name)}
            continue
        try:
            st = os.stat(ckpt.local_dir / name)
        except OSError:
            continue  # gone since opening: an output that carries it fails on its own
        out[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def _read_digests(refs: list[TensorRef]) -> list[str]:
    if not refs:
        return []
    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="ckpt-fingerprint") as pool:
        return list(pool.map(tensor_digest, refs))


def combined(refs: list[TensorRef], digests: list[str]) -> str:
    """One digest over (key, dtype, shape, digest of the bytes) of every tensor, in key order."""
    h = digest.new()
    for ref, d in zip(refs, digests, strict=True):
        h.update(f"{ref.key}\0{ref.dtype}\0{list(ref.shape)}\0{d}\n".encode())
    return h.hexdigest()


def tensor_digest(ref: TensorRef) -> str:
    h = digest.new()
    for chunk in iter_chunks(ref.segment(), COPY_CHUNK // 4):
        h.update(chunk)
    return h.hexdigest()


def record_inputs(plan: Plan, known: Mapping[Segment, str] | None = None,
                  **roles: Checkpoint | tuple[Checkpoint, Iterable[str]]) -> Plan:
    """Fingerprint each input into ``plan`` (role -> checkpoint, or (checkpoint, keys of tensors taken)); ``known``:
    digests of byte ranges the plan already read whole (``fingerprint``).

    Also: every local input becomes one of ``plan.inputs`` (the writer refuses an -o inside
    any of them), and shards the plan copies whole from an input get that input's header.
    """
    for role, what in roles.items():
        ckpt, keys = what if isinstance(what, tuple) else (what, ())
        plan.fingerprints[role] = fingerprint(ckpt, keys, plan=plan, known=known)
        local = Path(ckpt.root) if ckpt.local_dir is not None else None  # a directory, or a lone config.json
        if local is not None and local not in plan.inputs:
            plan.inputs.append(local)
        _describe_copied_shards(plan, ckpt)
    return plan


def _describe_copied_shards(plan: Plan, ckpt: Checkpoint) -> None:
    lfs = getattr(ckpt, "lfs_sha256", {})
    for name in ckpt.headers:
        remote = f"{ckpt.root}/{name}"
        local = ckpt.file_path(name) if ckpt.local_dir is not None else None
        for f in plan.files:
            if f.tensors and (f.remote == remote or (local is not None and f.source == local)):
                f.header = ckpt.headers[name]
                f.sha256 = f.sha256 or lfs.get(name)
                if ckpt.local_dir is not None and f.link != "remote":
                    f.known = from_manifest(ckpt.manifest, name, f.header, ckpt.local_dir / MANIFEST_NAME)
