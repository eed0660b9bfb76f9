"""One codec per scheme: how float values go into a storage format's tensors and come out of them.

``CODECS`` maps a name (what a scheme table's format names as ``encoder:``) to its ``Codec``, as
compressed-tensors registers its compressors by name: ``encode`` (values [rows, cols] -> {suffix: tensor}),
``layout`` (what it writes, known at plan time), ``stream`` (the same with the values read in bands) and its
capabilities: ``restacks`` (one code per element, one scale over a fixed tile, nothing else: experts slice
and restack byte for byte) and ``keeps_bytes`` (the round trip is a fixed point: bytes already in the storage
are kept, not encoded again). ``register_codec`` adds one. Bound to a table's format and a checkpoint's
parameters a codec also knows a weight's companions, decoder and ``Storage``: ``checkpoint_codec`` (the one
a checkpoint's scaled weights use: its storage's, else its declared scheme's, else the family's hint, else
``DEFAULT_SCHEME``) and ``storage_codec`` (any module's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...errors import InputError, PlanError
from ..expert_layouts import scale_key
from . import encode, encode_block, encode_int
from .block import block_tile
from .encode_core import EncodeArgs
from .storage import Storage, holds, scale_grid, zero_point_shapes
from .tables import all_schemes, get_scheme

if TYPE_CHECKING:
    import torch

    from ...stream.plan import OutputTensor
    from .schema import FormatDef, SchemeTable

Encoder = Callable[["torch.Tensor", EncodeArgs], dict[str, "torch.Tensor"]]
# (rows, cols), args -> {suffix: (dtype, shape)}: what the encoder writes, known at plan time
Layout = Callable[[tuple[int, int], EncodeArgs], dict[str, tuple[str, tuple[int, ...]]]]
# values (a planned tensor, any recipe), args, {suffix: output key} -> {suffix: planned tensor}
Stream = Callable[["OutputTensor", EncodeArgs, Mapping[str, str]], dict[str, "OutputTensor"]]


@dataclass(frozen=True)
class Companion:
    """A tensor stored next to a weight: its key, role (scheme-table ``role``) and shape."""

    key: str
    role: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Codec:
    """A storage format's codec; ``scheme`` and the fields after it are set when bound to a table's format."""

    name: str
    encode: Encoder | None = field(default=None, compare=False)
    layout: Layout | None = field(default=None, compare=False)
    stream: Stream | None = field(default=None, compare=False)
    keeps_bytes: bool = False
    scheme: str = ""
    format: str = ""
    weight_dtypes: frozenset[str] = frozenset()
    scale_suffix: str = ""
    scale_dtypes: tuple[str, ...] = ()
    block: tuple[int, int] | None = None  # the fixed scale tile of a format that restacks
    how: str = ""  # "declared" | "stored" | "hint" | "default": where a checkpoint's codec came from
    weight_suffix: str = "weight"
    params: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the table's, as the config declares
    spec: FormatDef | None = field(default=None, compare=False, repr=False)  # the table's format definition

    @property
    def restacks(self) -> bool:
        """Experts in this format slice per expert and restack byte for byte (scales with them)."""
        return self.block is not None

    @property
    def quant_method(self) -> str | None:
        """The ``quant_method`` a configuration declaring this codec's scheme names (its table's first place)."""
        table = get_scheme(self.scheme) if self.scheme else None
        return next((str(v[0]) for d in (table.declared_in if table else ()) for k, v in d.match.items()
                     if k == "quant_method" and v), None)

    def stores(self, dtype: str | None) -> bool:
        """Whether a weight of ``dtype`` is quantized in this format (needs its companions)."""
        return dtype in self.weight_dtypes

    def scaled(self, key: str, tensors: Mapping[str, Any]) -> bool:
        """Whether ``tensors[key]`` is a weight in this format with its scale companion beside it."""
        ref = tensors.get(key)
        return ref is not None and ref.dtype in self.weight_dtypes and self.scale_key(key) in tensors

    def scale_key(self, weight_key: str) -> str:
        """The scale companion of ``weight_key`` (a bare stacked-experts name gets the suffix past ``weight_``)."""
        return scale_key(weight_key, self.scale_suffix)

    def scale_of(self, weight_key: str, shape: tuple[int, ...], tensors: Mapping[str, Any],
                 block: tuple[int, int] | None = None) -> tuple[str, Any, Any]:
        """The block-scale check, written once: (the scale companion's key, the grid a ``shape`` weight [..., out,
        in] has in ``block`` tiles - the codec's own unless a declared one is given; edge tiles partial; None
        for fewer than two dims -, the
        stored scale in ``tensors`` or None). Each caller reports a missing or other-shaped scale by its rule."""
        skey = weight_key[:-6] + self.scale_suffix if weight_key.endswith(".weight") else self.scale_key(weight_key)
        if len(shape) < 2:  # block scales are defined for matrices (and stacks of them) only
            return skey, None, tensors.get(skey)
        *lead, rows, cols = shape
        br, bc = block or self.block or (rows, cols)
        return skey, (*lead, -(-rows // br), -(-cols // bc)), tensors.get(skey)

    def companions(self, weight_key: str, shape: tuple[int, ...]) -> list[Companion]:
        """Every tensor that travels with a quantized ``weight_key`` of logical ``shape``, as its table lists them
        (scale grid, global scale and input scale [] or one per matrix, zero points, ...; optional ones left
        out); a bare stacked-experts name (no module of its own) has its scale alone."""
        if self.spec is None or not weight_key.endswith("." + self.weight_suffix):
            skey, grid, _ = self.scale_of(weight_key, tuple(shape), {})
            return [Companion(skey, "scale", grid)]
        module, grid = weight_key.rsplit(".", 1)[0], scale_grid(self.spec, tuple(shape), self.params)
        shapes = {"scale": grid, "zero_point": zero_point_shapes(self.spec, grid)[0], "shape": (len(shape),)}
        return [Companion(f"{module}.{t.suffix}", t.role, shapes.get(t.role, tuple(shape[:-2])))
                for t in self.spec.tensors if not t.optional and holds(t.when, self.params)]

    def decode(self, w: Any, scale: Any, out_dtype: str) -> Any:
        """``w`` (a planned tensor in this format: a byte copy, an expert slice, a restack) times its ``scale``
        companion as ``out_dtype``: ``dequant.dequant_parts`` over the two, with ``w``'s meta kept."""
        from ...dtypes import SCALE_DTYPES
        from .decode_fp8 import OUT_DTYPES, check_grid
        from .dequant import dequant_parts

        if not self.stores(w.dtype) or len(w.shape) < 2:
            raise PlanError(f"{w.key} is {w.dtype} {list(w.shape)}, not an FP8 matrix", rule="dequant")
        if out_dtype not in OUT_DTYPES:
            raise PlanError(f"{w.key}: cannot dequantize to {out_dtype}; use one of {', '.join(OUT_DTYPES)}",
                            rule="dequant-dtype")
        if scale.dtype not in SCALE_DTYPES:
            raise PlanError(f"{scale.key} (block scale of {w.key}) is {scale.dtype}; a block scale is one of "
                            f"{', '.join(SCALE_DTYPES)}", rule="fp8-scale-dtype")
        check_grid(w.shape, scale.shape, self.block, f"{scale.key} of {w.key}: ")
        module = w.key.removesuffix(".weight")
        storage = Storage(module, "quantized", w.dtype, self.scheme, self.format, w.dtype,
                          {"weight": w.key, self.scale_suffix: scale.key}, shape=tuple(w.shape),
                          params={"block": list(self.block)})
        t = dequant_parts(w.key, {"weight": w, self.scale_suffix: scale}, storage, out_dtype)
        t.shard = w.shard
        t.meta = {**w.meta, "dequantized_from": {"dtype": w.dtype, "scale": scale.key, "block": list(self.block)}}
        return t

    def storage(self, weight_key: str, shape: tuple[int, ...], tensors: Mapping[str, Any]) -> Storage:
        """A weight of this format as a module ``Storage``, for a stacked experts tensor that ``module_storage``
        cannot name: what the encoders and decoders take."""
        skey = self.scale_key(weight_key)
        ref = tensors.get(weight_key)
        return Storage(weight_key.removesuffix(".weight"), "quantized", ref.dtype if ref is not None else None,
                       self.scheme, self.format, f"{self.format} {list(self.block or ())}",
                       {self.weight_suffix: weight_key, self.scale_suffix: skey},
                       () if skey in tensors else (skey,), shape=tuple(shape),
                       params={**self.params, "block": list(self.block or ())})

    def refusal(self, storage: Storage, what: str, them: str = "it") -> str:
        """Why a verb does not ``what`` to a module stored as ``storage`` (in this codec's format): the codec's
        capability, named."""
        return (f"{storage.module} is stored in scheme table {storage.scheme}'s format {storage.format}, whose codec "
                f"({self.name or 'none'}) cannot {what}; `ckpt dequant` {them} first")


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("ct-fp8", encode.ct_fp8, encode.ct_fp8_layout),
    Codec("ct-nvfp4", encode.ct_nvfp4, encode.fp4_layout("weight_global_scale", (1,))),
    Codec("ct-mxfp4", encode.ct_mxfp4, encode.mxfp4_layout),
    Codec("ct-int8", encode_int.ct_int8, encode_int.int8_layout),
    Codec("ct-pack", encode_int.ct_pack, encode_int.pack_layout),
    Codec("modelopt-fp8", encode.modelopt_fp8, encode.modelopt_fp8_layout),
    Codec("modelopt-nvfp4", encode.modelopt_nvfp4, encode.fp4_layout("weight_scale_2", ())),
    Codec("fp8-block", encode_block.encode, encode_block.layout, encode_block.stream, keeps_bytes=True),
)}


