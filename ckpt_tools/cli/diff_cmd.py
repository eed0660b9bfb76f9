"""`ckpt diff A B`: which tensors differ, with statistics; exit 0 identical, 1 different."""

from __future__ import annotations

import typer

from .common import command, emit_json, out_console
from .gate_options import allow_invalid_option, say_allowed
from .write_options import json_option


def register(app: typer.Typer) -> None:
    @app.command("diff")
    @command
    def diff_cmd(
        a: str = typer.Argument(..., help="First checkpoint (before)."),
        b: str = typer.Argument(..., help="Second checkpoint (after)."),
        keys: str = typer.Option(None, "--keys", help="Only keys matching this regular expression."),
        stats: bool = typer.Option(False, "--stats", help="max |delta|, relative L2 and cosine per changed key."),
        dequant: bool = typer.Option(False, "--dequant", help="Compare FP8 block weights by dequantized value."),
        show_all: bool = typer.Option(False, "--all", help="List every key, unchanged ones too (no row limit)."),
        json_output: bool = json_option(),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        """Compare two checkpoints key by key (streaming; memory stays bounded)."""
        from .. import api
        from ..errors import CheckFailed

        try:
            report = api.diff(a, b, keys=keys, stats=stats, dequant=dequant, all=show_all,
                              allow_invalid=allow_invalid or (), progress=not json_output)
        except CheckFailed as e:  # they differ: shown like identical ones, exit 1
            _show(e.report, json_output)
            raise typer.Exit(e.exit_code) from None
        _show(report, json_output)


def _show(report, json_output: bool) -> None:
    say_allowed(report.allowed_invalid)
    if json_output:
        emit_json(report.to_json())
        return
    _say_how_read(report)
    from .summary import render_diffs

    render_diffs(report.diffs, report.totals(), report.all_keys, more_hint="--all or --json lists every key")


def _say_how_read(report) -> None:
    """A line per side not read as safetensors as stored: its reader and notes, the prefix stripped."""
    for side, r in report.readers.items():
        parts = []
        if r["reader"] != "safetensors":
            notes = "; ".join(r["reader_notes"])
            parts.append(f"read with the {r['reader']} reader" + (f" ({notes})" if notes else ""))
        if r["prefix_stripped"]:
            parts.append(f"compared without the prefix {r['prefix_stripped']!r} every key carries")
        if parts:
            out_console().print(f"{side} ({getattr(report, side)}): " + "; ".join(parts), markup=False,
                                soft_wrap=True)
