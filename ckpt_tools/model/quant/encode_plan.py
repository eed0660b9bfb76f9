"""Planning the encoding of one module's float values into its storage format (``encode_module``).

The inverse of ``dequant.dequant_parts``: the values (any recipe) are read once, encoded by the
format's codec (``codec.CODECS``, named in the scheme table) and served as one tensor per
stored suffix, in the dtypes and shapes the reference storage (the verifier's) has. One shared
computation serves every output (weight, scale, global scale): the first recipe the writer runs
encodes, the others take their part; it is dropped once each has been served.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ...dtypes import DTYPES, torch_dtype
from ...errors import PlanError
from ...numeric.transforms import inputs_of
from ...stream.plan import Compute, OutputTensor, copy_of
from .codec import get_codec, layout_of
from .dequant import format_of
from .encode import encode_matrices
from .encode_core import EncodeArgs
from .storage import Storage

OP = "quantize"  # a torch recipe (numeric.transforms.TORCH_OPS): one torch thread setting for the run


def encodable(storage: Storage, model_dtype: str | None = None, refs: Mapping[str, Any] | None = None) -> str | None:
    """The encoder name the module's storage format declares, or None; with ``refs`` (the stored tensors),
    only when that encoder writes the dtypes and sizes they have (a BF16-scaled block FP8 it does not)."""
    if not storage.quantized or not storage.scheme:
        return None
    name = format_of(storage).encoder
    if name is None or refs is None or storage.shape is None:
        return name
    args = EncodeArgs(dict(storage.params), {s: refs[k].dtype for s, k in storage.tensors.items()},
                      model_dtype or "BF16", suffixes=suffixes(storage))
    try:
        layout = layout_of(name, tuple(storage.shape), args)
    except PlanError:
        return None
    ok = all(refs[k].dtype == layout[s][0] and _numel(refs[k].shape) == _numel(layout[s][1])
             for s, k in storage.tensors.items() if s in layout)
    return name if ok else None


class FusedGroups:
    """Shards of the engines' fused layers (a family table's ``fused_modules``: gate/up, q_a/kv_a, ...) being
    encoded in one run: a format whose producer gives them one per-tensor scale (``shared_scale``) takes it
    from the absmax over every shard's values, once each shard has joined (a shard encoded alone keeps its own)."""

    def __init__(self, fused: Mapping[str, Any], model_dtype: str) -> None:
        self.fused, self.model_dtype = fused, model_dtype
        self._members: dict[tuple[str, tuple[str, ...]], dict[str, OutputTensor]] = {}
        self._absmax: dict[tuple[str, tuple[str, ...]], float | None] = {}
        self._weights: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        self._lock = threading.Lock()

    def join(self, module: str, values: OutputTensor, storage: Storage, expert: bool) -> Callable[[], Any] | None:
        rule = format_of(storage).shared_scale
        if rule == "none" or (rule == "experts" and not expert):
            return None
        parent, _, leaf = module.rpartition(".")
        shards = next((tuple(s) for s in self.fused.values() if leaf in s), None)
        if shards is None:
            return None
        group = (parent, shards)
        self._members.setdefault(group, {})[leaf] = values
        self._weights.setdefault(group, []).append(storage.tensors[format_of(storage).weight.suffix])
        return lambda: self.absmax(group)

    def partners(self) -> list[list[str]]:
        """The stored weight keys of every group whose shards all joined (they share one per-tensor scale)."""
        return [self._weights[g] for g, m in self._members.items() if set(m) == set(g[1])]

    def absmax(self, group: tuple[str, tuple[str, ...]]) -> float | None:
        with self._lock:
            if group not in self._absmax:
                members = self._members[group]
                whole = set(members) == set(group[1])
                self._absmax[group] = max(_absmax_of(v, self.model_dtype) for v in members.values()) if whole \
                    else None
            return self._absmax[group]


def _absmax_of(values: OutputTensor, model_dtype: str) -> float:
    """max |v| of the values in the model dtype (exact as a float)."""

    from ...arrays import bytes_to_torch
    from ...numeric.transforms import recipe_bytes

    buf = bytearray(b"".join(recipe_bytes(values.recipe, max(values.nbytes, 1))))
    x = bytes_to_torch(buf, values.dtype, tuple(values.shape)).to(torch_dtype(model_dtype))
    return float(x.abs().max()) if x.numel() else 0.0