def register_codec(name: str, encode: Encoder, layout: Layout, stream: Stream | None = None,
                   keeps_bytes: bool = False) -> Codec:
    """Add codec ``name`` (what a scheme table's ``encoder: name`` writes with) from outside the package:
    ``encode(values [rows, cols] float, EncodeArgs) -> {suffix: tensor}``, ``layout((rows, cols), EncodeArgs)
    -> {suffix: (safetensors dtype, shape)}`` (what ``encode`` writes, known before any value is read), and
    optionally ``stream(values OutputTensor, EncodeArgs, {suffix: key}) -> {suffix: OutputTensor}``, what stitch
    and graft plan with instead (the values read in bands). A name already taken is refused; the scheme tables
    are checked again against the new set on the next ``tables.all_schemes``."""
    if name in CODECS:
        raise ValueError(f"a codec named {name!r} is already registered")
    CODECS[name] = Codec(name, encode, layout, stream, keeps_bytes)
    return CODECS[name]


def unregister_codec(name: str) -> None:
    """Remove codec ``name`` (a table that names it is refused from the next ``tables.all_schemes``)."""
    CODECS.pop(name, None)


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise PlanError(f"no codec {name!r}; known: {', '.join(sorted(CODECS))}", rule="quant-encode")
    return CODECS[name]


