"""Planning the dequantization of one stored module: a streaming Compute recipe (``dequant_module``).

The weight is read band by band through its recipe; scales, global scales and zero points (small)
are read whole. Memory stays at one band of the weight plus its scales, whatever the size.
"""

from __future__ import annotations

from typing import Any

from ...dtypes import DTYPES
from ...errors import PlanError
from ...stream.plan import Compute, CopyBytes, OutputTensor
from ..expr import ExprError, evaluate
from .finite import finite_bands
from .schema import FormatDef
from .storage import Storage
from .tables import get_scheme


def format_of(storage: Storage) -> FormatDef:
    table = get_scheme(storage.scheme or "")
    return next(f for f in table.storage if f.name == storage.format)


def tile_of(fmt: FormatDef, shape: tuple[int, ...], params: dict[str, Any]) -> tuple[int, int]:
    rows, cols = shape[-2:]
    try:
        tile = evaluate(fmt.decoder.scale.granularity, {**params, "rows": rows, "cols": cols})
    except ExprError as e:
        raise PlanError(f"scale granularity: {e}", rule="dequant") from None
    if not (isinstance(tile, (list, tuple)) and len(tile) == 2 and all(isinstance(x, int) and x > 0 for x in tile)):
        raise PlanError(f"scale granularity {fmt.decoder.scale.granularity!r} gave {tile!r}", rule="dequant")
    return min(int(tile[0]), max(rows, 1)), min(int(tile[1]), max(cols, 1))


def copy_of(ref: Any, key: str | None = None, meta: dict | None = None) -> OutputTensor:
    return OutputTensor(key or ref.key, ref.dtype, tuple(ref.shape), CopyBytes([ref.segment()]),
                        meta=dict(meta or {"source": [ref.key]}))


def stored_tensors(ckpt: Any, storage: Storage) -> dict[str, OutputTensor]:
    """Byte copies of every tensor the module is stored as, by suffix (weight included)."""
    return {suffix: copy_of(ckpt.tensors[key]) for suffix, key in storage.tensors.items()}


