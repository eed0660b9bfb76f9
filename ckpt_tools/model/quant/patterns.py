"""Exclusion and target entries compiled the way their consumers compile them (rule ``quant-pattern``).

compressed-tensors' ``match_name`` (and vLLM's ``should_ignore_layer``, Quark's) runs ``re.match`` on the
text after ``re:``; transformers' ``should_convert_module`` runs every ``modules_to_not_convert`` entry as a
regex; ModelOpt's loader reads ``ignore`` / ``exclude_modules`` as fnmatch globs (every string is one). An
entry its consumer cannot compile makes the consumer raise (``re.error``: ``from_pretrained`` fails), and an
entry that is not a string is no name at all. ``match`` reads such an entry as matching nothing, so without
this rule a malformed entry would pass every check while no engine can load the checkpoint.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import InputError
from ..problem import Problem
from .config import dig

RULE = "quant-pattern"
DESCRIPTION = "an ignore / exclude / targets entry of the quantization config its consumer cannot compile"
REGEX_MATCHERS = ("compressed-tensors", "quark")  # regexes after "re:"; other entries are exact names


def entry_error(matcher: str, entry: Any) -> str | None:
    """Why ``matcher``'s consumer cannot use ``entry`` (None: it can)."""
    if not isinstance(entry, str):
        return f"is {type(entry).__name__} {entry!r}, not a module name or pattern"
    text = entry[3:] if matcher in REGEX_MATCHERS and entry.startswith("re:") else \
        entry if matcher == "transformers" else None
    if text is None:
        return None
    try:
        re.compile(text)
    except re.error as e:
        return f"is not a regular expression: {e}"
    return None


def _lists(scheme: Any) -> list[tuple[Any, str, str, list]]:
    """(declaration, field label, matcher, entries) of every exclusion list and every group's targets."""
    out = []
    for decl in scheme.declarations:
        for e in decl.where.exclude:
            value = dig(decl.section, e.field)
            if isinstance(value, list):
                out.append((decl, e.field, e.matcher, value))
        for g in decl.groups:
            field = decl.where.targets
            value = g.entry.get(field) if field and isinstance(g.entry, dict) else None
            if isinstance(value, list):
                where = f"{decl.where.groups}.{g.name}.{field}" if decl.where.groups else field
                out.append((decl, where, "compressed-tensors", value))
    return out


def pattern_problems(ckpt: Any) -> list[Problem]:
    """Every entry of the declared quantization config's exclusion and target lists that its consumer cannot compile."""
    from .detect import detect_scheme

    try:
        scheme = detect_scheme(ckpt)
    except InputError:
        return []  # quant-unknown: reported where the scheme is read
    if scheme is None:
        return []
    out = []
    root = getattr(ckpt, "local_dir", None)
    for decl, field, matcher, entries in _lists(scheme):
        for i, entry in enumerate(entries):
            why = entry_error(matcher, entry)
            if why is not None:
                path = str(root / decl.file) if root is not None else decl.file
                out.append(Problem(RULE, path, None,
                                   f"{decl.label}.{field}[{i}] {entry!r} {why}; {matcher} reads this list, and "
                                   "loading fails (replace the entry with the exact module names it meant, or "
                                   "correct the pattern)"))
    return out