def layout_of(name: str, shape: tuple[int, ...], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec ``name`` writes for values of ``shape`` [..., rows, cols] (leading dims stacked)."""
    *lead, rows, cols = shape
    layout = get_codec(name).layout
    assert layout is not None
    return {k: (dt, (*lead, *sh)) for k, (dt, sh) in layout((rows, cols), args).items()}


def scale_suffixes() -> frozenset[str]:
    """Every scale companion suffix of the form ``weight_<x>`` the scheme tables name (``weight_scale``, ...)."""
    return frozenset(t.suffix for table in all_schemes().values() for f in table.storage for t in f.tensors
                     if t.role == "scale" and t.suffix.startswith("weight_"))


DEFAULT_SCHEME = "fp8-block"  # the codec of a checkpoint that declares, stores and hints nothing


def restack_codec(table: SchemeTable, params: Mapping[str, Any] | None = None, how: str = "declared"
                  ) -> Codec | None:
    """The codec of ``table``'s format that restacks, with ``params`` (the table's defaults when None), or None."""
    defaults = {name: p.default for d in table.declared_in for name, p in d.params.items()}
    params = {**defaults, **(params or {})}
    return next((c for c in (_bind(table, f, params, how) for f in table.storage) if c.restacks), None)


def storage_codec(st: Storage) -> Codec:
    """The codec of the format module storage ``st`` is in, bound to it (``restacks`` or not)."""
    table = get_scheme(st.scheme or "")
    return _bind(table, next(f for f in table.storage if f.name == st.format), dict(st.params), "stored")


def _bind(table: SchemeTable, fmt: FormatDef, params: Mapping[str, Any], how: str) -> Codec:
    scale = fmt.decoder.scale.tensor
    return replace(CODECS.get(fmt.encoder or "") or Codec(""), scheme=table.scheme, format=fmt.name,
                weight_dtypes=frozenset(fmt.weight.dtypes), scale_suffix=scale,
                scale_dtypes=next((tuple(t.dtypes) for t in fmt.tensors if t.suffix == scale), ()),
                block=block_tile(fmt, params), how=how, weight_suffix=fmt.weight.suffix, params=dict(params),
                spec=fmt)


def _declared(ckpt: Any) -> Codec | None:
    from .detect import detect_scheme

    try:
        scheme = detect_scheme(ckpt)
    except InputError:  # a scheme no table describes: the verbs that read it say so (module_storage)
        return None
    return next((c for c in (restack_codec(t, scheme.default_params(t)) for t in (scheme.tables if scheme else ()))
                 if c is not None), None)


def _stored(tensors: Mapping[str, Any]) -> Codec | None:
    """The restacking codec whose scale companion sits next to the first FP8 weight that has one (the
    companion's name tells the tables apart: ``weight_scale_inv``, ``scale``)."""
    candidates = [f for f in (restack_codec(t, how="stored") for t in all_schemes().values()) if f is not None]
    dtypes = frozenset().union(*(f.weight_dtypes for f in candidates))  # a tensor of another dtype is none's weight
    return next((f for key, ref in tensors.items() if ref.dtype in dtypes for f in candidates if f.stores(ref.dtype)
                 and getattr(tensors.get(f.scale_key(key)), "dtype", None) in f.scale_dtypes), None)


def config_params(table: SchemeTable, ckpt: Any) -> dict[str, Any] | None:
    """The parameters ``ckpt``'s configuration gives ``table`` where a place of it holds (None: none does)."""
    from .config import dig, quant_files, section
    from .detect import _holds, _params

    files = quant_files(ckpt)
    for where in table.declared_in:
        sec = section(files, where.file, where.section)
        if sec is not None and _holds(where.match, lambda k, sec=sec: dig(sec, k)):
            return _params(where, sec)
    return None


def checkpoint_codec(ckpt: Any = None, hint: str | None = None) -> Codec:
    """The codec of ``ckpt``'s scaled weights (see the module docstring for the order).

    ``ckpt`` needs ``tensors`` (and the configuration files ``quant_files`` reads); None: no
    checkpoint, the family's ``hint`` (a scheme name) decides.
    """
    if ckpt is not None:
        stored = _stored(ckpt.tensors)
        if stored is not None:
            params = config_params(get_scheme(stored.scheme), ckpt)
            return stored if params is None else restack_codec(get_scheme(stored.scheme), params, "stored") or stored
        found = _declared(ckpt)
        if found is not None:
            return found
    if hint is not None:
        found = restack_codec(get_scheme(hint), how="hint")
        if found is None:
            raise InputError(f"quantization scheme {hint!r} has no block format (one FP8 scale over fixed tiles)",
                             rule="quant-hint")
        return found
    found = restack_codec(get_scheme(DEFAULT_SCHEME), how="default")
    assert found is not None
    return found
