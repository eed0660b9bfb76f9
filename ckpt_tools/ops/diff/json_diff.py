"""A structured difference of two JSON documents (config.json, side files), for `ckpt diff`.

Each difference is a dict with the ``path`` of the value (dotted keys, ``[i]`` list indices, a key
holding a dot or bracket quoted as ``["a.b"]``) and its ``change``:

- ``changed``: ``a`` -> ``b`` (a scalar, or a value whose type changed);
- ``added`` / ``removed``: a key only in ``b`` (``b``) / only in ``a`` (``a``);
- ``entries``: a list whose members differ, as ``added`` / ``removed`` members (a multiset
  difference: quantization ignore lists, architectures), so 25 names appended are one line;
- ``reordered``: the same members in another order.

Lists of equal length whose members are objects or lists are compared member by member instead
(``layer_types[3]``, ``config_groups.group_0.targets``...).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]+\Z")
SHOWN_ENTRIES = 3  # list members named in one line before "(N more)"
SHOWN_CHARS = 60  # a value longer than this is cut in the human line


def json_diff(a: Any, b: Any, path: str = "") -> list[dict]:
    """Every difference between ``a`` and ``b`` (empty when they are equal), in document order."""
    if a == b and _canon(a) == _canon(b):  # == alone takes true for 1 and 1 for 1.0
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[dict] = []
        for k in [*a, *(k for k in b if k not in a)]:
            p = _join(path, k)
            if k not in b:
                out.append({"path": p, "change": "removed", "a": a[k]})
            elif k not in a:
                out.append({"path": p, "change": "added", "b": b[k]})
            else:
                out += json_diff(a[k], b[k], p)
        return out
    if isinstance(a, list) and isinstance(b, list):
        return _list_diff(a, b, path)
    return [{"path": path or "(document)", "change": "changed", "a": a, "b": b}]


def _list_diff(a: list, b: list, path: str) -> list[dict]:
    if len(a) == len(b) and all(isinstance(x, (dict, list)) for x in a + b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in json_diff(x, y, f"{path}[{i}]")]
    ca, cb = Counter(map(_canon, a)), Counter(map(_canon, b))
    if ca == cb:
        return [{"path": path or "(document)", "change": "reordered"}]
    added, removed = cb - ca, ca - cb
    return [{"path": path or "(document)", "change": "entries",
             "added": [x for x in b if _take(added, x)], "removed": [x for x in a if _take(removed, x)]}]


def _take(counts: Counter, x: Any) -> bool:
    k = _canon(x)
    if counts[k] > 0:
        counts[k] -= 1
        return True
    return False


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def _join(path: str, key: str) -> str:
    part = key if _PLAIN_KEY.match(key) else json.dumps([key])
    return (f"{path}{part}" if part.startswith("[") else f"{path}.{part}") if path else part


def describe(d: dict) -> str:
    """One line for a difference: ``num_nextn_predict_layers: 1 -> 0``,
    ``quantization_config.ignore[+25 entries]: model.layers.3.eh_proj, ... (22 more)``."""
    change, path = d["change"], d["path"]
    if change == "changed":
        return f"{path}: {_short(d['a'])} -> {_short(d['b'])}"
    if change == "added":
        return f"{path}: added ({_short(d['b'])})"
    if change == "removed":
        return f"{path}: removed (was {_short(d['a'])})"
    if change == "reordered":
        return f"{path}: same entries, another order"
    counts = [f"{sign}{len(d[k])} entr{'y' if len(d[k]) == 1 else 'ies'}"
              for sign, k in (("+", "added"), ("-", "removed")) if d[k]]
    named = [f"{sign}{_short(x)}" for sign, k in (("+", "added"), ("-", "removed")) for x in d[k]]
    more = f" ({len(named) - SHOWN_ENTRIES} more)" if len(named) > SHOWN_ENTRIES else ""
    return f"{path}[{', '.join(counts)}]: {', '.join(named[:SHOWN_ENTRIES])}{more}"


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=False)
    return s if len(s) <= SHOWN_CHARS else s[:SHOWN_CHARS - 3] + "..."
