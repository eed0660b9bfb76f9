"""Drafts straight from memory: a ``{name: torch.Tensor}`` mapping (a trainer's state dict) as a WeightSet.

Nothing is copied when the mapping is opened: each tensor becomes a part of one ``TensorFile`` whose
bytes are the tensors' C-order bytes end to end, read on demand with ``read_c_order`` - a byte range of
a contiguous CPU tensor is a view, a strided tensor is made contiguous a piece at a time, and a GPU
tensor has only the bytes asked for copied to the CPU (then dropped). Every recipe then reads the
mapping like a safetensors shard, and memory stays bounded as for a file.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import InputError
from .base import Tensor, TensorCache, WeightSet, build_weight_set, read_c_order, tensor_nbytes
from .registry import Reader

NAME = "memory"
ROOT = "<in-memory state dict>"  # how messages and reports name a mapping (it has no path)
FILE = "state_dict"  # the one "file" the mapping's tensors lie in


class MemoryTensor:
    """One tensor of the mapping, read where it lies (``Part``)."""

    def __init__(self, tensor: object, nbytes: int) -> None:
        self.tensor = tensor
        self.nbytes = nbytes

    def readinto(self, offset: int, buf: memoryview) -> None:
        read_c_order(self.tensor, offset, buf)


def read_memory(state: Mapping[object, object]) -> WeightSet:
    """Every tensor of ``state``, in its order; InputError naming the key for anything that is not a dense
    tensor under a str key (or that safetensors cannot store)."""
    import torch

    from .torch_state import check_tensor

    found: list[Tensor] = []
    for key, value in state.items():
        if not isinstance(key, str):
            raise InputError(f"key {key!r:.80} is a {type(key).__name__}, not a str", rule="not-a-state-dict",
                             path=ROOT, key=repr(key)[:80])
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{key!r} is a {type(value).__name__}, not a torch.Tensor", rule="not-a-state-dict",
                             path=ROOT, key=key)
        dtype = check_tensor(value, key, ROOT)
        if value.is_meta:
            raise InputError(f"tensor {key!r} is on the meta device: it holds no values", rule="unsupported-tensor",
                             path=ROOT, key=key)
        shape = tuple(value.shape)
        # detach: a view without autograd (a parameter's bytes cannot be read through numpy otherwise)
        found.append(Tensor(key, dtype, shape, MemoryTensor(value.detach(), tensor_nbytes(dtype, shape))))
    if not found:
        raise InputError("the state dict holds no tensors", rule="no-weights", path=ROOT)
    return build_weight_set(NAME, {FILE: found}, {}, TensorCache(0), [])


READER = Reader(NAME, "in-memory state dict", accepts=lambda obj: isinstance(obj, Mapping),
                read_object=read_memory, display=ROOT)
