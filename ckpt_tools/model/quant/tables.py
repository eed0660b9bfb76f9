"""Loading and checking the quantization-scheme tables (``mappings/quantization/*.yaml``).

Tables are checked against ``schema.SchemeTable`` and their expressions against the names they
may use; an error names the file and the field. Parsed YAML is cached like the architecture
tables (``tables.cache``, its own entry, keyed by the encoders and code kinds too): a run with the tables
unchanged reads them back checked, as plain records, without parsing or checking them again.

A scheme from outside the package is one more directory of tables: ``register_scheme_dir(path)``
(or ``CKPT_QUANT_TABLES``, os.pathsep-separated), read after the shipped tables, so a table there
may also replace a shipped one of the same name. The loaded tables are memoised per set of
directories, of encoders and of registered code kinds (a table naming an encoder or a code kind is
checked against them), so registering or unregistering any is seen by the next ``all_schemes``; a
table file added to an already-loaded directory is seen after ``reload_schemes()``.
docs/quantization.md "Adding a scheme".
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dtypes import DTYPES
from ...errors import TableError, UsageError
from ..tables import cache
from ..tables.loader import _parse, checked_table, mappings_dir, names_checker

if TYPE_CHECKING:
    from .schema import SchemeTable

CACHE_PREFIX = "quant-"
SHAPE_VARS = frozenset({"rows", "cols"})  # the logical weight matrix, for granularity expressions


_REGISTERED: list[Path] = []  # register_scheme_dir, in registration order


def register_scheme_dir(path: str | os.PathLike) -> Path:
    """Read the scheme tables (``*.yaml``) of directory ``path`` too, after the shipped ones and those
    registered before it (a table there replaces a shipped table of the same ``scheme``). The directory
    is read on the next ``all_schemes``; a table it holds that fails its checks is a TableError then."""
    d = Path(path).resolve()
    if not d.is_dir():
        raise UsageError("is not a directory of scheme tables", path=str(d))
    if d not in _REGISTERED:
        _REGISTERED.append(d)
    reload_schemes()
    return d


def unregister_scheme_dir(path: str | os.PathLike) -> None:
    """Stop reading directory ``path`` (registered with ``register_scheme_dir``); unknown paths are ignored."""
    d = Path(path).resolve()
    if d in _REGISTERED:
        _REGISTERED.remove(d)
    reload_schemes()


def reload_schemes() -> None:
    """Forget the loaded tables: the next ``all_schemes`` reads every directory again."""
    _load.cache_clear()
    _LAST.clear()


def quant_dirs() -> list[Path]:
    """Shipped scheme tables, then ``register_scheme_dir`` directories, then ``CKPT_QUANT_TABLES`` ones
    (os.pathsep-separated)."""
    return list(_dirs(tuple(_REGISTERED), os.environ.get("CKPT_QUANT_TABLES", "")))


@lru_cache(maxsize=8)
def _dirs(registered: tuple[Path, ...], env: str) -> tuple[Path, ...]:
    """The same Path objects for the same settings: all_schemes runs per module (tens of thousands of times in
    a release's gate), and building and hashing fresh paths each time was most of its cost."""
    return (mappings_dir() / "quantization", *registered,
            *(Path(extra) for extra in env.split(os.pathsep) if extra.strip()))


def _codecs() -> dict:
    """The codecs registered by name (codec.CODECS), which the package imports before any table is read (read here
    without importing codec, which reads the tables)."""
    return sys.modules[f"{__package__}.codec"].CODECS


def _registered_codes() -> frozenset[str]:
    """Code kinds added with decode.register_codes. Registering imports decode, so a decode module not yet
    imported has none (not importing it here keeps numpy out of every command's start), nor has one another
    thread is still importing (the first dequantized tensor imports it on a decoding thread)."""
    decode = sys.modules.get(f"{__package__}.decode")
    return frozenset(getattr(decode, "REGISTERED_CODES", ()))


def _check(table: SchemeTable, path: Path) -> None:
    """Dtypes are safetensors dtypes; expressions use only ``out``, ``in`` and declared params."""
    from .schema import CODES

    if table.scheme.startswith("gguf-"):  # model.gguf_names.GGUF_ROW: probe --mtp-quant's GGUF sidecar types
        raise TableError(f"field scheme: {table.scheme!r}: names starting gguf- are the GGUF sidecar types of "
                         "probe --mtp-quant", path=str(path))

    expr = names_checker(SHAPE_VARS | table.params, path, "not a config param or rows / cols")

    def dtypes(values: list[str], where: str) -> None:
        bad = [d for d in values if d not in DTYPES]
        if bad:
            raise TableError(f"field {where}: {bad} are not safetensors dtypes", path=str(path))

    for i, d in enumerate(table.declared_in):
        for j, r in enumerate(d.refuse):
            expr(r.when, f"declared_in[{i}].refuse[{j}].when")
        for j, e in enumerate(d.exclude):
            if e.field in (d.groups, d.per_module):
                raise TableError(f"field declared_in[{i}].exclude[{j}].field: {e.field!r} is not a list field",
                                 path=str(path))
    for e_i, ev in enumerate(table.evidence):
        dtypes(ev.dtypes, f"evidence[{e_i}].dtypes")
    for i, f in enumerate(table.storage):
        where = f"storage[{i}]"
        expr(f.when, f"{where}.when")
        expr(f.decoder.scale.granularity, f"{where}.decoder.scale.granularity")
        expr(f.decoder.scale.divides, f"{where}.decoder.scale.divides")
        for j, t in enumerate(f.tensors):
            expr(t.when, f"{where}.tensors[{j}].when")
        dtypes(f.weight.dtypes, f"{where}.weight.dtypes")
        codes = f.decoder.codes
        if codes not in CODES and codes not in _registered_codes():
            raise TableError(f"field {where}.decoder.codes: {codes!r} is not one of {list(CODES)} or a code kind "
                             "registered with decode.register_codes", path=str(path))
        if codes not in CODES:  # a registered kind: k codes per byte, so pack is k per byte of the weight dtype
            per_byte = sys.modules[f"{__package__}.decode"].REGISTERED_CODES[codes].shape[1]
            for dt in f.weight.dtypes:
                if f.weight.pack != per_byte * DTYPES[dt].nbytes(1):
                    raise TableError(f"field {where}.weight.pack: {f.weight.pack}, but {codes!r} codes are "
                                     f"{per_byte} per byte of {dt}", path=str(path))
        if f.encoder is not None and f.encoder not in _codecs():
            raise TableError(f"field {where}.encoder: {f.encoder!r} is not one of {sorted(_codecs())}", path=str(path))
        for j, t in enumerate(f.tensors):
            dtypes(t.dtypes, f"{where}.tensors[{j}].dtypes")
        try:
            f.label.format_map({k: "" for k in table.params})
        except (KeyError, ValueError, IndexError) as e:
            raise TableError(f"field {where}.label: {e!r} is not a config param", path=str(path)) from None


def load_scheme(path: str | os.PathLike, data: Any = None) -> SchemeTable:
    """Check and build the scheme table in ``path`` (``data``: its parsed YAML, if at hand)."""
    from .schema import SchemeTable

    path = Path(path)
    return checked_table(SchemeTable, _parse(path) if data is None else data, path, "scheme", _check,
                         "a scheme table")


@lru_cache(maxsize=4)
def _load(dirs: tuple[Path, ...], encoders: frozenset[str] = frozenset(),
          codes: frozenset[str] = frozenset()) -> dict[str, SchemeTable]:
    # ``encoders``, ``codes``: the encoders and registered code kinds the tables were checked against (key only)
    return cache.load_tables(dirs, _parse, load_scheme, lambda t: t.scheme, CACHE_PREFIX, code=_CODE,
                             extra=[sorted(encoders), sorted(codes)])


# what checks a scheme table: an edit to any of it misses the cache
_CODE = (*(Path(__file__).with_name(n) for n in ("schema.py", "tables.py")),
         *(Path(__file__).parent.parent / "tables" / n for n in ("plain.py", "loader.py")),
         Path(__file__).parent.parent / "expr.py",
         Path(__file__).parents[2] / "dtypes.py")


# (what decides the tables, the tables): planning a release asks once per quantized module (46,000 times), and
# building the directory list (paths hashed for the cache) cost more than the lookup it guards
_LAST: list[tuple[tuple, dict[str, SchemeTable]]] = []


def loaded_schemes() -> dict[str, SchemeTable]:
    """``all_schemes`` without the copy: the loaded tables themselves, the same object while the tables in force
    are the same (callers memoise on its identity; never modify it)."""
    key = (os.environ.get("CKPT_QUANT_TABLES"), tuple(_REGISTERED), tuple(_codecs()), _registered_codes())
    if _LAST and _LAST[0][0] == key:
        return _LAST[0][1]
    tables = _load(tuple(quant_dirs()), frozenset(key[2]), key[3])
    _LAST[:] = [(key, tables)]
    return tables


def all_schemes() -> dict[str, SchemeTable]:
    """Every scheme table by name, in file order."""
    return dict(loaded_schemes())


def get_scheme(name: str) -> SchemeTable:
    schemes = loaded_schemes()
    if name not in schemes:
        raise UsageError(f"unknown quantization scheme {name!r}; known: {', '.join(sorted(schemes))}",
                         rule="unknown-scheme")
    return schemes[name]
