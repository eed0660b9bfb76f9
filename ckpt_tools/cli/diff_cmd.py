"""`ckpt diff A B`: which tensors, config keys and side files differ; exit 0 identical, 1 different."""

from __future__ import annotations

import typer

from ..api.options import Diff
from .common import command, emit_json, out_console, say_allowed
from .options import takes


def register(app: typer.Typer) -> None:
    @app.command("diff")
    @command
    @takes(Diff)
    def diff_cmd(
        a: str = typer.Argument(..., help="First checkpoint (before)."),
        b: str = typer.Argument(..., help="Second checkpoint (after)."),
        **o,
    ) -> None:
        """Compare two checkpoints key by key (streaming; memory stays bounded), and their config.json and
        side files (tokenizer, generation config, chat template...). Exit 1 on any difference."""
        from .. import api
        from ..errors import CheckFailed

        json_output = o.pop("json")
        try:
            report = api.diff(a, b, progress=not json_output, **o)
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
    for line in _other_lines(report):
        out_console().print(line, markup=False, soft_wrap=True)


MAX_CHANGES = 40  # config / file JSON changes shown without --all


def _other_lines(report) -> list[str]:
    """config.json, side files and input problems, after the tensor table."""
    lines: list[str] = []
    cfg = report.config
    if cfg is not None and cfg.status != "absent":
        lines.append(f"config.json: {cfg.status}" + (f" ({len(cfg.changes)} change(s))" if cfg.changes else "")
                     + (f" ({cfg.note})" if cfg.note else ""))
        lines += _changes(cfg.changes, report.all_keys)
    for f in report.files:
        if not f.counted:
            state = {"added": "b only", "removed": "a only"}.get(f.status, f.status)
            lines.append(f"not compared: {f.name} ({state}; this tool's record of commands, times and inputs)")
        elif f.status != "unchanged" or report.all_keys:
            lines.append(f"{f.status} {f.name}" + (f" ({f.note})" if f.note else ""))
            lines += _changes(f.changes or [], report.all_keys)
    counted = [f for f in report.files if f.counted]
    if counted:
        changed = len(report.changed_files())
        lines.append(f"files: {len(counted)} compared, " + (f"{changed} differ" if changed else "all identical"))
    for p in report.problems:
        key = f"{p['key']}: " if p.get("key") else ""
        lines.append(f"problem ({p['side']}): {p['path'] or ''}: [{p['rule']}] {key}{p['message']}")
    if report.problems:
        lines.append("input problems count as differences; `ckpt validate PATH` lists every problem")
    return lines


def _changes(changes: list[dict], show_all: bool) -> list[str]:
    from ..ops.diff.json_diff import describe

    shown = changes if show_all else changes[:MAX_CHANGES]
    out = [f"  {describe(c)}" for c in shown]
    if len(changes) > len(shown):
        out.append(f"  ... and {len(changes) - len(shown)} more (--all or --json lists them)")
    return out


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
