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

from . import dcp, memory, safetensors, torch_state
from .base import TORCH_SUFFIXES, Confine, ReadIndex, WeightSet
from .registry import READERS, Reader, detect, for_file, for_object, read_weights, register, unregister

for _builtin in (safetensors, torch_state, dcp, memory):  # the order detection asks them
    register(_builtin.READER)

__all__ = ["READERS", "TORCH_SUFFIXES", "Confine", "ReadIndex", "Reader", "WeightSet", "detect", "for_file",
           "for_object", "read_weights", "register", "unregister"]
