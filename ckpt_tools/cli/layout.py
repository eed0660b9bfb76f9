"""Tables that fit the console's width without breaking an identifier.

Each column says what its cells hold (``Col.kind``):

- ``id``: one identifier or number (a tensor key, a shard, a template, a dtype, a count): never broken
  and never cut;
- ``ids``: identifiers separated by ", " (none holding a space): a cell wraps between them only;
- ``words``: words separated by spaces (a label, a sentence): a cell wraps between words, a word is
  never broken;
- ``text``: anything else: cut with an ellipsis when the width runs out.

``print_table`` chooses the layout: every column beside the key when that fits; else the columns that
may go (``Col.drop``, highest first) leave until it fits; else each key takes a line of its own with its
other cells below it. Columns whose cells are all empty are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TEXT_MIN = 8  # a text column is not cut narrower than this (or its header's longest word)
INDENT = 4  # the cells below a key that has a line of its own
GAP = 2  # between the cells of such a line


@dataclass(frozen=True)
class Col:
    header: str
    kind: str = "text"  # id | ids | words | text
    justify: str = "left"
    drop: int = 0  # 0: always shown; columns with a higher number leave first when the width runs short


def print_table(console, cols: Sequence[Col], rows: Sequence[Sequence[str]], *, title: str | None = None) -> list[str]:
    """Print ``rows`` (the key first) under ``cols`` at ``console.width``.

    Returns the headers of the columns left out for the width (a caller may say where to find them).
    """
    keep = [i for i in range(len(cols)) if i == 0 or any(r[i] for r in rows)]
    dropped: list[str] = []

    def pick(i: list[int]) -> tuple[list[Col], list[list[str]]]:
        return [cols[j] for j in i], [[r[j] for j in i] for r in rows]

    def drop_one() -> bool:
        droppable = [i for i in keep if cols[i].drop]
        if not droppable:
            return False
        gone = max(droppable, key=lambda i: cols[i].drop)
        keep.remove(gone)
        dropped.append(cols[gone].header)
        return True

    while True:  # every column beside the key, as many as fit
        widths = fit(*pick(keep), console.width - 3 * len(keep) - 1)  # rich's box: a bar and two pads a column
        if widths is not None:
            _boxed(console, *pick(keep), widths, title)
            return dropped
        if not drop_one():
            break
    keep[:] = [i for i in range(len(cols)) if i == 0 or any(r[i] for r in rows)]
    dropped.clear()
    while True:  # the key on its own line, the other cells below it
        sub = keep[1:]
        widths = fit(*pick(sub), console.width - INDENT - GAP * max(0, len(sub) - 1))
        if widths is not None or not drop_one():
            break
    _stacked(console, cols[0].header, *pick(keep), widths, title)
    return dropped


def fit(cols: Sequence[Col], rows: Sequence[Sequence[str]], avail: int) -> list[int] | None:
    """Column widths within ``avail`` cells: natural widths, narrowed where a column allows (the most
    slack first); None when even the narrowest allowed widths do not fit."""
    from rich.cells import cell_len

    natural, least = [], []
    for i, c in enumerate(cols):
        cells = [r[i] for r in rows]
        word = max((cell_len(w) for w in c.header.split()), default=0)
        wide = max([cell_len(c.header), *(cell_len(s) for s in cells)])
        if c.kind == "id":
            low = max([word, *(cell_len(s) for s in cells)])
        elif c.kind == "ids":
            low = max([word, *(cell_len(item) for s in cells for item in s.split(", "))])
        elif c.kind == "words":
            low = max([word, *(cell_len(w) for s in cells for w in s.split())])
        else:
            low = min(wide, max(TEXT_MIN, word))
        natural.append(wide)
        least.append(low)
    if sum(least) > avail:
        return None
    widths = natural[:]
    for _ in range(sum(widths) - avail):  # a cell at a time from the column with the most slack: an even cut
        i = max(range(len(widths)), key=lambda j: widths[j] - least[j])
        widths[i] -= 1
    return widths


def _boxed(console, cols: list[Col], rows: list[list[str]], widths: list[int], title: str | None) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title)
    for c, w in zip(cols, widths, strict=True):
        # a header wraps between its words (the width holds the longest); a text cell is cut instead
        t.add_column(Text(c.header, no_wrap=False), justify=c.justify, width=w, no_wrap=c.kind == "text",
                     overflow="ellipsis" if c.kind == "text" else "fold")
    for r in rows:
        t.add_row(*(Text(s) for s in r))  # cells are data: no markup
    console.print(t)


def _stacked(console, key_header: str, cols: list[Col], rows: list[list[str]], widths: list[int] | None,
             title: str | None) -> None:
    """Each key on a line of its own (folded only when it is wider than the console), its cells below."""
    from rich.text import Text

    sub = cols[1:]
    if widths is None:  # not even the narrowest cells fit: identifiers keep their width, the line runs over
        widths = fit(sub, [r[1:] for r in rows], 10**6) or []
    if title:
        console.print(Text(title, style="bold"))
    console.print(Text(key_header, style="bold"))
    head = _cells(sub, [c.header for c in sub], widths) if sub else []
    body = []
    for r in rows:
        body.append(r[0])
        body += _cells(sub, r[1:], widths)  # wider than the console only in the last resort
    if not head and not body:
        return
    if _plain_fits(console, head + body):  # what rich would print, without its ~3,000 Text objects for a release's plan
        console.file.write("\n".join(head + body) + "\n")
        console.file.flush()  # as rich does after each print (stderr's lines keep their place)
        return
    # one print: a release's dry run lists ~1,600 tensors, and each print costs rich a terminal probe
    console.print(Text("\n").join([Text(line, style="bold") for line in head] + list(map(Text, body))),
                  overflow="fold")


def _plain_fits(console, lines: list[str]) -> bool:
    """Whether rich would print ``lines`` as they are: no styles written (not a terminal, no colour forced), and
    every line printable ASCII (one cell a character, no control code to strip) within the width (none folded)."""
    text = "".join(lines)
    return (console.color_system is None and not console.record and not console.quiet and text.isascii()
            and text.isprintable() and max(map(len, lines), default=0) <= console.width)


def _cells(cols: list[Col], cells: list[str], widths: list[int]) -> list[str]:
    """The lines of one stacked row: each cell within its width (ids wrap between items, text is cut)."""
    parts = [_lines(c, s, w) for c, s, w in zip(cols, cells, widths, strict=True)]
    height = max((len(p) for p in parts), default=0)
    out = []
    for k in range(height):
        line = []
        for c, p, w in zip(cols, parts, widths, strict=True):
            s = p[k] if k < len(p) else ""
            line.append(s.rjust(w) if c.justify == "right" else s.ljust(w))
        out.append(" " * INDENT + (" " * GAP).join(line).rstrip())
    return out


def _lines(c: Col, s: str, width: int) -> list[str]:
    from rich.cells import cell_len

    if c.kind == "text" and cell_len(s) > width:
        return [s[: max(0, width - 1)] + "…"]
    if c.kind not in ("ids", "words") or cell_len(s) <= width:
        return [s]
    if c.kind == "words":
        return _wrap_words(s, width)
    lines = [""]
    for item in s.split(", "):
        joined = f"{lines[-1]}, {item}" if lines[-1] else item
        if cell_len(joined) + 1 <= width or not lines[-1]:  # + 1: the comma that may follow
            lines[-1] = joined
        else:
            lines[-1] += ","
            lines.append(item)
    return lines


def _wrap_words(s: str, width: int) -> list[str]:
    """``s`` in lines of at most ``width`` cells, broken between words only (a longer word keeps its line)."""
    from rich.cells import cell_len

    lines = [""]
    for w in s.split():
        joined = f"{lines[-1]} {w}" if lines[-1] else w
        if cell_len(joined) <= width or not lines[-1]:
            lines[-1] = joined
        else:
            lines.append(w)
    return lines


def print_fields(console, parts: Sequence[str], *, indent: int = INDENT, styles: Sequence[str] = ()) -> None:
    """One record as words that are never broken (a rule, a file, a key): on one line when they fit,
    else continued on indented lines, each word whole."""
    from rich.cells import cell_len
    from rich.text import Text

    line = Text()
    for i, part in enumerate(parts):
        style = styles[i] if i < len(styles) else ""
        if line and cell_len(line.plain) + 1 + cell_len(part) > console.width:
            console.print(line, overflow="fold")
            line = Text(" " * indent)
        elif line:
            line.append(" ")
        line.append(part, style=style)
    if line:
        console.print(line, overflow="fold")
