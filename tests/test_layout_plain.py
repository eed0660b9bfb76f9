"""A stacked table (each key on its own line, its cells below) printed to a pipe: the same text as rich prints, and
for a release's plan (~1,600 rows) without a rich Text per line."""

from __future__ import annotations

import io

import pytest
import rich.text
from rich.console import Console

from ckpt_tools.cli import layout
from ckpt_tools.cli.layout import Col, print_table

COLS = [Col("tensor", "id"), Col("dtype", "id"), Col("shape", "id"), Col("bytes", "id", "right"), Col("recipe")]


def _rows(keys: list[str]) -> list[list[str]]:
    return [[k, "F8_E4M3", f"[{i + 1}, 7168]", f"{(i + 1) * 7168:,}", "copy"] for i, k in enumerate(keys)]


def _printed(rows: list[list[str]], plain: bool) -> str:
    out = io.StringIO()
    console = Console(file=out, width=48, highlight=False)
    if not plain:  # rich itself prints every line (what the plain path must equal)
        console.record = True
    print_table(console, COLS, rows, title="plan: ckpt extract")
    return out.getvalue()


@pytest.mark.parametrize("keys", [
    [f"model.layers.61.mlp.experts.{i}.down_proj.weight" for i in range(3)],
    ["k", "model.layers.61.mlp.experts.255.down_proj.weight_scale_inv.and.longer"],  # wider than the console: folded
    ["model.layers.61.ä.weight", "tab\there"],  # not printable ASCII: rich's own path
])
def test_stacked_table_prints_what_rich_prints(keys):
    assert _printed(_rows(keys), plain=True) == _printed(_rows(keys), plain=False)


def test_a_release_plan_makes_no_rich_text_per_line(monkeypatch):
    made = []

    class Counted(rich.text.Text):
        def __init__(self, *a, **k):
            made.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(rich.text, "Text", Counted)
    rows = _rows([f"model.layers.61.mlp.experts.{i}.w" for i in range(1600)])
    text = _printed(rows, plain=True)
    assert text.count("\n") == 3 + 2 * 1600  # title, key header, cell headers; a key and its cells per row
    assert len(made) < 100, f"{len(made)} rich Text objects"  # rich path: two or more a row
    assert layout._plain_fits(Console(file=io.StringIO(), width=48), ["x" * 48])
