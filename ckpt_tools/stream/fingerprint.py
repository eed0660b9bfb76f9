"""Input fingerprints: what each input of a plan was when it was planned.

A fingerprint proves identity without reading tensor data the plan does not read: ``root`` (the
absolute path, or ``hf://org/repo@commit``); ``files`` (per shard its size, mtime, the sha256 of its
header bytes, the Hub's LFS sha256); ``side_files`` (sha256 of config.json, index, manifest);
``other_files`` (size and mtime of the non-weight files); ``tensors`` (drafts only: the count and
combined BLAKE3 of the tensors the plan takes, computed when the plan is written, never for a dry run).

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


def fingerprint(ckpt: Checkpoint, tensor_keys: Iterable[str] = (), *, plan: Plan | None = None,
                known: Mapping[Segment, str] | None = None) -> dict:
    """The identity of ``ckpt`` (see the module docstring); ``tensor_keys``: tensors taken from it.

    With ``plan``, the tensors' digest (which reads their bytes) is left to ``plan.settle_fingerprints``,
    which runs when the plan is written: a ``--dry-run`` of a release's 15 GB MTP layer reads nothing.
    ``known``: digests of byte ranges already read whole (stitch's comparison), not read again.
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
        refs = [ckpt.tensors[k] for k in keys]

        def settle() -> None:
            fp["tensors"] = {"count": len(refs), digest.MANIFEST_ALGO: tensors_digest(refs, known)}

        if plan is None:
            settle()
        else:
            plan.pending_fingerprints.append(settle)
    return fp


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


def tensors_digest(refs: list[TensorRef], known: Mapping[Segment, str] | None = None) -> str:
    """One digest over (key, dtype, shape, digest of the bytes) of every tensor, in key order (``known``: digests of
    byte ranges already read, by range)."""
    known = known or {}
    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="ckpt-fingerprint") as pool:
        digests = list(pool.map(lambda ref: known.get(ref.segment()) or tensor_digest(ref), refs))
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
