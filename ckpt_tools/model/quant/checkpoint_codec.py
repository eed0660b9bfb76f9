"""Which codec a checkpoint's scaled weights use (``checkpoint_codec``): a scheme table's restacking format
(``codec.Codec.restacks``) with the parameters the checkpoint declares, chosen in this order: the format its
storage shows (an FP8 weight beside such a format's scale tensor, with the block the configuration declares);
else the declared scheme's; else the family table's hint (``quantization: <scheme>``); else ``DEFAULT_SCHEME``.
Every other format goes through ``module_storage`` / ``dequant_module``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import InputError
from .block import block_tile
from .codec import CODECS, Codec, bind
from .tables import all_schemes, get_scheme

if TYPE_CHECKING:
    from .schema import FormatDef, SchemeTable
    from .storage import Storage

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
    return bind(CODECS.get(fmt.encoder or ""), scheme=table.scheme, format=fmt.name,
                weight_dtypes=frozenset(fmt.weight.dtypes), scale_suffix=scale,
                scale_dtypes=next((tuple(t.dtypes) for t in fmt.tensors if t.suffix == scale), ()),
                block=block_tile(fmt, params), how=how, weight_suffix=fmt.weight.suffix, params=dict(params))


def _declared(ckpt: Any) -> Codec | None:
    from .detect import detect_scheme

    try:
        scheme = detect_scheme(ckpt)
    except InputError:  # a scheme no table describes: the verbs that read it say so (module_storage)
        return None
    if scheme is None:
        return None
    for table in scheme.tables:
        found = restack_codec(table, scheme.default_params(table))
        if found is not None:
            return found
    return None


def _stored(tensors: Mapping[str, Any]) -> Codec | None:
    """The restacking codec whose scale companion sits next to the first FP8 weight that has one (the
    companion's name tells the tables apart: ``weight_scale_inv``, ``scale``)."""
    candidates = [f for f in (restack_codec(t, how="stored") for t in all_schemes().values()) if f is not None]
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
