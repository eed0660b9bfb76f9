"""`ckpt verify-manifest PATH`: recompute every listed tensor's (or whole shard's) digest (BLAKE3; sha256 in
older manifests); exit 0 all match, 1 mismatches, unlisted tensors or shards not verifiable locally,
3 no manifest (or an unreadable checkpoint)."""

from __future__ import annotations

import typer

from ..api.options import VerifyManifest
from ..errors import EXIT_FOUND
from .common import command, emit_json, human_bytes, out_console, progress_for
from .options import takes

MAX_ROWS = 50  # mismatches listed before "... and N more"


def render(report) -> None:
    from rich.markup import escape

    con = out_console()
    summary = (f"{report.verified} of {report.listed} listed tensor(s) match ({human_bytes(report.bytes_hashed)} "
               f"hashed" + (f", {report.files_verified} shard(s) as whole files" if report.files_verified else "")
               + ")" + (f"; {report.unlisted} tensor(s) not listed in the manifest" if report.unlisted else "")
               + (f"; {report.remote_tensors} tensor(s) in {len(report.remote_files)} shard(s) left on the Hub: not "
                  "verifiable locally" if report.remote_files else ""))
    if report.ok:
        con.print(f"[green]verified[/]: {escape(report.root)}: {summary}", soft_wrap=True)
        return
    for m in report.mismatches[:MAX_ROWS]:
        con.print(f"[bold red]{m.problem}[/] [dim]{escape(m.file or '-')}[/] {escape(m.key)}", soft_wrap=True)
        con.print(f"    manifest {m.expected or '-'}, found {m.actual or '-'}", markup=False, soft_wrap=True)
    if len(report.mismatches) > MAX_ROWS:
        con.print(f"... and {len(report.mismatches) - MAX_ROWS} more (all of them with --json)")
    label = "[red]mismatch[/]" if report.mismatches else "[red]not verified[/]"
    con.print(f"{label}: {escape(report.root)}: {len(report.mismatches)} problem(s); {summary}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("verify-manifest")
    @command
    @takes(VerifyManifest)
    def verify_manifest_cmd(
        path: str = typer.Argument(..., metavar="PATH", help="Output directory with a ckpt_manifest.json."), **o
    ) -> None:
        """Recompute the digest of every tensor (or whole shard) ckpt_manifest.json lists, streaming; every tensor
        of the checkpoint must be listed."""
        from ..ops.check.verify_manifest import verify_manifest

        report = verify_manifest(path, progress=progress_for(o["json"]))
        if o["json"]:
            emit_json(report.to_json())
        else:
            render(report)
        if not report.ok:
            raise typer.Exit(EXIT_FOUND)
