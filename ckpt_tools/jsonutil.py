"""Strict JSON for everything a user or a CI job parses (``--json``, reports, plans).

Python's ``json`` writes ``NaN`` / ``Infinity`` by default, which is not JSON: jq, JavaScript
and most parsers reject the whole document. ``dumps_strict`` never does. Non-finite floats
become ``"inf"`` / ``"-inf"`` (strings, so the sign survives) and NaN becomes ``null``;
numpy scalars and arrays become plain numbers and lists, tuples and sets lists, and any other
object its ``str``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any


def strict(obj: Any) -> Any:
    """``obj`` with every value JSON can hold exactly as JSON (see the module docstring)."""
    if type(obj).__module__ == "numpy" and hasattr(obj, "tolist"):  # numpy scalars and arrays: their Python values
        return strict(obj.tolist())
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {_key(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((strict(v) for v in obj), key=repr)
    return str(obj)


def json_float(v: float) -> float | str | None:
    """A float as strict JSON holds it: NaN -> null, +-inf -> "inf" / "-inf", any other its value."""
    v = float(v)
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def dumps_strict(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of ``strict(obj)``; ``allow_nan=False`` proves nothing non-finite slipped through.

    Reports are mostly finite: they are encoded directly (``strict`` converting only what json
    cannot), and walked first only when a non-finite float or an odd key turns up (measured on a
    20k-row diff report: the direct pass costs what json.dumps does, the walk doubles it).
    """
    try:
        return json.dumps(obj, allow_nan=False, default=strict, **kw)
    except (ValueError, TypeError):
        return json.dumps(strict(obj), allow_nan=False, **kw)


def dumps_indented(obj: Any, indent: int) -> str:
    """``dumps_strict(obj, indent=indent)``, the same text, three times faster for the plain values a manifest or an
    index holds (dicts with string keys, lists, strings, ints, finite floats, booleans, None): json indents in pure
    Python, with a generator per level. Anything else is left to it."""
    out: list[str] = []
    done: list[str] = []  # ``out`` joined every _FLUSH pieces: ~25 small strings a manifest entry, ~2 KB of objects
    try:
        _indented(obj, "\n", " " * indent, out, done)
    except (TypeError, ValueError):
        return dumps_strict(obj, indent=indent)
    done.append("".join(out))
    return "".join(done)


_FLUSH = 4096


def _indented(o: Any, pad: str, step: str, out: list[str], done: list[str]) -> None:
    t = type(o)
    if t is str:
        out.append(_quote(o))
    elif t is dict or t is list or t is tuple:
        if not o:
            out.append("{}" if t is dict else "[]")
            return
        inner = pad + step
        out.append("{" if t is dict else "[")
        sep = inner
        if t is dict:
            for k, v in o.items():
                if type(k) is not str:
                    raise TypeError(k)
                out.append(sep)
                out.append(_quote(k))
                out.append(": ")
                _indented(v, inner, step, out, done)
                sep = "," + inner
                if len(out) > _FLUSH:
                    done.append("".join(out))
                    out.clear()
        else:
            for v in o:
                out.append(sep)
                _indented(v, inner, step, out, done)
                sep = "," + inner
        out.append(pad + ("}" if t is dict else "]"))
    elif t is int:
        out.append(int.__repr__(o))
    elif t is float and math.isfinite(o):
        out.append(float.__repr__(o))
    elif o is None or o is True or o is False:
        out.append("null" if o is None else "true" if o else "false")
    else:
        raise TypeError(t)


_quote = json.encoder.encode_basestring_ascii  # what json.dumps writes a string as (ensure_ascii)


def write_json_file(path: str | os.PathLike, obj: Any, option: str, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Strict JSON into a file the user named (``--plan-json``, ``--report``).

    A path inside one of the command's ``inputs`` is refused (it would change an input), as is one through a
    dangling link (as every -o); a path that cannot be written is an output error naming the option, never an
    internal error. The file appears whole or not at all (a temporary file renamed; through a link to an
    existing file, that file is replaced).
    """
    from pathlib import Path

    from .errors import OutputError
    from .options import dangling_link, outside_inputs

    outside_inputs(option, path, inputs)
    link = dangling_link(Path(path))
    if link is not None:
        raise OutputError(f"{option}: {link} is a dangling symbolic link (to {os.readlink(link)}); create its "
                          "target, remove the link, or name another file", rule="output-dangling-link",
                          path=os.fspath(path))
    final = Path(path).resolve() if Path(path).is_symlink() else Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(dumps_strict(obj, indent=2) + "\n")
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{option}: cannot write it ({e.strerror or e})", path=os.fspath(path)) from None


def _key(k: Any) -> str | int | bool | None:
    """Dict keys JSON can hold; a non-finite float key (``NaN``) becomes its name, like any other object."""
    if isinstance(k, (str, int, bool)) or k is None:
        return k
    return str(k)
