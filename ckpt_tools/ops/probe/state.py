"""The tensors probe loads into a model, as float values: stored float tensors as they are, quantized
modules dequantized with our scheme decoders (``model.quant``), each produced only when the loader
asks for it (one tensor at a time, no second copy of the weights).

``float_state(tensors, scheme, dtype)`` maps every stored tensor to the float tensor a model built
without a quantization config expects: a quantized module ``M`` (its ``M.weight`` codes and
companions ``M.weight_scale``, ``M.input_scale``, ...) becomes one ``M.weight``; its companions are
consumed. A tensor that is neither float nor part of a module some decoder reads is refused
(``probe-load``), as is a quantized module with a missing or mis-shaped companion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ...dtypes import FLOAT_DTYPES
from ...errors import InputError, PlanError
from ...stream.plan import OutputTensor

RULE = "probe-load"
TORCH_DTYPES = {"bf16": "BF16", "fp32": "F32"}


@dataclass(frozen=True)
class _Ref:
    """An ``OutputTensor`` seen as the ``TensorRef`` that ``module_storage`` reads (key, dtype, shape, numpy)."""

    t: OutputTensor

    @property
    def key(self) -> str:
        return self.t.key

    @property
    def dtype(self) -> str:
        return self.t.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.t.shape)

    def numpy(self):
        from ...arrays import bytes_to_numpy
        from ...numeric.transforms import RecipeReader

        return bytes_to_numpy(bytearray(RecipeReader(self.t.recipe).read(self.t.nbytes)), self.t.dtype, self.t.shape)


class Lazy:
    """A tensor made when the loader indexes it (``t[...]``, as transformers reads a safetensors slice)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make

    def __getitem__(self, index):
        t = self._make()
        return t if index is Ellipsis else t[index]


def materialize(t: OutputTensor):
    """The tensor's values as a torch tensor of its own dtype."""
    from ...arrays import bytes_to_torch
    from ...numeric.transforms import RecipeReader

    return bytes_to_torch(bytearray(RecipeReader(t.recipe).read(t.nbytes)), t.dtype, t.shape).clone()


def is_quantized(tensors: Mapping[str, OutputTensor]) -> bool:
    """Whether any tensor is stored in a non-float dtype (codes of some quantization scheme)."""
    return any(t.dtype not in FLOAT_DTYPES for t in tensors.values())


def float_state(tensors: Mapping[str, OutputTensor], scheme, dtype: str, where: str | None = None
                ) -> tuple[dict[str, OutputTensor], list[str]]:
    """(key -> float tensor to load, the schemes whose decoders ran): every tensor of ``tensors``.

    ``scheme``: what the checkpoint declares (``detect_scheme``; None: every table is tried on the
    stored dtypes). ``dtype``: bf16 | fp32, what dequantized weights are decoded to.
    """
    from ...model.quant import module_storage
    from ...model.quant.dequant import dequant_parts

    view = SimpleNamespace(tensors={k: _Ref(t) for k, t in tensors.items()})
    out: dict[str, OutputTensor] = {}
    consumed: set[str] = set()
    schemes: list[str] = []
    modules = sorted({k.rpartition(".")[0] for k, t in tensors.items() if t.dtype not in FLOAT_DTYPES})
    for module in modules:
        storage = module_storage(view, scheme, module)
        if not storage.quantized:
            continue
        key = f"{module}.weight"
        try:
            parts = {suffix: tensors[k] for suffix, k in storage.tensors.items()}
            out[key] = dequant_parts(key, parts, storage, TORCH_DTYPES[dtype])
        except PlanError as e:
            raise InputError(f"{module} is stored as {storage.label}, which our decoder cannot read: {e.message}",
                             rule=RULE, path=where, key=key) from None
        consumed.update(storage.tensors.values())
        if storage.scheme and storage.scheme not in schemes:
            schemes.append(storage.scheme)
    undecoded = sorted(k for k, t in tensors.items() if k not in consumed and t.dtype not in FLOAT_DTYPES)
    if undecoded:
        first = ", ".join(f"{k} ({tensors[k].dtype})" for k in undecoded[:3])
        raise InputError(f"{len(undecoded)} tensor(s) are stored in a non-float dtype that no scheme decoder reads "
                         f"(first: {first}); probe measures only a model loaded as stored", rule=RULE, path=where,
                         key=undecoded[0])
    out.update((k, t) for k, t in tensors.items() if k not in consumed)
    return out, schemes
