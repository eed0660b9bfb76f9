"""Draft readers: weights that are not safetensors, seen as the tensor references a Checkpoint holds.

Trainers save drafts as torch state dicts (``pytorch_model.bin``, ``*.pt``, ``*.pth``, sharded with
``pytorch_model.bin.index.json``; see ``torch_state``) or as torch distributed checkpoints (DCP: a
``.metadata`` file and ``*.distcp`` files, alone or as the ``model/`` folder of a training step; see
``dcp``). A reader turns either into a ``WeightSet``: per input file a ``TensorFile`` - a ByteSource
whose address space holds that file's tensors end to end, each as the C-order bytes safetensors
would store - and a ``TensorRef`` into it for every tensor. Every recipe (byte copies, compare,
hashing) then reads them like a safetensors shard.

Bytes are read where they lie: a tensor stored contiguously is a byte range of its file (pread,
nothing loaded). Only the rest (a non-contiguous view, a DCP tensor split along another axis or
stored through a transform) is loaded when first read, into a small bounded cache, and copied out
in C order a piece at a time: memory stays bounded by about one such tensor.

Nothing here runs plain pickle: torch files go through ``torch.load(weights_only=True)`` and DCP's
``.metadata`` through an unpickler that knows only DCP's metadata classes.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import InputError
from .base import READERS, TORCH_SUFFIXES, Confine, ReadIndex, WeightSet


def detect(d: Path) -> str | None:
    """The reader for directory ``d`` by what it holds ("torch", "dcp"), or None when it holds neither."""
    from .dcp import find_dcp
    from .torch_state import find_torch_files

    torch_files = find_torch_files(d)
    dcp_dir = find_dcp(d)
    if torch_files and dcp_dir is not None:
        raise InputError(f"holds both torch files ({', '.join(torch_files[:3])}) and a DCP checkpoint "
                         f"({dcp_dir.relative_to(d) if dcp_dir != d else '.metadata'}); pass the one to read",
                         rule="ambiguous-weights", path=str(d))
    return "torch" if torch_files else "dcp" if dcp_dir is not None else None


def read_weights(d: Path, confine: Confine, read_index: ReadIndex, *, only: str | None = None,
                 kind: str | None = None) -> WeightSet:
    """Read the draft weights in directory ``d`` (or its file ``only``) with the reader ``kind`` or the detected one.

    ``confine`` and ``read_index`` come from the checkpoint layer: the same rules for file names and
    index files as for safetensors checkpoints.
    """
    if only is not None:
        kind = kind or "torch"
    elif kind is None:
        kind = detect(d)
    if kind == "torch":
        from .torch_state import read_torch

        return read_torch(d, confine, read_index, only=only)
    if kind == "dcp":
        from .dcp import read_dcp

        return read_dcp(d, confine)
    if kind is None:
        raise InputError("no safetensors, torch (.bin/.pt/.pth) or DCP (.metadata) weights found", rule="no-weights",
                         path=str(d))
    raise InputError(f"unknown reader {kind!r} (known: {', '.join(READERS)})", rule="no-weights", path=str(d))


__all__ = ["READERS", "TORCH_SUFFIXES", "Confine", "ReadIndex", "WeightSet", "detect", "read_weights"]
