"""probe never reports a number that is not one: every agreement, KL and expected-accepted value is finite.

A measurement that gives NaN (a verifier or draft whose weights produce NaN logits) is no measurement:
``check_finite(result)`` refuses it (InputError, rule ``probe-nonfinite``, exit 3) naming the draft, the
field, the depth and, for per-prompt numbers, the prompt, instead of a report with ``null`` in it.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import InputError

RULE = "probe-nonfinite"
FIELDS = ("agreement", "kl")  # per depth, per draft and per prompt


def _bad(values: Any) -> int | None:
    """The first index whose value is not a finite number, or None."""
    return next((i for i, v in enumerate(values or [])
                 if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)), None)


def _require_finite_fields(row: dict, what: str, where: str | None) -> None:
    """Every per-depth number of ``row`` (a draft's, or one prompt's) is finite."""
    for f in FIELDS:
        i = _bad(row.get(f))
        if i is not None:
            raise InputError(f"{what}: {f} at depth {i + 1} is {row[f][i]!r}, not a finite number: the model "
                             "produced non-finite logits (NaN / Inf weights?); no measurement is reported",
                             rule=RULE, path=where)


def check_finite(result: Any, where: str | None = None) -> None:
    """Refuse a ``ProbeResult`` (or its ``to_json()``) holding a NaN, Inf or missing number."""
    report = result.to_json() if hasattr(result, "to_json") else result
    for draft in report.get("drafts", []):
        name = draft.get("name")
        _require_finite_fields(draft, f"draft {name!r}", where)
        ea = draft.get("expected_accepted")
        if ea is not None and _bad([ea]) is not None:
            raise InputError(f"draft {name!r}: expected_accepted is {ea!r}, not a finite number", rule=RULE, path=where)
        for p, row in enumerate(draft.get("prompts") or []):
            _require_finite_fields(row, f"draft {name!r}, prompt {p + 1}", where)
    for row in report.get("mtp_quant") or []:  # --mtp-quant: the MTP decoded from a scheme's bytes
        _require_finite_fields(row, f"--mtp-quant {row.get('scheme')!r}", where)
    ref = report.get("reference") or {}
    if "max_abs_diff" in ref and _bad([ref["max_abs_diff"]]) is not None:
        raise InputError(f"reference max_abs_diff is {ref['max_abs_diff']!r}, not a finite number", rule=RULE,
                         path=where)
