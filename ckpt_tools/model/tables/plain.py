"""Checked tables as plain objects: what a run reads back from the table cache without pydantic.

The schemas (``tables/schema.py``, ``quant/schema.py``, ``formats/table.py``) are pydantic models: they check a
table file and say what is wrong in it. A run only reads the checked tables' fields, so the loaders turn each
checked model into a ``Plain`` record (``to_plain``: the same fields, the same nesting, and the few properties
the schemas define, from ``BEHAVIOUR``), and the cache stores those records (``dumps`` / ``loads``: JSON with
each record tagged by its schema class). A run whose table files are unchanged then imports neither yaml nor
pydantic (0.1 s of every command's start-up); a changed or missing entry checks the files again.
"""

from __future__ import annotations

import json
from typing import Any

TAG = "~"  # a record's schema class in the cache's JSON (a table's own mappings holding it are escaped)
_MAPPING = "~mapping"  # a plain mapping whose keys include TAG: stored as its items


class Plain:
    """A frozen record: a checked model's fields as attributes (compared, hashed and shown as the model is)."""

    _schema = ""  # the model's qualified class name

    def __init__(self, **fields: Any) -> None:
        object.__setattr__(self, "__dict__", fields)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is frozen (a checked table)")

    def __delattr__(self, name: str) -> None:
        raise TypeError(f"{type(self).__name__} is frozen (a checked table)")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:  # as a frozen pydantic model: of its field values
        return hash((type(self), tuple(self.__dict__.values())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"

    def __reduce__(self) -> tuple:
        return _make, (self._schema, dict(self.__dict__))

    def model_copy(self, *, update: dict[str, Any] | None = None) -> Plain:
        """A copy with ``update``'s fields replaced (as pydantic's ``model_copy``: not checked again)."""
        return _make(self._schema, {**self.__dict__, **(update or {})})


# The properties the schemas define, for their plain records (the models inherit the same mixins).
class VarKind:
    """``VarDef.kind``: the type a config variable must have (its ``type``, else its default's)."""

    _DEFAULT_TYPES = ((bool, "bool"), (int, "count"), (float, "number"), (str, "str"), (list, "list"))

    @property
    def kind(self) -> str:
        if self.type is not None:  # type: ignore[attr-defined]
            return self.type  # type: ignore[attr-defined]
        for py, name in self._DEFAULT_TYPES:
            if isinstance(self.default, py):  # type: ignore[attr-defined]
                return name
        return "count"


class SchemeParams:
    """``SchemeTable.params``: every parameter name its declarations read."""

    @property
    def params(self) -> set[str]:
        return {p for d in self.declared_in for p in d.params}  # type: ignore[attr-defined]


BEHAVIOUR: dict[str, type] = {
    "ckpt_tools.model.tables.schema.VarDef": VarKind,
    "ckpt_tools.model.quant.schema.SchemeTable": SchemeParams,
}
_CLASSES: dict[str, type[Plain]] = {}


def plain_class(schema: str) -> type[Plain]:
    """The record class of the model class ``schema`` (module and name), made once."""
    cls = _CLASSES.get(schema)
    if cls is None:
        mixin = BEHAVIOUR.get(schema)
        bases = (Plain, mixin) if mixin is not None else (Plain,)
        cls = type(schema.rpartition(".")[2], bases, {"__slots__": (), "_schema": schema, "__module__": __name__})
        _CLASSES[schema] = cls
    return cls


def _make(schema: str, fields: dict[str, Any]) -> Plain:
    return plain_class(schema)(**fields)


def to_plain(value: Any) -> Any:
    """A checked pydantic model (and everything inside it) as plain records, lists and dicts."""
    fields = getattr(type(value), "model_fields", None)
    if fields is not None:
        t = type(value)
        return _make(f"{t.__module__}.{t.__qualname__}", {k: to_plain(getattr(value, k)) for k in fields})
    if isinstance(value, Plain):
        return value
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_plain(v) for v in value)
    return value


def _encode(value: Any) -> Any:
    if isinstance(value, Plain):
        return {TAG: value._schema, **{k: _encode(v) for k, v in value.__dict__.items()}}
    if isinstance(value, dict):
        if TAG in value:
            return {TAG: _MAPPING, "items": [[k, _encode(v)] for k, v in value.items()]}
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(obj: dict) -> Any:
    schema = obj.get(TAG)
    if schema is None:
        return obj
    if schema == _MAPPING:
        return dict(obj["items"])
    del obj[TAG]
    return _make(schema, obj)


def dumps(tables: dict[str, Any]) -> str | None:
    """The JSON of checked tables, or None when JSON cannot hold them exactly (then they are not cached)."""
    try:
        text = json.dumps(_encode(tables))
    except (TypeError, ValueError):
        return None
    return text if loads(text) == tables else None


def loads(text: str) -> dict[str, Any]:
    return json.loads(text, object_hook=_decode)
