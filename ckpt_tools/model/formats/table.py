"""Draft format tables (mappings/formats/): loading, and recognising a draft's format (the schema: ``models``).

A format maps canonical MTP roles to names; ``links`` resolves it against a verifier's MTP view,
``supports`` says whether it can express a family at all, ``templates`` fills its config.json.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import UsageError
from ..prefixes import WRAPPERS, peel
from ..tables import cache as table_cache
from ..tables.loader import _parse, checked_table, mappings_dir

if TYPE_CHECKING:
    from .models import Format

# the schema's classes (formats/models.py), imported when asked for: a run reads the checked tables as plain records
_MODELS = ("FieldRequirement", "ConfigCheck", "Supports", "DetectRule", "ConfigRecipe", "Format")


def __getattr__(name: str) -> Any:
    if name in _MODELS:
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


CACHE_PREFIX = "formats-"


def formats_dir() -> Path:
    return mappings_dir() / "formats"


def _build(path: Path, data: object) -> Format:
    from .models import Format

    return checked_table(Format, data, path, "name", what="a format table")


@lru_cache(maxsize=1)
def all_formats() -> dict[str, Format]:
    # checked once into the tables' cache, like the architecture tables: most runs then import neither yaml nor
    # pydantic
    return table_cache.load_tables((formats_dir(),), _parse, _build, lambda f: f.name, CACHE_PREFIX, code=_CODE)


_CODE = tuple(Path(__file__).with_name(n) for n in ("table.py", "models.py")) + tuple(
    Path(__file__).parent.parent / "tables" / n for n in ("plain.py", "loader.py"))


def get_format(name: str) -> Format:
    formats = all_formats()
    if name not in formats:
        raise UsageError(f"unknown format {name!r}; known: {', '.join(sorted(formats))}")
    return formats[name]


def detect_format(config: dict, manifest: dict | None, keys: Collection[str] = (),
                  strip_prefix: str | None = None) -> Format:
    """The format of a draft: its manifest says so, else the format tables' detect rules (its config,
    then its keys, with wrapper prefixes or ``strip_prefix`` stripped), else native."""
    if manifest and manifest.get("format") in all_formats():
        return all_formats()[manifest["format"]]
    return _by_config(config) or _by_keys(keys, strip_prefix) or all_formats()["native"]


def wrappers_of(fmt: Format) -> tuple[list[str], dict[str, str]]:
    """The wrapper prefixes a draft of ``fmt`` may carry, and how each is known (for reports)."""
    own = [p for p in fmt.strip_prefixes if p not in WRAPPERS]
    return [*own, *WRAPPERS], {p: f"format {fmt.name}" for p in own}


def all_wrappers() -> list[str]:
    """Every wrapper prefix known: the generic ones and those any format declares."""
    return list(dict.fromkeys(p for fmt in all_formats().values() for p in wrappers_of(fmt)[0]))


def _by_keys(keys: Collection[str], strip_prefix: str | None) -> Format | None:
    # a checkpoint's tensors (a mapping) answer membership as they are: no copy of a release's 92,000 keys
    have = keys if isinstance(keys, (Mapping, set, frozenset)) else set(keys)
    listed: list[str] | None = None
    for fmt in all_formats().values():
        marks = fmt.detect.keys if fmt.detect else []
        if not marks:
            continue
        if strip_prefix is not None:
            prefixes = [strip_prefix]
        else:
            listed = list(keys) if listed is None else listed
            prefixes = ["", *peel(listed, wrappers_of(fmt)[0])]
        if any(all(p + m in have for m in marks) for p in prefixes):
            return fmt
    return None


def _by_config(config: dict) -> Format | None:
    for fmt in all_formats().values():
        rule = fmt.detect
        if rule is None:
            continue
        if rule.config_equals and all(config.get(k) == v for k, v in rule.config_equals.items()):
            return fmt
        archs = config.get("architectures") or []
        if rule.architecture_suffix and any(isinstance(a, str) and a.endswith(rule.architecture_suffix)
                                            for a in archs):
            return fmt
    return None
