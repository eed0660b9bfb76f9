"""Planning the dequantization of one stored module: a streaming Compute recipe (``dequant_module``).

The weight is read band by band through its recipe; scales, global scales and zero points (small)
are read whole. Memory stays at one band of the weight plus its scales, whatever the size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...dtypes import DTYPES
from ...errors import PlanError
from ...stream.plan import Compute, CopyBytes, OutputTensor, copy_of
from ..expr import ExprError, evaluate
from .storage import Storage
from .tables import get_scheme, loaded_schemes

if TYPE_CHECKING:
    from .schema import FormatDef


def format_of(storage: Storage) -> FormatDef:
    table = get_scheme(storage.scheme or "")
    return next(f for f in table.storage if f.name == storage.format)


# (format, shape, params) -> (format definition, tile), for the tables in force: a release's 46,000 modules
# come in a handful of shapes, each evaluated once
_ALIKE: dict[tuple, tuple[FormatDef, tuple[int, int]]] = {}
_ALIKE_TABLES: list[object] = [None]


def _format_and_tile(storage: Storage, shape: tuple[int, ...],
                     tables: dict | None = None) -> tuple[FormatDef, tuple[int, int]]:
    tables = tables if tables is not None else loaded_schemes()
    if _ALIKE_TABLES[0] is not tables or len(_ALIKE) > 1024:
        _ALIKE.clear()
        _ALIKE_TABLES[0] = tables
    key = (storage.scheme, storage.format, shape, repr(sorted(storage.params.items())))
    hit = _ALIKE.get(key)
    if hit is None:
        fmt = format_of(storage)
        hit = _ALIKE[key] = (fmt, tile_of(fmt, shape, dict(storage.params)))
    return hit


def tile_of(fmt: FormatDef, shape: tuple[int, ...], params: dict[str, Any]) -> tuple[int, int]:
    rows, cols = shape[-2:]
    try:
        tile = evaluate(fmt.decoder.scale.granularity, {**params, "rows": rows, "cols": cols})
    except ExprError as e:
        raise PlanError(f"scale granularity: {e}", rule="dequant") from None
    if not (isinstance(tile, (list, tuple)) and len(tile) == 2 and all(isinstance(x, int) and x > 0 for x in tile)):
        raise PlanError(f"scale granularity {fmt.decoder.scale.granularity!r} gave {tile!r}", rule="dequant")
    return min(int(tile[0]), max(rows, 1)), min(int(tile[1]), max(cols, 1))


def stored_tensors(ckpt: Any, storage: Storage) -> dict[str, OutputTensor]:
    """Byte copies of every tensor the module is stored as, by suffix (weight included)."""
    return {suffix: copy_of(ckpt.tensors[key]) for suffix, key in storage.tensors.items()}


def dequant_parts(key: str, parts: dict[str, OutputTensor], storage: Storage, out_dtype: str) -> OutputTensor:
    """``key`` (the unquantized weight's name) as ``out_dtype`` values, from the module's stored ``parts``.

    Nothing numeric is imported until the tensor is produced: planning (and ``--dry-run``) needs no numpy."""
    _require_complete(storage)
    shape = tuple(storage.shape or ())
    fmt, tile = _format_and_tile(storage, shape)
    inputs = [i for t in parts.values() for i in (t.recipe.inputs if isinstance(t.recipe, Compute)
                                                   else t.meta.get("source", [t.key]))]
    recipe = DequantRecipe(key, storage, fmt, tile, out_dtype, inputs, sum(t.nbytes for t in parts.values()),
                           all(isinstance(t.recipe, CopyBytes) for t in parts.values()), parts=parts)
    return OutputTensor(key, out_dtype, shape, recipe, parts[fmt.weight.suffix].shard, recipe.meta())


def dequant_module(ckpt: Any, storage: Storage, key: str, out_dtype: str, tables: dict | None = None,
                   finite: bool = True) -> OutputTensor:
    """``dequant_parts`` over the module's tensors as the checkpoint stores them (byte copies, made when the
    tensor is produced: a release's plan holds 46,000 of these). ``tables``: ``loaded_schemes()``, when the caller
    plans many modules. ``finite``: a NaN / Inf value is refused (False: kept, ``diff`` counts them)."""
    _require_complete(storage)
    shape = tuple(storage.shape or ())
    fmt, tile = _format_and_tile(storage, shape, tables)
    inputs = list(storage.tensors.values())
    recipe = DequantRecipe(key, storage, fmt, tile, out_dtype, inputs, sum(ckpt.tensors[k].nbytes for k in inputs),
                           True, ckpt=ckpt)
    recipe.finite = finite
    return OutputTensor(key, out_dtype, shape, recipe, None, recipe.meta())


def checkpoint_lookup(ckpt: Any) -> Any:
    """``storage.storage_lookup`` of the scheme ``ckpt`` declares (None when no table describes it: its own rule
    says so)."""
    from ...errors import InputError
    from .detect import detect_scheme
    from .storage import storage_lookup

    try:
        return storage_lookup(detect_scheme(ckpt))
    except InputError:
        return storage_lookup(None)


def weight_storage(ckpt: Any, key: str, codec: Any, lookup: Any) -> Storage | None:
    """How stored tensor ``key`` is stored when it is the weight of a quantized module whose companions are all there
    (any scheme table's format; a stacked experts tensor in ``codec``'s, the checkpoint's), else None.
    ``lookup``: ``checkpoint_lookup(ckpt)``."""
    from ...dtypes import FLOAT_DTYPES

    ref = ckpt.tensors[key]
    if ref.dtype in FLOAT_DTYPES or "." not in key:
        return None
    st = lookup(ckpt, key.rsplit(".", 1)[0])
    if not (st.quantized and st.all_keys()[0] == key) and codec.scaled(key, ckpt.tensors):
        st = codec.storage(key, tuple(ref.shape), ckpt.tensors)
    return st if st.quantized and st.all_keys()[0] == key and st.complete and not st.issues else None


def values_of(ckpt: Any, key: str, codec: Any, lookup: Any) -> OutputTensor | None:
    """The float32 values of ``key`` when ``weight_storage`` knows it (NaN / Inf kept), else None: what
    ``diff --dequant`` compares."""
    st = weight_storage(ckpt, key, codec, lookup)
    return None if st is None else dequant_module(ckpt, st, key, "F32", finite=False)


def _require_complete(storage: Storage) -> None:
    if not storage.complete:
        raise PlanError(f"{storage.module}: cannot dequantize {storage.label}: "
                        + "; ".join([f"missing {k}" for k in storage.missing] + list(storage.problems)),
                        rule="dequant")
    if storage.issues:  # its consumers read it otherwise (or refuse it): no decode would be theirs
        rule, text = storage.issues[0]
        raise PlanError(f"{storage.module}: cannot dequantize {storage.label}: {text}", rule=rule)


class DequantRecipe(Compute):
    """The Compute recipe of one dequantized module: its stored parts (``parts``, or byte copies of ``ckpt``'s
    tensors made when produced) decoded band by band into ``out_dtype``."""

    def __init__(self, key: str, storage: Storage, fmt: FormatDef, tile: tuple[int, int], out_dtype: str,
                 inputs: list[str], read_bytes: int, ahead: bool, *, parts: dict[str, OutputTensor] | None = None,
                 ckpt: Any = None) -> None:
        self.key = key  # the output tensor's name
        self.op = "dequant"
        self.inputs = inputs
        self.read_bytes = read_bytes
        self.ahead = ahead
        self.storage, self.fmt, self.tile, self.out_dtype = storage, fmt, tile, out_dtype
        self._parts, self._ckpt = parts, ckpt
        self.finite = True  # NaN / Inf values refused (finite.finite_bands)

    @property
    def detail(self) -> dict:  # type: ignore[override]
        return {"from": self.storage.label, "to": self.out_dtype, "tile": list(self.tile)}

    def meta(self) -> dict:
        st = self.storage
        return {"source": self.inputs, "dequantized_from": {"scheme": st.scheme, "format": st.format,
                                                            "label": st.label, "tensors": sorted(st.tensors)}}

    def produce(self):  # type: ignore[override]
        from ...arrays import bytes_to_numpy
        from ...numeric.transforms import RecipeReader, recipe_bytes
        from . import decode
        from .finite import finite_bands  # numpy: imported when a tensor is produced, never while planning

        parts = self._parts if self._parts is not None else stored_tensors(self._ckpt, self.storage)
        dspec, shape, tile = self.fmt.decoder, tuple(self.storage.shape or ()), self.tile
        weight = parts[self.fmt.weight.suffix]

        def read(t: OutputTensor):
            return bytes_to_numpy(bytearray(b"".join(recipe_bytes(t.recipe, max(t.nbytes, 1)))), t.dtype, t.shape)

        d = decode.Decoding(dspec, weight.dtype, shape, weight.shape[-1],
                            DTYPES[weight.dtype].nbytes(weight.shape[-1]), tile, self.out_dtype)
        sc = parts[dspec.scale.tensor]
        scale = decode.scale_values(read(sc), sc.dtype, dspec.scale.encoding, dspec.scale.e8m0_top)
        g = None
        if dspec.global_scale is not None:
            gt = parts[dspec.global_scale.tensor]
            g = decode.scale_values(read(gt), gt.dtype)
        zp = None
        if dspec.zero_point is not None and dspec.zero_point.tensor in parts:
            zt = parts[dspec.zero_point.tensor]
            zp = decode.zero_point_values(read(zt), zt.dtype, dspec.bits, dspec.offset, dspec.zero_point.packed,
                                          -(-shape[-2] // tile[0]))
        dec = decode.BandDecoder(d, scale, g, zp)
        bands = decode.decode_stream(RecipeReader(weight.recipe).read, dec, _filler(weight.recipe))
        yield from finite_bands(bands, self.key, shape, self.out_dtype, f"{self.storage.module} ({self.storage.label})",
                                _file_of(weight), dec.vouches_finite) if self.finite else bands

def _filler(recipe: Any) -> Callable[[memoryview], bool] | None:
    """Reads a byte copy's segments straight into a buffer (False: they are not that many bytes); None for a
    computed recipe."""
    if not isinstance(recipe, CopyBytes):
        return None

    def fill(buf: memoryview) -> bool:
        if recipe.nbytes != len(buf):
            return False
        at = 0
        for seg in recipe.segments:
            seg.source.readinto(seg.offset, buf[at:at + seg.length])
            at += seg.length
        return True

    return fill


def _file_of(t: OutputTensor) -> str | None:
    """The file a byte-copied tensor is read from (for the message), else None."""
    segs = getattr(t.recipe, "segments", None)
    return segs[0].source.name if segs else None


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


def decode_block_array(fmt: Any, weight: Any, scale: Any, block: tuple[int, int], weight_dtype: str,
                       scale_dtype: str, out_dtype: str, what: str | None = None) -> Any:
    """One whole block-format weight held in memory (numpy storage views: ``weight`` [..., rows, cols] of
    ``weight_dtype``, ``scale`` its ``block`` grid of ``scale_dtype``) -> values in ``out_dtype`` storage,
    by the format's decoder (``decode.decode_array``): what expert restacking dequantizes piece by piece."""
    import numpy as np

    from . import decode
    from .finite import finite_bands

    spec = next(f for f in get_scheme(fmt.scheme).storage if f.name == fmt.format).decoder
    shape = tuple(weight.shape)
    d = decode.Decoding(spec, weight_dtype, shape, shape[-1], DTYPES[weight_dtype].nbytes(shape[-1]),
                        (int(block[0]), int(block[1])), out_dtype)
    values = decode.scale_values(np.ascontiguousarray(scale), scale_dtype, spec.scale.encoding, spec.scale.e8m0_top)
    out = decode.decode_array(d, weight, values)
    for _ in finite_bands([out], what or "an expert weight", shape, out_dtype, f"{fmt.format} codes"):
        pass
    return out