def dequant_parts(key: str, parts: dict[str, OutputTensor], storage: Storage, out_dtype: str) -> OutputTensor:
    """``key`` (the unquantized weight's name) as ``out_dtype`` values, from the module's stored ``parts``."""
    from ...arrays import bytes_to_numpy
    from ...numeric.transforms import RecipeReader, recipe_bytes
    from . import decode

    if not storage.complete:
        raise PlanError(f"{storage.module}: cannot dequantize {storage.label}: "
                        + "; ".join([f"missing {k}" for k in storage.missing] + list(storage.problems)),
                        rule="dequant")
    fmt = format_of(storage)
    dspec = fmt.decoder
    weight = parts[fmt.weight.suffix]
    shape = tuple(storage.shape or ())
    tile = tile_of(fmt, shape, dict(storage.params))
    d = decode.Decoding(dspec, weight.dtype, shape, weight.shape[-1], DTYPES[weight.dtype].nbytes(weight.shape[-1]),
                        tile, out_dtype)
    small = {s: parts[s] for s in (dspec.scale.tensor, dspec.global_scale and dspec.global_scale.tensor,
                                   dspec.zero_point and dspec.zero_point.tensor) if s and s in parts}

    def read(t: OutputTensor):
        return bytes_to_numpy(bytearray(b"".join(recipe_bytes(t.recipe, max(t.nbytes, 1)))), t.dtype, t.shape)

    def produce():
        sc = small[dspec.scale.tensor]
        scale = decode.scale_values(read(sc), sc.dtype, dspec.scale.encoding, dspec.scale.e8m0_top)
        g = None
        if dspec.global_scale is not None:
            gt = small[dspec.global_scale.tensor]
            g = decode.scale_values(read(gt), gt.dtype)
        zp = None
        if dspec.zero_point is not None and dspec.zero_point.tensor in small:
            zt = small[dspec.zero_point.tensor]
            zp = decode.zero_point_values(read(zt), zt.dtype, dspec.bits, dspec.offset, dspec.zero_point.packed,
                                          -(-shape[-2] // tile[0]))
        dec = decode.BandDecoder(d, scale, g, zp)
        yield from finite_bands(decode.decode_stream(RecipeReader(weight.recipe).read, dec), key, shape, out_dtype,
                                f"{storage.module} ({storage.label})", _file_of(weight))

    inputs = [i for t in parts.values() for i in (t.recipe.inputs if isinstance(t.recipe, Compute)
                                                   else t.meta.get("source", [t.key]))]
    meta = {"source": inputs, "dequantized_from": {"scheme": storage.scheme, "format": storage.format,
                                                   "label": storage.label, "tensors": sorted(storage.tensors)}}
    detail = {"from": storage.label, "to": out_dtype, "tile": list(tile)}
    return OutputTensor(key, out_dtype, shape, Compute(produce, "dequant", inputs, detail,
                                                       read_bytes=sum(t.nbytes for t in parts.values()),
                                                       ahead=all(isinstance(t.recipe, CopyBytes)
                                                                 for t in parts.values())),
                        weight.shard, meta)


def _file_of(t: OutputTensor) -> str | None:
    """The file a byte-copied tensor is read from (for the message), else None."""
    segs = getattr(t.recipe, "segments", None)
    return segs[0].source.name if segs else None


def dequant_module(ckpt: Any, storage: Storage, key: str, out_dtype: str) -> OutputTensor:
    """``dequant_parts`` over the module's tensors as the checkpoint stores them."""
    return dequant_parts(key, stored_tensors(ckpt, storage), storage, out_dtype)


def module_outputs(ckpt: Any, storage: Storage, draft_key: str, dequant_to: str | None,
                   meta: dict) -> list[OutputTensor]:
    """A quantized module's tensors under the draft's name ``draft_key`` (its logical ``.weight`` key):
    one tensor of ``dequant_to`` values, or (None) every stored tensor as its bytes, renamed."""
    if dequant_to is not None:
        t = dequant_module(ckpt, storage, draft_key, dequant_to)
        t.meta.update({k: v for k, v in meta.items() if k != "source"})
        return [t]
    head = draft_key.removesuffix(".weight")
    out = []
    for suffix, key in storage.tensors.items():
        role = "weight" if key == f"{storage.module}.weight" or suffix == format_of(storage).weight.suffix else "scale"
        extra = dict(meta) if role == "weight" else {"role": "scale"}
        out.append(copy_of(ckpt.tensors[key], f"{head}.{suffix}", {**extra, "source": [key], "quant": storage.label}))
    return out


def decode_block(fmt: Any, w: OutputTensor, scale: OutputTensor, out_dtype: str) -> OutputTensor:
    """A block format's weight ``w`` (any recipe: a byte copy, an expert slice, a restack) times its
    ``scale`` companion, as ``out_dtype``: ``dequant_parts`` over the two, with ``w``'s meta kept.

    ``fmt``: a companions.WeightFormat. The same checks (and messages) as the block-FP8 recipes had.
    """
    from ...dtypes import SCALE_DTYPES
    from ...numeric.fp8_decode import OUT_DTYPES, check_grid
    from .storage import Storage

    if not fmt.stores(w.dtype) or len(w.shape) < 2:
        raise PlanError(f"{w.key} is {w.dtype} {list(w.shape)}, not an FP8 matrix", rule="dequant")
    if out_dtype not in OUT_DTYPES:
        raise PlanError(f"{w.key}: cannot dequantize to {out_dtype}; use one of {', '.join(OUT_DTYPES)}",
                        rule="dequant-dtype")
    if scale.dtype not in SCALE_DTYPES:
        raise PlanError(f"{scale.key} (block scale of {w.key}) is {scale.dtype}; a block scale is one of "
                        f"{', '.join(SCALE_DTYPES)}", rule="fp8-scale-dtype")
    check_grid(w.shape, scale.shape, fmt.block, f"{scale.key} of {w.key}: ")
    module = w.key.removesuffix(".weight")
    storage = Storage(module, "quantized", w.dtype, fmt.scheme, fmt.format, w.dtype,
                      {"weight": w.key, fmt.scale_suffix: scale.key}, shape=tuple(w.shape),
                      params={"block": list(fmt.block)})
    t = dequant_parts(w.key, {"weight": w, fmt.scale_suffix: scale}, storage, out_dtype)
    t.shard = w.shard
    t.meta = {**w.meta, "dequantized_from": {"dtype": w.dtype, "scale": scale.key, "block": list(fmt.block)}}
    return t


def decode_block_array(fmt: Any, weight: Any, scale: Any, block: tuple[int, int], weight_dtype: str,
                       scale_dtype: str, out_dtype: str, what: str | None = None) -> Any:
    """One whole block-format weight held in memory (numpy storage views: ``weight`` [..., rows, cols] of
    ``weight_dtype``, ``scale`` its ``block`` grid of ``scale_dtype``) -> values in ``out_dtype`` storage,
    by the format's decoder (``decode.decode_array``): what expert restacking dequantizes piece by piece."""
    import numpy as np

    from . import decode

    spec = next(f for f in get_scheme(fmt.scheme).storage if f.name == fmt.format).decoder
    shape = tuple(weight.shape)
    d = decode.Decoding(spec, weight_dtype, shape, shape[-1], DTYPES[weight_dtype].nbytes(shape[-1]),
                        (int(block[0]), int(block[1])), out_dtype)
    values = decode.scale_values(np.ascontiguousarray(scale), scale_dtype, spec.scale.encoding, spec.scale.e8m0_top)
    out = decode.decode_array(d, weight, values)
    for _ in finite_bands([out], what or "an expert weight", shape, out_dtype, f"{fmt.format} codes"):
        pass
    return out