def encode_module(values: OutputTensor, storage: Storage, model_dtype: str, refs: Mapping[str, Any] | None = None,
                  group: Callable[[], Any] | None = None) -> dict[str, OutputTensor]:
    """``values`` (the logical weight, float) encoded as ``storage`` holds the module: {stored key: tensor}
    for the weight and each scale the encoder writes. ``refs`` (stitch): the reference checkpoint's tensors;
    the outputs take their dtypes and shapes (one the encoder cannot write is refused) and its activation
    scales are copied. Without them (graft) the outputs are what the encoder writes (``encode.layout_of``).
    ``group``: the fused group's absmax, resolved when the encoding runs (``FusedGroups.join``)."""
    name = encodable(storage)
    if name is None:
        raise PlanError(f"{storage.module}: {storage.label} has no encoder", rule="quant-encode")
    fmt = format_of(storage)
    dtypes = {suffix: refs[key].dtype for suffix, key in storage.tensors.items()} if refs is not None else {}
    args = EncodeArgs(dict(storage.params), dtypes, model_dtype, suffixes=suffixes(storage))
    layout = layout_of(name, tuple(values.shape), args)
    wanted = {fmt.weight.suffix} | {t.suffix for t in fmt.tensors if t.role in ("scale", "global_scale", "shape")}
    streamed = _streamed(name, values, storage, args, layout, wanted)
    shared = _Shared(values, get_codec(name).encode, args, set(layout) & wanted & set(storage.tensors), group)
    out: dict[str, OutputTensor] = {}
    for suffix, key in storage.tensors.items():
        ref = refs[key] if refs is not None else None
        if suffix not in wanted or suffix not in layout:
            if ref is None:
                continue
            # an activation scale: calibrated on inputs, not a function of the weight: the reference's
            out[key] = copy_of(ref, key, {"source": [f"verifier:{key}"], "role": "scale", "kept": "activation scale"},
                               values.shard)
            continue
        dtype, shape = layout[suffix]
        if ref is not None:
            if ref.dtype != dtype or _numel(ref.shape) != _numel(shape):
                raise PlanError(f"{key}: the {name} encoder writes {dtype} {list(shape)}; the verifier stores "
                                f"{ref.dtype} {list(ref.shape)}", rule="quant-encode")
            shape = tuple(ref.shape)

        def produce(suffix: str = suffix, dtype: str = dtype, shape: tuple[int, ...] = shape, key: str = key):
            t = shared.take(suffix)
            if t.dtype != torch_dtype(dtype) or t.numel() != _numel(shape):  # the encoder and its layout disagree
                raise PlanError(f"{key}: the {name} encoder wrote {t.dtype} {list(t.shape)}, its layout says "
                                f"{dtype} {list(shape)}", rule="quant-encode")
            yield t.contiguous().reshape(shape)

        detail = {"encoder": name, "to": storage.label}
        meta: dict[str, Any] = {"source": inputs_of(values), "quant": storage.label}
        if suffix != fmt.weight.suffix:
            meta["role"] = "scale"
        if streamed is not None:  # the encoder's own band-by-band recipes
            t = streamed[suffix]
            out[key] = OutputTensor(key, t.dtype, shape, t.recipe, values.shard, {**t.meta, **meta})
            continue
        out[key] = OutputTensor(key, dtype, shape, Compute(produce, OP, inputs_of(values), detail), values.shard, meta)
    return out


def suffixes(storage: Storage) -> dict[str, str]:
    """role -> suffix of the module's storage format (the table's names for what the encoder writes)."""
    fmt = format_of(storage)
    return {"weight": fmt.weight.suffix, **{t.role: t.suffix for t in fmt.tensors}}


def _streamed(name: str, values: OutputTensor, storage: Storage, args: EncodeArgs, layout: Mapping[str, Any],
              wanted: set[str]) -> dict[str, OutputTensor] | None:
    """The outputs of a codec's streamed encoder, by suffix; None for one that encodes whole matrices."""
    stream = get_codec(name).stream
    if stream is None:
        return None
    keys = {sfx: storage.tensors.get(sfx, f"{storage.module}.{sfx}") for sfx in layout if sfx in wanted}
    return stream(values, args, keys)


class _Shared:
    """One encoding of ``values``, computed by whichever output recipe runs first."""

    def __init__(self, values: OutputTensor, enc, args: EncodeArgs, wanted: set[str], group=None) -> None:
        self.values, self.enc, self.args, self._wanted, self.group = values, enc, args, wanted, group
        self._lock = threading.Lock()
        self._out: dict[str, Any] | None = None
        self._served: set[str] = set()

    def take(self, suffix: str):
        with self._lock:
            if self._out is None:
                self._out = self._encode()
            t = self._out[suffix]
            self._served.add(suffix)
            if self._served >= self._wanted:
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
        args = self.args if self.group is None else replace(self.args, group_absmax=self.group())
        with torch_threads(load=True):
            return encode_matrices(self.enc, x, args)


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)
