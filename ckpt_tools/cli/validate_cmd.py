"""`ckpt validate PATH`: every problem, with rule, file and key; exit 0 valid, 1 problems, 3 not a checkpoint.

`ckpt validate --fix-quant-config PATH -o OUT` writes PATH with only its quantization config
repaired (ops/convert/fix_quant_config.py); exit 0 when written or when nothing needs fixing, 3 when a config
change cannot fix it.
"""

from __future__ import annotations

import os

import typer

from ..api.options import Validate
from .common import command, emit_json, out_console
from .inspect_cmd import PATH_HELP
from .options import takes

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

    from .layout import print_fields

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
        print_fields(con, [p.rule, _short(p.path, report.root), *([p.key] if p.key else [])],
                     styles=("bold red", "dim"))
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


def register(app: typer.Typer) -> None:
    @app.command("validate")
    @command
    @takes(Validate)
    def validate_cmd(path: str = typer.Argument(..., metavar="PATH", help=PATH_HELP), **o) -> None:
        """Check format, index and config-vs-tensor rules; report every problem (exit 1 if any)."""
        from .. import api
        from ..errors import CheckFailed

        json_output, gguf_trunk = o.pop("json"), o.pop("gguf_trunk")
        fix_quant_config, dry_run = o["fix_quant_config"], o["dry_run"]
        if path.endswith(".gguf") or gguf_trunk is not None:  # llama.cpp's format (ops/check/gguf.py)
            if o["engine"] is not None or fix_quant_config:
                from ..errors import UsageError

                raise UsageError("a GGUF is checked against the tables (and --gguf-trunk) only: --engine and "
                                 "--fix-quant-config apply to safetensors checkpoints")
            from .gguf_render import show_validate

            try:
                show_validate(api.validate_gguf(path, trunk=gguf_trunk, arch=o["arch"]), json_output)
            except CheckFailed as e:
                show_validate(e.report, json_output)
                raise typer.Exit(e.exit_code) from None
            return

        try:
            report = api.validate(path, progress=not json_output, **o)
        except CheckFailed as e:  # problems: the report as for a valid checkpoint, then exit 1
            _show(e.report, json_output, fix_quant_config, dry_run)
            raise typer.Exit(e.exit_code) from None
        _show(report, json_output, fix_quant_config, dry_run)


def _show(report, json_output: bool, fix_quant_config: bool, dry_run: bool) -> None:
    if json_output:
        emit_json(report.to_json())
    elif fix_quant_config:
        render_fix(report, dry_run)
    else:
        render(report)


def render_fix(report, dry_run: bool) -> None:
    from rich.markup import escape

    con = out_console()
    if report.status == "nothing-to-fix":
        con.print(f"[green]nothing to fix[/]: {escape(report.path)} declares every MTP module as it is stored "
                  f"({escape(report.scheme or 'no quantization')}); nothing was written")
        return
    con.print(f"quantization config of {escape(report.path)} ({escape(report.scheme or '-')}): "
              f"{len(report.repair.fixed)} finding(s) repaired")
    render_diff(report.diff)
    if dry_run:
        con.print("[yellow]dry run[/]: nothing was written")
    else:
        con.print(f"[green]wrote[/] {escape(report.out)}: changed {', '.join(report.changed_files)}; "
                  f"{len(report.linked_files)} shard(s) and {len(report.carried_files)} other file(s) by "
                  f"{report.link}, unchanged; validated")


def render_diff(diff: list[dict]) -> None:
    """Per file and field: the entries added (+) and removed (-), MAX_PER_RULE of each at most."""
    con = out_console()
    for d in diff:
        con.print(f"  {d['file']}: {d['field']} (+{len(d['added'])} -{len(d['removed'])})", markup=False)
        for sign, entries, style in (("-", d["removed"], "red"), ("+", d["added"], "green")):
            for x in entries[:MAX_PER_RULE]:
                con.print(f"    {sign} {x}", markup=False, style=style)
            if len(entries) > MAX_PER_RULE:
                con.print(f"    {sign} ... and {len(entries) - MAX_PER_RULE} more (all of them with --json)",
                          markup=False, style=style)
        if "before" in d:
            con.print(f"    {d['before']!r} -> {d['after']!r}", markup=False)
