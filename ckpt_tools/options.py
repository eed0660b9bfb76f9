"""Checks of values users pass on the command line, run before anything is opened or planned.

Wherever a user's value reaches arithmetic, ``re`` or a loop bound, it passes one of these
first, so a bad value is a usage error (exit 2) naming the option, never a crash, a long
run or an output built from it.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from .errors import UsageError

MAX_SEED = 2**63 - 1  # a signed 64-bit integer: what every consumer of the recorded seed can hold


def int_in_range(option: str, value: int, lo: int, hi: int, why: str = "") -> int:
    """``value`` if ``lo <= value <= hi``, else a UsageError naming ``option`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"{option} {_shown(value)}: expected an integer from {lo} to {hi}{f' ({why})' if why else ''}")
    return value


def positive_finite(option: str, value: float) -> float:
    """``value`` if it is a finite number above zero (inf, nan, 0 and negatives are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UsageError(f"{option} {_shown(value)}: expected a finite number above 0")
    return float(value)


def regex(option: str, pattern: str) -> re.Pattern:
    """``pattern`` compiled, or a UsageError naming ``option`` and what is wrong with it."""
    try:
        return re.compile(pattern)
    except (re.error, OverflowError, RecursionError, ValueError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise UsageError(f"{option} {_shown(pattern)}: not a regular expression ({what})") from None


def index_list(option: str, text: str, hi: int) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``: each a decimal integer from 0 to ``hi``, none twice, at least one."""
    items = [x.strip() for x in text.split(",")]
    values = [_index(x, hi) for x in items]
    if None in values:
        bad = items[values.index(None)]
        shown = _shown(bad) if bad else "an empty item"
        raise UsageError(f"{option} {_shown(text)}: {shown} is not an index from 0 to {hi}; expected comma-separated "
                         "indices such as 0 or 0,1")
    dups = sorted(v for v, n in Counter(values).items() if n > 1)
    if dups:
        raise UsageError(f"{option} {_shown(text)}: {', '.join(map(str, dups))} given more than once")
    return values


def _index(text: str, hi: int) -> int | None:
    """A decimal (ASCII digits) integer from 0 to ``hi``; digits are counted before ``int`` sees them."""
    digits = text.lstrip("0") or ("0" if text else "")
    if not re.fullmatch(r"[0-9]+", digits) or len(digits) > len(str(hi)):
        return None
    value = int(digits)
    return value if value <= hi else None


def outside_inputs(option: str, path: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> None:
    """A file the user asked us to write (``--plan-json``, ``--write``) must not land in an input."""
    target = Path(path).resolve()
    for src in inputs:
        src = Path(src).resolve()
        if target == src or target.is_relative_to(src if src.is_dir() else src.parent):
            raise UsageError(f"{option} {path}: inside the input {src}; write it somewhere else")


def dangling_link(path: Path) -> Path | None:
    """The first of ``path`` and its ancestors that is a symbolic link to nothing (None: none is)."""
    p = Path(os.path.abspath(path))
    for q in (p, *p.parents):
        if q.is_symlink() and not q.exists():
            return q
        if q.exists():
            return None
    return None


def _shown(value: object, limit: int = 60) -> str:
    """A value quoted for a message, cut short: a message names the value, it does not echo megabytes."""
    if isinstance(value, int) and value.bit_length() > 200:  # repr of a huge int is slow, or refused
        return f"(an integer of {value.bit_length()} bits)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
