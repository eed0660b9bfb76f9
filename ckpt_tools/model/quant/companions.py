"""A checkpoint's block-scaled weights: which tensors travel with a weight, and how they decode.

``weight_format`` answers, for a checkpoint, with a scheme table's storage format instead of a
hard-coded suffix, block and dtype set, chosen in this order: the block format its storage shows (an
FP8 weight beside a block format's scale tensor, with the block the configuration declares); else
the declared scheme's block format; else the family table's hint (``quantization: <scheme>``); else
``DEFAULT_SCHEME``.

A block format (``block.block_tile``) holds one FP8 code per element and one scale companion over a
fixed tile, nothing else: what can be renamed, sliced per expert and restacked byte for byte. Every
other format goes through ``module_storage`` / ``dequant_module``. A per-module weight in a block format is
a ``Storage`` like any other; ``WeightFormat.storage`` names a stacked experts tensor the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import InputError
from ..expert_layouts import scale_key
from .block import block_tile
from .storage import Storage
from .tables import all_schemes, get_scheme

if TYPE_CHECKING:
    from .schema import SchemeTable

DEFAULT_SCHEME = "fp8-block"  # the block format of a checkpoint that declares, stores and hints nothing


@dataclass(frozen=True)
class Companion:
    """A tensor stored next to a weight: its key, role (scheme-table ``role``) and shape."""

    key: str
    role: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightFormat:
    """A block format of one scheme table, with the parameters the checkpoint declares."""

    scheme: str
    format: str
    weight_dtypes: frozenset[str]
    scale_suffix: str
    scale_dtypes: tuple[str, ...]
    block: tuple[int, int]
    how: str  # "declared" | "stored" | "hint" | "default": where the answer came from
    weight_suffix: str = "weight"
    params: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the table's, as the config declares

    def stores(self, dtype: str | None) -> bool:
        """Whether a weight of ``dtype`` is quantized in this format (needs its companions)."""
        return dtype in self.weight_dtypes

    def scale_key(self, weight_key: str) -> str:
        """The scale companion of ``weight_key``: ``<module>.weight`` -> ``<module>.<scale suffix>``; a bare
        stacked-experts name (``experts.gate_up_proj``) gets the suffix past ``weight_``
        (``experts.gate_up_proj_scale_inv``)."""
        return scale_key(weight_key, self.scale_suffix)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale grid of a ``shape`` weight [..., out, in] (lead dims kept, edge tiles partial)."""
        *lead, rows, cols = shape
        return (*lead, -(-rows // self.block[0]), -(-cols // self.block[1]))

    def companions(self, weight_key: str, shape: tuple[int, ...]) -> list[Companion]:
        """Every tensor that travels with a quantized ``weight_key`` of logical ``shape``."""
        return [Companion(self.scale_key(weight_key), "scale", self.scale_shape(tuple(shape)))]

    def decode(self, w: Any, scale: Any, dtype: str) -> Any:
        """``w`` (an FP8 OutputTensor) times its ``scale`` companion as ``dtype``: model/quant's decoder."""
        from .dequant import decode_block

        return decode_block(self, w, scale, dtype)

    def value_decoder(self, weight: Any, scale: Any):
        """``decode(buf, start, n)``: float32 values of any run of ``weight``'s codes (TensorRefs of the weight
        and its scale companion), the decoder's float32 product before any output cast (``diff --dequant``)."""
        from ...numeric.fp8_decode import scale_to_f32, value_decoder

        grid = scale_to_f32(scale.numpy(), scale.dtype)
        return value_decoder(weight.dtype, grid, tuple(weight.shape), self.block, f"{scale.key} of {weight.key}: ",
                             scale.file)

    def storage(self, weight_key: str, shape: tuple[int, ...], tensors: Mapping[str, Any]) -> Storage:
        """A weight of this format as a module ``Storage`` (its scale companion under the table's suffix), for a
        stacked experts tensor that ``module_storage`` cannot name: what the encoders and decoders take."""
        skey = self.scale_key(weight_key)
        ref = tensors.get(weight_key)
        return Storage(weight_key.removesuffix(".weight"), "quantized", ref.dtype if ref is not None else None,
                       self.scheme, self.format, f"{self.format} {list(self.block)}",
                       {self.weight_suffix: weight_key, self.scale_suffix: skey},
                       () if skey in tensors else (skey,), shape=tuple(shape),
                       params={**self.params, "block": list(self.block)})


def block_format(table: SchemeTable, params: Mapping[str, Any] | None = None, how: str = "declared"
                 ) -> WeightFormat | None:
    """``table``'s block format with ``params`` (the table's defaults when None), or None when it has none."""
    defaults = {name: p.default for d in table.declared_in for name, p in d.params.items()}
    params = {**defaults, **(params or {})}
    for fmt in table.storage:
        d = fmt.decoder
        tile = block_tile(fmt, params)
        if tile is None:
            continue
        return WeightFormat(table.scheme, fmt.name, frozenset(fmt.weight.dtypes), d.scale.tensor,
                            tuple(fmt.tensors[0].dtypes), tile, how, fmt.weight.suffix, dict(params))
    return None


def _declared(ckpt: Any) -> WeightFormat | None:
    from .detect import detect_scheme

    try:
        scheme = detect_scheme(ckpt)
    except InputError:  # a scheme no table describes: the verbs that read it say so (module_storage)
        return None
    if scheme is None:
        return None
    for table in scheme.tables:
        found = block_format(table, scheme.default_params(table))
        if found is not None:
            return found
    return None


def _stored(tensors: Mapping[str, Any]) -> WeightFormat | None:
    """The block format whose scale companion sits next to the first FP8 weight that has one (the
    companion's name tells the tables apart: ``weight_scale_inv``, ``scale``)."""
    candidates = [f for f in (block_format(t, how="stored") for t in all_schemes().values()) if f is not None]
    for key, ref in tensors.items():
        for f in candidates:
            if f.stores(ref.dtype):
                sref = tensors.get(f.scale_key(key))
                if sref is not None and sref.dtype in f.scale_dtypes:
                    return f
    return None


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


def weight_format(ckpt: Any = None, hint: str | None = None) -> WeightFormat:
    """The block format of ``ckpt``'s scaled weights (see the module docstring for the order).

    ``ckpt`` needs ``tensors`` (and the configuration files ``quant_files`` reads); None: no
    checkpoint, the family's ``hint`` (a scheme name) decides.
    """
    if ckpt is not None:
        stored = _stored(ckpt.tensors)
        if stored is not None:
            params = config_params(get_scheme(stored.scheme), ckpt)
            return stored if params is None else block_format(get_scheme(stored.scheme), params, "stored") or stored
        found = _declared(ckpt)
        if found is not None:
            return found
    if hint is not None:
        found = block_format(get_scheme(hint), how="hint")
        if found is None:
            raise InputError(f"quantization scheme {hint!r} has no block format (one FP8 scale over fixed tiles)",
                             rule="quant-hint")
        return found
    found = block_format(get_scheme(DEFAULT_SCHEME), how="default")
    assert found is not None
    return found
