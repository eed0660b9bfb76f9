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

Each format is a ``Reader`` in the registry (``registry``): name -> how it detects its weights, how it
reads them. The built-in ones are registered below, in the order detection asks them: safetensors
first (the native format, which the checkpoint layer opens itself), then torch, DCP, and the in-memory
mapping. A new format is one module with its ``Reader``, passed to ``register``.

Nothing here runs plain pickle: torch files go through ``torch.load(weights_only=True)`` and DCP's
``.metadata`` through an unpickler that knows only DCP's metadata classes.
"""

from __future__ import annotations

from . import dcp, memory, safetensors, torch_state
from .base import TORCH_SUFFIXES, Confine, ReadIndex, WeightSet
from .registry import READERS, Reader, detect, for_file, for_object, read_weights, register, unregister

for _builtin in (safetensors, torch_state, dcp, memory):  # the order detection asks them
    register(_builtin.READER)

__all__ = ["READERS", "TORCH_SUFFIXES", "Confine", "ReadIndex", "Reader", "WeightSet", "detect", "for_file",
           "for_object", "read_weights", "register", "unregister"]
