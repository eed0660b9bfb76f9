"""Module-name matching, exactly as each consumer of a quantization config does it.

- ``compressed-tensors`` and ``quark``: ``re:`` patterns are ``re.match`` regexes (anchored at the
  start), anything else must equal the name; a class-name target (``Linear``) matches every linear layer.
- ``modelopt``: ``exclude_modules`` / ``ignore`` entries are fnmatch globs.
- ``transformers``: ``modules_to_not_convert`` entries are regexes matched from the start up to a
  module boundary, or a suffix of the name.
- ``exact``: the name itself (vLLM fp8 ``ignored_layers``).

Fused modules (vLLM/SGLang ``packed_modules_mapping``: ``qkv_proj`` <- ``q_proj``, ``k_proj``,
``v_proj``): excluded when a pattern names the fused module (compressed-tensors: only an exact entry),
else when every shard is excluded; shards that disagree are a ``conflict`` (vLLM refuses to load).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Any

Fused = Mapping[str, Iterable[str]]  # fused suffix -> shard suffixes (vLLM packed_modules_mapping)

_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@lru_cache(maxsize=4096)
def _regex(pattern: str) -> re.Pattern | None:
    try:
        return re.compile(pattern)
    except re.error:
        return None  # a pattern that does not compile matches nothing (the consumer would raise)


def match_one(matcher: str, name: str, pattern: str) -> bool:
    """Does one exclusion / target ``pattern`` name module ``name`` under ``matcher``'s rules?"""
    if matcher in ("compressed-tensors", "quark"):
        if pattern.startswith("re:"):
            rx = _regex(pattern[3:])
            return rx is not None and rx.match(name) is not None
        return pattern == name
    if matcher == "modelopt":
        return pattern == name or fnmatchcase(name, pattern)
    if matcher == "transformers":
        rx = _regex(f"(?:{pattern}){_BOUNDARY}")
        return (rx is not None and rx.match(name) is not None) or name.endswith(pattern)
    if matcher == "exact":
        return pattern == name
    raise ValueError(f"unknown matcher {matcher!r}")


def match_any(matcher: str, name: str, patterns: Iterable[str]) -> bool:
    """Does any of ``patterns`` name ``name``? The same answer as ``match_one`` over each, from one combined
    matcher per pattern list (a repaired config lists ~800 modules, each checked against all of them)."""
    patterns = tuple(patterns)
    if len(patterns) < 4 or matcher not in ("compressed-tensors", "quark", "transformers"):
        return any(match_one(matcher, name, p) for p in patterns)
    exact, rx, suffixes = _combined(matcher, patterns)
    return name in exact or (rx is not None and rx.match(name) is not None) or name.endswith(suffixes)


@lru_cache(maxsize=64)
def _combined(matcher: str, patterns: tuple[str, ...]) -> tuple[frozenset[str], Any, tuple[str, ...]]:
    """(names matched exactly, one regex matching where any pattern's regex does, suffixes any name may end with).

    The regex is the alternation of the patterns' own regexes, each in a group of its own (``re.match`` of an
    alternation matches when one alternative does: the engine tries each); a pattern that does not compile
    matches nothing, as in ``match_one``. Patterns that could change meaning inside an alternation
    (backreferences, named groups, conditionals, inline flags) keep a regex each, tried in turn."""
    transformers = matcher == "transformers"
    if transformers:
        exact: frozenset[str] = frozenset()
        sources = list(patterns)
        suffixes = patterns
    else:  # compressed-tensors, quark: "re:" patterns are regexes, the rest exact names
        exact = frozenset(p for p in patterns if not p.startswith("re:"))
        sources = [p[3:] for p in patterns if p.startswith("re:")]
        suffixes = ()
    own = [(p, f"(?:{p}){_BOUNDARY}" if transformers else p) for p in sources]
    # a module name (letters, digits, _ . - /) is a valid regex of its own: only the others are compiled to check
    own = [(p, full) for p, full in own if _PLAIN.match(p) or _regex(full) is not None]
    alone = [full for p, full in own if not _PLAIN.match(p) and (_regex(p) is None or _UNSAFE.search(p))]
    together = [p for p, full in own if full not in alone]
    rx = None
    if together:
        body = "|".join(f"(?:{p})" for p in together)
        try:
            rx = re.compile(f"(?:{body}){_BOUNDARY}" if transformers else body)
        except re.error:  # e.g. an inline flag that is only allowed at the start: one regex each
            alone += [f"(?:{p}){_BOUNDARY}" if transformers else p for p in together]
            rx = None
    if alone:
        rx = _Either(rx, [_regex(full) for full in alone])
    return exact, rx, suffixes


_PLAIN = re.compile(r"[\w.\-/]*\Z")
_UNSAFE = re.compile(r"\\[1-9]|\(\?P|\(\?\(|\(\?[aiLmsux-]")  # backreference, named group, conditional, flags


class _Either:
    """``.match`` that succeeds when any of several compiled regexes matches."""

    def __init__(self, first: re.Pattern | None, rest: list) -> None:
        self.all = [r for r in (first, *rest) if r is not None]

    def match(self, name: str):
        return next((m for r in self.all if (m := r.match(name)) is not None), None)


def shards_of(name: str, fused: Fused | None) -> list[str] | None:
    """The checkpoint modules an engine's fused layer ``name`` is built from, or None if not fused."""
    if not fused:
        return None
    head, dot, last = name.rpartition(".")
    parts = fused.get(last)
    return None if parts is None else [f"{head}{dot}{p}" for p in parts]


def excluded(matcher: str, name: str, patterns: list[str], fused: Fused | None = None) -> bool | None:
    """True / False, or None when the shards of a fused ``name`` disagree (a conflict)."""
    shards = shards_of(name, fused)
    if shards is not None:
        regex_style = matcher in ("compressed-tensors", "quark")  # vLLM: only an exact entry names the fused layer
        if (name in patterns) if regex_style else match_any(matcher, name, patterns):
            return True
        states = {match_any(matcher, s, patterns) for s in shards}
        return states.pop() if len(states) == 1 else None
    return match_any(matcher, name, patterns)


def ranked(name: str, targets: Iterable[str], kind: str = "Linear") -> list[str]:
    """The ``targets`` naming module ``name`` (of class ``kind``), most specific first, as compressed-tensors 0.20.1
    ranks them (``utils/match.py`` ``match_targets``, whose first entry ``apply_quantization_config`` takes): the
    targets sorted by ``("re:" in target, target)``, those matching the name (exact names, then ``re:`` regexes,
    each alphabetically), then class-name targets the module is."""
    exact, regexes = _ranked_split(tuple(targets))
    names = ([name] if name in exact else []) + [t for t in regexes if match_one("compressed-tensors", name, t)]
    return names + ([kind] if kind in exact and kind not in names else [])


@lru_cache(maxsize=64)
def _ranked_split(targets: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """(the targets without "re:", which match a name by equality; those with it, in compressed-tensors' sort order).
    A config may list hundreds of exact names: each module looks its own name up once."""
    return (frozenset(t for t in targets if "re:" not in t),
            tuple(sorted({t for t in targets if "re:" in t})))


def first_listed(name: str, targets: Iterable[str], kind: str = "Linear") -> str | None:
    """The target vLLM 0.32 picks for a (non-fused) layer (``compressed_tensors/utils.py`` ``find_matched_target``):
    the first target in config order naming it (exact or ``re:``), else a class-name target. It differs from
    ``ranked``'s first only where two name targets match."""
    targets = list(targets)
    names = [t for t in ranked(name, targets, kind) if t != kind]
    return min(names, key=targets.index) if names else (kind if kind in targets else None)
