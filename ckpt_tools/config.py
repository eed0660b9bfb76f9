"""A view over config.json that resolves the nested ``text_config`` of multimodal models."""

from __future__ import annotations

import copy
import json
from typing import Any

_MISSING = object()


class ConfigView:
    """Looks keys up in ``text_config`` first, then at the top level; dotted keys reach deeper."""

    def __init__(self, raw: dict | None) -> None:
        self.raw: dict = raw if raw is not None else {}

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "config.json") -> ConfigView:
        from .errors import InputError

        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise InputError(f"not valid JSON: {e}", path=name) from None
        if not isinstance(obj, dict):
            raise InputError("config must be a JSON object", path=name)
        return cls(obj)

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
        new = ConfigView(copy.deepcopy(self.raw))
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
        new = ConfigView(copy.deepcopy(self.raw))
        for key in keys:
            for scope in new._scopes():
                scope.pop(key, None)
        return new

    def to_bytes(self) -> bytes:
        return (json.dumps(self.raw, indent=2, ensure_ascii=False) + "\n").encode()
