"""A diff, stitch or graft report on the terminal.

Tensors that changed are listed by their full names with their dtype, shape and statistics (columns no
tensor fills are left out); unchanged, added and removed ones carry nothing more to say, so they are
counted per numbered block instead (``added 32 tensors under model.layers.3.``). ``--all`` lists every
tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

from .layout import Col, print_table

MAX_ROWS = 50  # a terminal table of thousands of experts helps nobody; JSON has them all
SUMMARIZED = ("unchanged", "added", "removed")  # no statistics to show: counted per block
COLUMNS = (Col("tensor", "id"), Col("status", "id"), Col("dtype", "id"), Col("shape", "id"),
           Col("max |Δ|", "id"), Col("rel L2", "id"), Col("cosine", "id"))


def render_diffs(diffs, totals: dict, show_all: bool = False, title: str = "diff", more_hint: str = "") -> None:
    from rich.text import Text

    from .common import out_console

    c = out_console()
    rows = [d for d in diffs if show_all or d.status not in SUMMARIZED]
    hidden = 0 if show_all else max(0, len(rows) - MAX_ROWS)
    if hidden:
        rows = rows[:MAX_ROWS]
    statuses = {d.status for d in rows}
    if len(statuses) == 1:  # one status for every row: said once, in the title
        title = f"{title}: {len(rows) + hidden:,} {statuses.pop()}"
        print_table(c, COLUMNS[:1] + COLUMNS[2:], [_row(d)[:1] + _row(d)[2:] for d in rows], title=title)
    elif rows:
        print_table(c, COLUMNS, [_row(d) for d in rows], title=title)
    elif title:
        c.print(Text(title, style="bold"))
    if not show_all:
        for status in SUMMARIZED:
            for label in group_keys(d.key for d in diffs if d.status == status):
                c.print(f"{status} {label}", markup=False)
    if any(d.nan_count or d.inf_count for d in diffs):
        c.print("NaN / Inf positions are counted beside max |Δ|; rel L2 and cosine are over the positions where "
                "both sides are finite")
    if hidden:
        c.print(f"... and {hidden} more changed tensors" + (f" ({more_hint})" if more_hint else ""), markup=False)
    c.print("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())), markup=False)


def _row(d) -> list[str]:
    return [d.key, d.status, _before_after(d.dtype_a, d.dtype_b), _before_after(d.shape_a, d.shape_b), _max_cell(d),
            _num(d.rel_l2), _num(d.cosine)]


def group_keys(keys: Iterable[str], named: int = 3) -> list[str]:
    """``keys`` counted per numbered block, blocks of one stem together: "32 tensors under model.layers.3.",
    "1,830 tensors under model.layers.{0-60}."; keys outside any numbered block are named when at most
    ``named``, else counted under their common prefix."""
    blocks: dict[str, dict[int, int]] = {}  # stem -> block number -> tensors
    others: list[str] = []
    for key in keys:
        parts = key.split(".")
        at = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
        if at is None:
            others.append(key)
            continue
        counts = blocks.setdefault("".join(p + "." for p in parts[:at]), {})
        counts[int(parts[at])] = counts.get(int(parts[at]), 0) + 1
    out = [f"{_tensors(sum(n.values()))} under {stem}{_numbers(sorted(n))}." for stem, n in blocks.items()]
    if len(others) <= named and others:
        out.append(f"{_tensors(len(others))}: {', '.join(others)}")
    elif others:
        common = _common_prefix(others)
        out.append(f"{len(others):,} {'other ' if blocks else ''}tensors" + (f" under {common}" if common else ""))
    return out


def _numbers(ns: list[int]) -> str:
    """3 -> "3"; [0, 1, 2, 5] -> "{0-2,5}"."""
    if len(ns) == 1:
        return str(ns[0])
    runs: list[list[int]] = []
    for n in ns:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "{" + ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) + "}"


def _common_prefix(keys: list[str]) -> str:
    """The dotted prefix every key shares ("model."), or ""."""
    import os

    common = os.path.commonprefix(keys)
    return common[: common.rfind(".") + 1]


def _tensors(n: int) -> str:
    return f"{n:,} tensor{'s' if n != 1 else ''}"


def _before_after(a, b) -> str:
    """One value when both sides agree or only one side exists (added / removed), else "a -> b"."""
    return str(b if a is None else a) if a is None or b is None or a == b else f"{a} -> {b}"


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.3g}"  # inf and nan print as such


def _max_cell(d) -> str:
    counts = [f"{n} {what}" for n, what in ((d.nan_count, "NaN"), (d.inf_count, "Inf")) if n]
    return _num(d.max_abs) + (f" ({', '.join(counts)})" if counts else "")
