"""Loading, checking and selecting architecture tables."""

from __future__ import annotations

import functools
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InputError, TableError, UsageError
from ...io.config import ConfigView
from ..expr import ExprError, names_in, template_names
from . import cache
from .resolve import typed_value

if TYPE_CHECKING:
    from collections.abc import Callable

    from .schema import Table

_UNPARSED = object()
# i: MTP depth, l: trunk layer, j / item: position and element of a repeated MTP sub-block
LOOP_VARS = frozenset({"i", "l", "j", "item"})


def safe_loader():
    """libyaml's safe loader when available: same safety, ~10x faster than the pure-Python one. yaml is
    imported on first use: with the parsed tables cached, most runs never need it (7 ms of start-up)."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache  # where the package lies does not change; asked once per tensor by quantization lookups
def mappings_dir() -> Path:
    """The shipped tables: ``mappings/`` of a source checkout, or the copy inside the wheel."""
    here = Path(__file__).resolve().parents[2]  # the ckpt_tools package
    for candidate in (here.parent / "mappings", here / "mappings"):
        if (candidate / "architectures").is_dir():
            return candidate
    raise TableError("cannot find the mappings/ directory shipped with ckpt-tools")


def table_dirs() -> list[Path]:
    """Shipped tables (families with MTP, then ``kind: template`` tables for families without it, used
    by ``init-draft``), plus user directories from ``CKPT_TABLES`` (os.pathsep-separated)."""
    return [mappings_dir() / "architectures", mappings_dir() / "templates",
            *(Path(extra) for extra in os.environ.get("CKPT_TABLES", "").split(os.pathsep) if extra.strip())]


def names_checker(known: set[str], path: Path, why: str) -> Callable[..., None]:
    """``check(text, where, template=False)``: a TableError naming field ``where`` when the expression (or key
    template) ``text`` does not parse or uses a name outside ``known`` (``why`` says what the names must be)."""

    def check(text: Any, where: str, template: bool = False) -> None:
        if not isinstance(text, str):
            return
        try:
            unknown = sorted((template_names(text) if template else names_in(text)) - known)
        except ExprError as e:
            raise TableError(f"field {where}: {e}", path=str(path)) from None
        if unknown:
            raise TableError(f"field {where}: uses {', '.join(unknown)}, {why}", path=str(path))

    return check


def _check_names(table: Table, path: Path) -> None:
    """Every expression may only use declared config variables and the loop indices."""
    known = set(table.config) | LOOP_VARS | set(table.mtp.layer_vars)
    for name, var in table.config.items():
        if var.default is not None:
            try:
                typed_value(var.kind, var.default)
            except ValueError as e:
                raise TableError(f"field config.{name}.default: {var.default!r} is not of type {var.kind} ({e})",
                                 path=str(path)) from None

    check = names_checker(known, path, "not declared under 'config'")

    def check_tensor(t, where):
        check(t.key, f"{where}.key", template=True)
        for j, d in enumerate(t.shape):
            check(d, f"{where}.shape[{j}]")
        check(t.when, f"{where}.when")

    for name, t in table.shared.items():
        check_tensor(t, f"shared.{name}")
    for pname, items in table.parts.items():
        for j, it in enumerate(items):
            if it.tensor is not None:
                check_tensor(it.tensor, f"parts.{pname}[{j}]")
            else:
                ex = it.experts
                for fld in ("count", "hidden", "inter", "when"):
                    check(getattr(ex, fld), f"parts.{pname}[{j}].experts.{fld}")
    check(table.trunk.prefix, "trunk.prefix", template=True)
    check(table.trunk.count, "trunk.count")
    for ref in table.trunk.parts:
        if ref.part not in table.parts:
            raise TableError(f"field trunk.parts: unknown part {ref.part!r}", path=str(path))
        check(ref.when, "trunk.parts.when")
    m = table.mtp
    check(m.count, "mtp.count")
    check(m.prefix, "mtp.prefix", template=True)
    for name, expr in m.layer_vars.items():
        check(expr, f"mtp.layer_vars.{name}")
    for role, t in m.glue.items():
        check_tensor(t, f"mtp.glue.{role}")
    for j, b in enumerate(m.blocks):
        check(b.prefix, f"mtp.blocks[{j}].prefix", template=True)
        check(b.repeat, f"mtp.blocks[{j}].repeat")
        for ref in b.parts:
            if ref.part not in table.parts:
                raise TableError(f"field mtp.blocks[{j}].parts: unknown part {ref.part!r}", path=str(path))
            check(ref.when, f"mtp.blocks[{j}].parts.when")
    if table.llama_cpp is not None:
        for j, sp in enumerate(table.llama_cpp.split):
            for fld in ("heads", "first", "second"):
                check(getattr(sp, fld), f"llama_cpp.split[{j}].{fld}")
        for j, pm in enumerate(table.llama_cpp.permute):
            check(pm.heads, f"llama_cpp.permute[{j}].heads")
        for key, value in table.llama_cpp.extend.items():
            if isinstance(value, str):
                check(value, f"llama_cpp.extend.{key}")
        from .schema import LLAMA_CPP_COMPARE

        unknown = sorted(set(table.llama_cpp.compare) - set(table.config) - set(LLAMA_CPP_COMPARE))
        if unknown:
            raise TableError(f"field llama_cpp.compare: {', '.join(unknown)} not declared under 'config'",
                             path=str(path))
    if m.count_field is not None and m.count_field not in table.config:
        raise TableError(f"field mtp.count_field: {m.count_field!r} is not a config variable", path=str(path))


def _parse(path: Path) -> Any:
    """The YAML data of a table file (any kind: architectures, formats, quantization schemes)."""
    import yaml

    try:
        return yaml.load(path.read_text(), Loader=safe_loader())  # noqa: S506 - (C)SafeLoader
    except yaml.YAMLError as e:
        raise TableError(f"not valid YAML: {e}", path=str(path)) from None
    except OSError as e:
        raise TableError(f"cannot read: {e.strerror}", path=str(path)) from None
    except UnicodeDecodeError as e:
        raise TableError(f"not UTF-8 text: {e}", path=str(path)) from None


def checked_table(model: Any, data: Any, path: Path, name: str, check: Callable[[Any, Path], None] | None = None,
                  what: str = "a table") -> Any:
    """Table file ``path``'s YAML ``data`` checked by pydantic ``model``, its ``name`` field the file's name, then
    by ``check``: as the plain record runs read (and the cache holds), without pydantic."""
    from pydantic import ValidationError

    from .plain import to_plain

    if not isinstance(data, dict):
        raise TableError(f"{what} must be a YAML mapping", path=str(path))
    try:
        table = model.model_validate(data)
    except ValidationError as e:
        errors = [f"field {'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()]
        more = [f"... and {len(errors) - 8} more"] if len(errors) > 8 else []
        raise TableError("; ".join(errors[:8] + more), path=str(path)) from None
    if getattr(table, name) != path.stem:
        raise TableError(f"field {name}: {getattr(table, name)!r} must match the file name {path.stem!r}",
                         path=str(path))
    if check is not None:
        check(table, path)
    return to_plain(table)


def load_table(path: str | os.PathLike, data: Any = _UNPARSED) -> Table:
    """Check and build the table in ``path`` (``data``: its already parsed YAML, if at hand)."""
    from .schema import Table

    path = Path(path)
    return checked_table(Table, _parse(path) if data is _UNPARSED else data, path, "family", _check_names)


@lru_cache(maxsize=8)
def _load_dirs(dirs: tuple[Path, ...]) -> dict[str, Table]:
    return cache.load_tables(dirs, _parse, load_table, lambda t: t.family, code=_CODE)


# what checks an architecture table: an edit to any of it misses the cache
_HERE = Path(__file__).parent
_CODE = (*(_HERE / n for n in ("schema.py", "roles.py", "loader.py", "plain.py", "resolve.py")),
         _HERE.parent / "expr.py")


def all_tables() -> dict[str, Table]:
    return dict(_load_dirs(tuple(table_dirs())))


def get_table(name: str) -> Table:
    """The table a user named (``--arch``, ``--family``): an unknown name is a usage error (exit 2)."""
    tables = all_tables()
    if name not in tables:
        raise UsageError(f"unknown family {name!r}; known: {', '.join(sorted(tables))}", rule="unknown-family")
    return tables[name]


def detect_table(config: ConfigView, tables: dict[str, Table] | None = None) -> Table:
    """Pick the table whose architectures (else model_type) match the config.

    Among tables matching the same architecture, the first whose required config
    variables are all present wins (e.g. a dense and a MoE variant that share a model
    type family but differ in config fields).
    """
    tables = all_tables() if tables is None else tables
    archs = config.architectures()
    types = config.model_types()
    candidates = [t for t in tables.values() if set(t.detect.architectures) & set(archs)]
    if not candidates:
        candidates = [t for t in tables.values() if set(t.detect.model_types) & set(types)]
    if len(candidates) > 1:
        fitting = [t for t in candidates if _fits(t, config)]
        candidates = fitting or candidates
    if not candidates:
        known = ", ".join(sorted(tables))
        raise InputError(
            f"no table matches architectures {archs or '-'} / model_type {types or '-'}. Known families: {known}. "
            "Pass --arch NAME, or add a table (see README 'Adding a family'); `ckpt inspect --discover` drafts one.",
            rule="unknown-family",
        )
    if len(candidates) > 1:
        names = ", ".join(t.family for t in candidates)
        raise InputError(f"several tables match this config ({names}); pass --arch NAME", rule="ambiguous-family")
    return candidates[0]


def _fits(table: Table, config: ConfigView) -> bool:
    return not any(v.required and v.default is None and not any(config.has(k) for k in v.keys)
                   for v in table.config.values())
