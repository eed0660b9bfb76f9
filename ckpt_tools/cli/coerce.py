"""Command-line values converted without pydantic where typer's conversion is a plain one.

typer (0.2x) converts every parameter's value through a pydantic ``TypeAdapter``: importing pydantic
and building the adapters costs 60-80 ms per run, a quarter of a read-only verb's fixed cost, to turn
a ``str`` into a ``str``. ``install()`` wraps typer's ``build_runtime_param`` so that parameters of
type ``str``, ``list[str]``, ``bool``, ``int``, ``float`` (within their bounds) and ``Path`` (without a
custom parser, clamping or file opening) are converted here, as typer's adapters convert them; any value these do not
take as it is (``"12x"`` for an int, a string for a bool) goes to typer's own adapter, so its messages
and its rules stay the ones the user sees. Where typer has no such hook (another version), nothing
changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_INT = re.compile(r"[+-]?\d+\Z")  # what both int() and pydantic's lax int parsing read the same way
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\Z")


def install() -> None:
    """Route typer's conversion of plain parameters through ``_Plain`` (idempotent)."""
    try:
        import typer.core as core
        from typer._coercion import RuntimeParam
    except ImportError:  # a typer without the adapter layer: nothing to avoid
        return
    original = getattr(core, "build_runtime_param", None)
    if original is None or getattr(original, "_ckpt_plain", False):
        return
    plain = _plain_class(RuntimeParam)

    def build(descriptor: Any) -> Any:
        kind = _kind(descriptor)
        if kind is None:
            return original(descriptor)
        return plain(descriptor.parameter_info, descriptor.annotation, kind, lambda: original(descriptor))

    build._ckpt_plain = True  # type: ignore[attr-defined]
    core.build_runtime_param = build


def _kind(descriptor: Any) -> str | None:
    """Which plain conversion a parameter needs, or None for typer's own."""
    info = descriptor.parameter_info
    if descriptor.file_annotation is not None or getattr(info, "parser", None) is not None:
        return None
    if any(getattr(info, a, None) is not None for a in ("click_type", "path_type")) or getattr(info, "clamp", False):
        return None
    ann = descriptor.annotation
    if (getattr(info, "min", None) is not None or getattr(info, "max", None) is not None) and ann not in (int, float):
        return None
    if ann is str:
        return "str"
    if ann == list[str]:
        return "list[str]"
    if ann is bool:
        return "bool"
    if ann is int:
        return "int"
    if ann is float:
        return "float"
    if ann is Path:
        return "path"
    return None


def _plain_class(base: type) -> type:
    @dataclass(frozen=True)
    class _Plain(base):  # type: ignore[misc, valid-type]
        """typer's RuntimeParam for a plain type; ``typer_param()`` builds typer's own for other values."""

        kind: str = "str"
        typer_param: Any = field(default=None, compare=False, repr=False)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            k = self.kind
            if k == "str" and isinstance(value, str):
                return value
            if k == "list[str]" and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return list(value)
            if k == "bool" and isinstance(value, bool):
                return value
            # a default is a number already (bool is not one here)
            number_given = type(value) is int or (k == "float" and type(value) is float)
            text = isinstance(value, str) and (_INT if k == "int" else _FLOAT).match(value)
            if k in ("int", "float") and (number_given or text):
                number = int(value) if k == "int" else float(value)
                low, high = self.parameter_info.min, self.parameter_info.max
                if (low is None or number >= low) and (high is None or number <= high):
                    return number
            if k == "path" and isinstance(value, str) and value:
                from typer._param_types import coerce_cli_path

                return coerce_cli_path(Path(value), self.parameter_info, path_type=Path, param=param, ctx=ctx)
            return self.typer_param()._coerce_value(value, param=param, ctx=ctx)

    return _Plain
