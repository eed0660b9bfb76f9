"""Draft configs: a format's config.json template filled over the format environment."""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING

from ...errors import TableError
from ..expr import ExprError, evaluate

if TYPE_CHECKING:
    from .table import Format

_HUB_CACHE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


def verifier_name_of(source: str) -> str:
    """How a draft config names its verifier: the Hub id for ``hf://org/name[@rev]`` and for a Hub
    cache snapshot (``.../models--org--name/snapshots/<sha>``), else the path exactly as given
    (never made absolute: the config may be pushed, and a user's directory is no one else's)."""
    text = str(source)
    if text.startswith("hf://"):
        return text[len("hf://"):].split("@", 1)[0].rstrip("/")
    m = _HUB_CACHE.search(text.replace("\\", "/"))
    return f"{m.group(1)}/{m.group(2)}" if m else text


def _fill(value, env: dict, omitted: list[str], path: str):
    """Evaluate ``"{expr}"`` leaves of a config template; drop leaves whose inputs are unknown.

    A dict may start from ``$merge`` (a list of dicts or "{expr}"s giving dicts, later ones
    winning; an item whose inputs are unknown contributes nothing) and remove ``$drop`` keys
    (names, or "{expr}"s giving lists of names); its other keys are set on top.
    """
    if isinstance(value, dict) and ("$merge" in value or "$drop" in value):
        return _merged(value, env, omitted, path)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            filled = _fill(v, env, omitted, f"{path}.{k}" if path else k)
            if filled is not _OMIT:
                out[k] = filled
        return out
    if isinstance(value, list):
        return [x for x in (_fill(v, env, omitted, path) for v in value) if x is not _OMIT]
    if isinstance(value, str) and value.startswith("{") and value.endswith("}") and value.count("{") == 1:
        try:
            result = evaluate(value[1:-1], env)
        except ExprError:
            omitted.append(path)
            return _OMIT
        if result is None:
            omitted.append(path)
            return _OMIT
        return copy.deepcopy(result)
    return value


_OMIT = object()


def _merged(value: dict, env: dict, omitted: list[str], path: str) -> dict:
    out: dict = {}
    for item in value.get("$merge") or []:
        part = _fill(item, env, [], path)  # optional contributions: nothing to report when absent
        if isinstance(part, dict):
            out.update(part)
        elif part is not _OMIT:
            raise TableError(f"{path}: $merge item {item!r} is not a mapping", path="format config")
    for item in value.get("$drop") or []:
        keys = _fill(item, env, [], path)  # a key, or "{expr}" giving a list of keys
        for k in (keys if isinstance(keys, list) else [] if keys is _OMIT else [keys]):
            out.pop(k, None)
    rest = {k: v for k, v in value.items() if k not in ("$merge", "$drop")}
    out.update(_fill(rest, env, omitted, path))
    return out


def template_env(fmt: Format, env: dict) -> dict:
    """``env`` plus the format's named tables, their "{expr}" leaves filled over ``env``."""
    return {**env, **{name: _fill(t, env, [], name) for name, t in fmt.tables.items()}}


def draft_config(fmt: Format, source: dict, env: dict) -> tuple[dict, list[str]]:
    """The draft's config.json and the template fields left out for lack of a value."""
    omitted: list[str] = []
    base = copy.deepcopy(source) if fmt.config.base == "source" else {}
    filled = _fill(fmt.config.set, template_env(fmt, env), omitted, "")
    _merge(base, filled)
    return base, omitted


def _merge(base: dict, updates: dict) -> None:
    """Set each key where it lives (text_config first for nested configs), else at the top."""
    tc = base.get("text_config") if isinstance(base.get("text_config"), dict) else None
    for k, v in updates.items():
        if tc is not None and k in tc and k not in base:
            tc[k] = v
        else:
            base[k] = v
