"""Planning the encoding of one module's float values into its storage format (``encode_module``).

The inverse of ``dequant.dequant_parts``: the values (any recipe) are read once, encoded by the
format's encoder (``encode.ENCODERS``, named in the scheme table) and served as one tensor per
stored suffix, in the dtypes and shapes the reference storage (the verifier's) has. One shared
computation serves every output (weight, scale, global scale): the first recipe the writer runs
encodes, the others take their part; it is dropped once each has been served.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ...dtypes import DTYPES
from ...errors import PlanError
from ...stream.plan import Compute, CopyBytes, OutputTensor
from .dequant import format_of
from .encode import EncodeArgs, encode_matrices, get_encoder
from .storage import Storage

OP = "quantize"  # a torch recipe (numeric.transforms.TORCH_OPS): one torch thread setting for the run


def encodable(storage: Storage) -> str | None:
    """The encoder name the module's storage format declares, or None."""
    if not storage.quantized or not storage.scheme:
        return None
    return format_of(storage).encoder


def encode_module(values: OutputTensor, storage: Storage, refs: Mapping[str, Any], model_dtype: str
                  ) -> dict[str, OutputTensor]:
    """``values`` (the logical weight, float) encoded as ``storage`` holds the module: {stored key: tensor}
    for the weight and each scale the encoder writes; activation scales are the reference's bytes.
    ``refs``: the reference checkpoint's tensors, whose dtypes and shapes the outputs take."""
    name = encodable(storage)
    if name is None:
        raise PlanError(f"{storage.module}: {storage.label} has no encoder", rule="quant-encode")
    enc = get_encoder(name)
    dtypes = {suffix: refs[key].dtype for suffix, key in storage.tensors.items()}
    args = EncodeArgs(dict(storage.params), dtypes, model_dtype)
    shared = _Shared(values, enc, args)
    out: dict[str, OutputTensor] = {}
    wanted = shared.suffixes(format_of(storage))
    for suffix, key in storage.tensors.items():
        ref = refs[key]
        if suffix not in wanted:  # an activation scale: calibrated on inputs, kept as the reference stores it
            out[key] = OutputTensor(key, ref.dtype, tuple(ref.shape), CopyBytes([ref.segment()]), values.shard,
                                    {"source": [f"verifier:{key}"], "role": "scale", "kept": "activation scale"})
            continue

        def produce(suffix: str = suffix, key: str = key, ref: Any = ref):
            t = shared.take(suffix)
            if t.dtype != _torch(ref.dtype) or t.numel() != ref.numel:
                raise PlanError(f"{key}: the {name} encoder wrote {t.dtype} {list(t.shape)}; the stored tensor is "
                                f"{ref.dtype} {list(ref.shape)}", rule="quant-encode")
            yield t.contiguous().reshape(tuple(ref.shape))

        detail = {"encoder": name, "to": storage.label}
        meta = {"source": _inputs(values), "quant": storage.label}
        if suffix != format_of(storage).weight.suffix:
            meta["role"] = "scale"
        out[key] = OutputTensor(key, ref.dtype, tuple(ref.shape), Compute(produce, OP, _inputs(values), detail),
                                values.shard, meta)
    return out


def _torch(dtype: str):
    from ...dtypes import torch_dtype

    return torch_dtype(dtype)


def _inputs(t: OutputTensor) -> list[str]:
    r = t.recipe
    if isinstance(r, Compute):
        return list(r.inputs)
    return list(t.meta.get("source", [])) or [t.key]


class _Shared:
    """One encoding of ``values``, computed by whichever output recipe runs first."""

    def __init__(self, values: OutputTensor, enc, args: EncodeArgs) -> None:
        self.values, self.enc, self.args = values, enc, args
        self._lock = threading.Lock()
        self._out: dict[str, Any] | None = None
        self._served: set[str] = set()
        self._wanted: set[str] | None = None

    def suffixes(self, fmt) -> set[str]:
        # the weight and every companion except activation scales (calibrated, not a function of the weight)
        wanted = {fmt.weight.suffix} | {t.suffix for t in fmt.tensors if t.role in ("scale", "global_scale")}
        self._wanted = wanted
        return wanted

    def take(self, suffix: str):
        with self._lock:
            if self._out is None:
                self._out = self._encode()
            t = self._out[suffix]
            self._served.add(suffix)
            if self._wanted is not None and self._served >= self._wanted:
                self._out, self._served = None, set()  # every output has its bytes: nothing asks again this run
            return t

    def _encode(self) -> dict[str, Any]:
        from ...arrays import bytes_to_torch, torch_threads
        from ...numeric.transforms import recipe_bytes

        v = self.values
        buf = bytearray(b"".join(recipe_bytes(v.recipe, max(v.nbytes, 1))))
        if len(buf) != DTYPES[v.dtype].nbytes(1) * _numel(v.shape):
            raise PlanError(f"{v.key}: read {len(buf)} bytes of values", rule="quant-encode")
        x = bytes_to_torch(buf, v.dtype, tuple(v.shape))
        with torch_threads(load=True):
            return encode_matrices(self.enc, x, self.args)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
