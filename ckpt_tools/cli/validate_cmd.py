"""`ckpt validate PATH`: every problem, with rule, file and key; exit 0 valid, 1 problems, 3 not a checkpoint."""

from __future__ import annotations

import os

import typer

from ..errors import EXIT_FOUND, UsageError
from .common import command, emit_json, out_console

MAX_PER_RULE = 20  # problems of one rule shown before "... and N more"


def _short(path: str | None, root: str) -> str:
    """A file shown relative to the checkpoint directory when it lies inside."""
    if not path:
        return "-"
    try:
        rel = os.path.relpath(path, root)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def render(report) -> None:
    from rich.markup import escape

    con = out_console()
    what = f"{report.family}, {report.mtp_layers} MTP layer(s); " if report.family else ""
    fmt = f"{report.draft_format} draft; " if report.draft_format else ""
    checked = escape(f"{fmt}{what}{report.files_checked} file(s), {report.tensors_checked} tensor(s) checked"
                     + _how_read(report))
    for n in report.notes:  # not problems: shown either way
        con.print(f"[yellow]note[/] [dim]{n.rule}[/] {escape(n.key or '')}: {escape(n.message)}", soft_wrap=True)
    if report.ok:
        con.print(f"[green]valid[/]: {escape(report.root)} ({checked})")
        return
    shown: dict[str, int] = {}
    for p in report.problems:
        shown[p.rule] = shown.get(p.rule, 0) + 1
        if shown[p.rule] > MAX_PER_RULE:
            continue
        key = f" {p.key}" if p.key else ""
        con.print(f"[bold red]{p.rule}[/] [dim]{escape(_short(p.path, report.root))}[/]{escape(key)}", soft_wrap=True)
        con.print(f"    {p.message}", markup=False, soft_wrap=True)
    for rule, n in shown.items():
        if n > MAX_PER_RULE:
            con.print(f"[bold red]{rule}[/]: ... and {n - MAX_PER_RULE} more (all of them with --json)")
    con.print(f"[red]invalid[/]: {len(report.problems)} problem(s) ({checked})")


def _how_read(report) -> str:
    if report.reader == "safetensors":
        return ""
    notes = "; ".join(report.reader_notes)
    return f"; read with the {report.reader} reader" + (f": {notes}" if notes else "")


PATH_HELP = "Checkpoint directory, one .safetensors file, or hf://org/repo@rev."
ARCH_HELP = "Check against this family's table instead of detecting it."


def register(app: typer.Typer) -> None:
    @app.command("validate")
    @command
    def validate_cmd(
        path: str = typer.Argument(..., metavar="PATH", help=PATH_HELP),
        arch: str | None = typer.Option(None, "--arch", metavar="NAME", help=ARCH_HELP),
        json_output: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    ) -> None:
        """Check format, index and config-vs-tensor rules; report every problem (exit 1 if any)."""
        from ..ops.validate import validate
        from ..tables.loader import all_tables

        if arch is not None and arch not in all_tables():
            raise UsageError(f"--arch {arch!r}: unknown family; known: {', '.join(sorted(all_tables()))}")
        report = validate(path, arch)
        if json_output:
            emit_json(report.to_json())
        else:
            render(report)
        if not report.ok:
            raise typer.Exit(EXIT_FOUND)
