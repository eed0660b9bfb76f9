"""What an output says about itself: ``ckpt_manifest.json`` and ``model.safetensors.index.json``.

The manifest accounts for every tensor of the output: a digest (see ``digest``) per tensor
written, and the whole-file digest of each shard copied or linked as it is. The index maps every
tensor to its file, with the true ``total_size``. Both are built from the plan and from what
landed; the writer writes them (the index last: it marks the output complete). Reading a
manifest back is ``checkpoint.parse_manifest``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import __version__
from ..io import digest
from ..jsonutil import dumps_indented

if TYPE_CHECKING:
    from .plan import Plan



def manifest_bytes(manifest: dict) -> bytes:
    return (dumps_indented(manifest, 1) + "\n").encode()  # strict: no bare NaN/Infinity


def manifest_dict(plan: Plan, plan_digest: dict[str, str], tensor_files: dict[str, str], digests: dict[str, str],
                  landed: dict[str, tuple[str, int, object]], landed_facts: Callable[[str], dict], *,
                  file_stats: dict[str, dict] | None = None, reused: dict[str, str] | None = None,
                  written: list[str] | None = None, settle: bool = True) -> dict:
    """Every tensor of the output: written ones with their digest, those in copied shards by their file's.

    ``tensor_files``: written tensor -> its file; ``digests``: tensor -> digest (written tensors, and those of a
    whole shard whose input's manifest had them per tensor); ``landed``: file copied or linked whole -> (digest,
    size, header) of what landed; ``landed_facts``: what the storage itself vouches for about such a file (an
    object store's ETag); ``file_stats``: local shard -> its stat as it landed (``known_digests``: what lets a
    later run take its digests over); ``reused``: whole file -> the input manifest its digest was taken from;
    ``written``: every file the run writes (side files included: what a later ``--overwrite`` removes);
    ``settle``: the inputs' fingerprints completed from ``digests`` (False: the manifest as planned, none yet).
    """
    reused = reused or {}
    algo = digest.MANIFEST_ALGO  # read once: the knob is looked up on each access
    manifest = {
        "tool": "ckpt-tools",
        "version": __version__,
        "command": plan.command,
        **plan.manifest,
        "inputs": plan.settle_fingerprints(digests) if settle else {},  # a tensor copied whole: its digest as written
        "plan": plan_digest,
        "files": {},
        "tensors": {},
    }
    shapes: dict[tuple, list[int]] = {}  # one list per shape, shared by its entries (a release has a few dozen)
    for t in plan.tensors:
        entry = {
            "file": tensor_files[t.key],
            "dtype": t.dtype,
            "shape": _shape(shapes, t.shape),
        }
        if t.key in digests:
            entry[algo] = digests[t.key]
        entry.update(t.meta)
        manifest["tensors"][t.key] = entry
    for f in plan.files:
        if not f.tensors:
            continue
        header = f.header
        if f.link == "remote":
            about = {"remote": f.remote, **({"sha256": f.sha256} if f.sha256 else {})}  # the Hub's LFS oid
        elif f.name in landed:
            value, size, header = landed[f.name]
            # no digest: copied server-side in an object store, never downloaded to be hashed - or its tensors
            # carry theirs, taken from the input's manifest
            about = {**({algo: value} if value else {}), "size": size,
                     "copied_from": str(f.source), "link": f.link, **landed_facts(f.name)}
            if f.name in reused:  # else: hashed from the bytes that landed
                about.update(digest_from=reused[f.name], **({} if value else {"digests": "per-tensor"}))
        else:
            continue  # hashing off (benchmark fixtures)
        manifest["files"][f.name] = about
        keys = header.tensors if header is not None else dict.fromkeys(f.tensors)
        for key, info in keys.items():
            entry = ({"file": f.name} if info is None else
                     {"file": f.name, "dtype": info.dtype, "shape": _shape(shapes, info.shape)})
            if key in digests:
                entry[algo] = digests[key]
            manifest["tensors"][key] = entry
    remote = {f.name: f.remote for f in plan.files if f.link == "remote"}
    if remote:
        # shards deliberately not downloaded: the output is complete once pushed over its base
        manifest["remote_files"] = remote
    if written:
        manifest["written"] = list(written)
    if file_stats:
        manifest["file_stats"] = dict(sorted(file_stats.items()))
    return manifest


def _shape(shapes: dict[tuple, list[int]], shape) -> list[int]:
    key = tuple(shape)
    found = shapes.get(key)
    if found is None:
        found = shapes[key] = list(key)
    return found


def index(plan: Plan, tensor_files: dict[str, str]) -> dict:
    """The index: every tensor (written ones from ``tensor_files``, those of whole files) and the total size."""
    weight_map = dict(tensor_files)
    total = sum(t.nbytes for t in plan.tensors)
    for f in plan.files:
        for key, nbytes in f.tensors.items():
            weight_map[key] = f.name
            total += nbytes
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def index_bytes(plan: Plan, tensor_files: dict[str, str]) -> bytes:
    return (dumps_indented(index(plan, tensor_files), 2) + "\n").encode()
