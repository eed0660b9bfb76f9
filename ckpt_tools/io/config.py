"""A view over config.json that resolves the nested ``text_config`` of multimodal models."""

from __future__ import annotations

import copy
import json
from typing import Any

_MISSING = object()

# Fields the tool reads outside the tables (family and format detection, quantization), with
# the JSON types they may have; null is always allowed. Checked once, when the config is read,
# so no later code meets ``architectures: 7``. Table variables are typed by their tables
# (``VarDef.kind``, checked in ``tables.resolve``).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "architectures": (list,),
    "model_type": (str,),
    "text_config": (dict,),
    "quantization_config": (dict,),
    "quantization_config.quant_method": (str,),
    "quantization_config.weight_block_size": (list,),
    "quantization_config.modules_to_not_convert": (list,),
    "quantization_config.ignore": (list,),
}
_STRING_LISTS = ("architectures", "quantization_config.modules_to_not_convert", "quantization_config.ignore")


def check_fields(raw: dict, name: str) -> None:
    """InputError (rule ``config-field``) naming the first well-known field of the wrong JSON type."""
    from ..errors import InputError

    scopes = [("", raw)]
    if isinstance(raw.get("text_config"), dict):
        scopes.append(("text_config.", raw["text_config"]))
    for prefix, scope in scopes:
        for key, types in FIELD_TYPES.items():
            v = ConfigView._dig(scope, key)
            if v is _MISSING or v is None:
                continue
            ok = isinstance(v, types) and not (key in _STRING_LISTS and not all(isinstance(x, str) for x in v))
            if not ok:
                want = "a list of strings" if key in _STRING_LISTS else " or ".join(
                    {"list": "a list", "str": "a string", "dict": "an object"}[t.__name__] for t in types)
                raise InputError(f"field {prefix + key!r} is {_json_type(v)} ({_short(v)}); expected {want} or null",
                                 rule="config-field", path=name)


def _json_type(v: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(v), type(v).__name__)


def _short(v: object, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class ConfigView:
    """Looks keys up in ``text_config`` first, then at the top level; dotted keys reach deeper.

    ``name`` is where the config came from (for messages), None for configs built in memory.
    """

    def __init__(self, raw: dict | None, name: str | None = None) -> None:
        self.raw: dict = raw if raw is not None else {}
        self.name = name

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "config.json") -> ConfigView:
        from ..errors import InputError

        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise InputError(f"not valid JSON: {e}", rule="config-json", path=name) from None
        if not isinstance(obj, dict):
            raise InputError(f"config must be a JSON object, not {_json_type(obj)}", rule="config-json", path=name)
        check_fields(obj, name)
        return cls(obj, name)

    @property
    def text(self) -> dict:
        tc = self.raw.get("text_config")
        return tc if isinstance(tc, dict) else self.raw

    @property
    def nested(self) -> bool:
        return isinstance(self.raw.get("text_config"), dict)

    def _scopes(self) -> list[dict]:
        return [self.text, self.raw] if self.nested else [self.raw]

    @staticmethod
    def _dig(obj: Any, dotted: str):
        for part in dotted.split("."):
            if not isinstance(obj, dict) or part not in obj:
                return _MISSING
            obj = obj[part]
        return obj

    def find(self, key: str) -> tuple[Any, dict] | None:
        """(value, the dict that holds it), or None."""
        for scope in self._scopes():
            v = self._dig(scope, key)
            if v is not _MISSING:
                parent = self._dig(scope, key.rsplit(".", 1)[0]) if "." in key else scope
                return v, parent
        return None

    def path_of(self, key: str) -> str:
        """Where ``find`` finds ``key`` in config.json, as a dotted path (``text_config.hidden_size``): for messages."""
        if self.nested and self._dig(self.text, key) is not _MISSING:
            return f"text_config.{key}"
        return key

    def get(self, key: str, default: Any = None) -> Any:
        found = self.find(key)
        return default if found is None else found[0]

    def has(self, key: str) -> bool:
        return self.find(key) is not None

    def architectures(self) -> list[str]:
        out: list[str] = []
        for scope in (self.raw, self.text) if self.nested else (self.raw,):
            a = scope.get("architectures")
            if isinstance(a, list):
                out += [x for x in a if isinstance(x, str) and x not in out]
        return out

    def model_types(self) -> list[str]:
        out: list[str] = []
        for scope in (self.raw, self.text) if self.nested else (self.raw,):
            mt = scope.get("model_type")
            if isinstance(mt, str) and mt not in out:
                out.append(mt)
        return out

    def with_values(self, updates: dict[str, Any]) -> ConfigView:
        """A copy with ``updates`` applied where each key lives (text_config first), else in text scope."""
        new = ConfigView(copy.deepcopy(self.raw), self.name)
        for key, value in updates.items():
            found = new.find(key)
            leaf = key.rsplit(".", 1)[-1]
            if found is not None:
                found[1][leaf] = value
            else:
                target = new.text
                for part in key.split(".")[:-1]:
                    target = target.setdefault(part, {})
                target[leaf] = value
        return new

    def without(self, keys: list[str]) -> ConfigView:
        new = ConfigView(copy.deepcopy(self.raw), self.name)
        for key in keys:
            for scope in new._scopes():
                scope.pop(key, None)
        return new

    def to_bytes(self) -> bytes:
        return (json.dumps(self.raw, indent=2, ensure_ascii=False) + "\n").encode()
