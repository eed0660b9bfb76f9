"""Draft readers: weights that are not safetensors, seen as the tensor references a Checkpoint holds.

Trainers save drafts as torch state dicts (``pytorch_model.bin``, ``*.pt``, ``*.pth``, sharded too;
``torch_state``) or torch distributed checkpoints (DCP; ``dcp``). A reader turns either into a
``WeightSet``: per input file a ``TensorFile`` (a ByteSource whose address space holds the file's
tensors end to end, as safetensors would store them) and a ``TensorRef`` per tensor, so every recipe
reads them like a safetensors shard. A contiguous tensor is a byte range of its file; only the rest is
loaded when first read, into a small bounded cache.

Each format is a ``Reader`` in the registry (``registry``), asked in order: safetensors, torch, DCP,
the in-memory mapping. A new format is one module with its ``Reader``, passed to ``register``.
Nothing here runs plain pickle: ``torch.load(weights_only=True)``, and DCP's ``.metadata`` through an
unpickler that knows only DCP's metadata classes.
"""

from __future__ import annotations

from types import ModuleType

from . import memory, safetensors
from .base import DCP_METADATA, TORCH_SUFFIXES, Confine, ReadIndex, WeightSet
from .registry import READERS, Reader, detect, for_file, for_object, read_weights, register, unregister


# The torch and DCP readers are imported when first asked (pickle, zipfile: ~10 ms of every command's start)
def _torch() -> ModuleType:
    from . import torch_state

    return torch_state


def _dcp() -> ModuleType:
    from . import dcp

    return dcp


for _builtin in (  # the order detection asks them
    safetensors.READER,
    Reader("torch", "torch (.bin/.pt/.pth)", detect=lambda d: _torch().detect(d), suffixes=TORCH_SUFFIXES,
           read=lambda d, confine, read_index, only: _torch().read_torch(d, confine, read_index, only=only)),
    Reader("dcp", f"DCP ({DCP_METADATA})", detect=lambda d: _dcp().detect(d),
           read=lambda d, confine, read_index, only: _dcp().read_dcp(d, confine)),
    memory.READER,
):
    register(_builtin)

__all__ = ["READERS", "TORCH_SUFFIXES", "Confine", "ReadIndex", "Reader", "WeightSet", "detect", "for_file",
           "for_object", "read_weights", "register", "unregister"]
