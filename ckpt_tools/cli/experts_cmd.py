"""`ckpt fuse-experts` / `ckpt unfuse-experts`: rewrite routed experts in another layout."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, emit_json, human_bytes, out_console
from .gate_options import allow_invalid_option
from .write_options import json_option, overwrite_option, plan_json_option, threads_option

LAYOUT_HELP = (
    "per-expert | fused | stacked | stacked-transposed | fused-transposed, with options after ':' "
    "(fused:up-first, fused-transposed:interleaved)"
)


def _render(xplan, console) -> None:
    from rich.table import Table

    table = Table(title=f"plan: {xplan.plan.command}")
    for col in ("scope", "expert group", "layout", "tensors", "recipes", "bytes"):
        table.add_column(col, overflow="fold")
    for g in xplan.groups:
        ops = ", ".join(f"{n} {op}" for op, n in sorted(g.ops().items()))
        table.add_row(g.scope, g.prefix, f"{g.source.label()} -> {g.target.label()}",
                      f"{len(g.source_keys)} -> {len(g.tensors)}", ops, human_bytes(sum(t.nbytes for t in g.tensors)))
    console.print(table)
    s = xplan.summary()
    others = s["tensors"] - sum(len(g.tensors) for g in xplan.groups)
    console.print(f"{len(xplan.groups)} expert group(s){' (draft: MTP only)' if xplan.draft else ''}; "
                  f"{others} other tensor(s) copied; {s['tensors']} tensors, {human_bytes(s['total_bytes'])} in "
                  f"{len(s['shards'])} shard(s); files: {', '.join(s['files']) or '-'}")


def _say(report, console) -> None:
    """What a run wrote: the groups now in the target layout, and how the bytes were made."""
    w = report.written
    changed = sum(1 for g in report.experts.groups if g.source != g.target)
    console.print(
        f"wrote {w.tensors} tensors ({human_bytes(w.tensor_bytes)}) to {w.output} in {w.seconds} s: {changed} of "
        f"{len(report.experts.groups)} expert group(s) now {report.layout}; {human_bytes(report.bytes_copied)} "
        f"copied by range, {human_bytes(report.bytes_computed)} computed" + ("; validated" if report.validation else "")
    )


def _verb(verb: str, default_to: str, doc: str):
    """The CLI function of one direction; both share every option but the default target."""

    def run(
        src: str = typer.Argument(..., help="Checkpoint or draft directory."),
        out: str = typer.Option(None, "-o", "--out", help=OUT_HELP),
        to: str = typer.Option(default_to, "--to", help=LAYOUT_HELP),
        only_mtp: bool = typer.Option(False, "--only-mtp", help="Convert the MTP layers' experts only."),
        arch: str = typer.Option(None, "--arch", help="Table to use instead of detecting the family."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="e.g. 500MB, 5GB (at most 50GB)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; write nothing."),
        plan_json: Path = plan_json_option(),
        json_output: bool = json_option(),
        overwrite: bool = overwrite_option(),
        dequant: str = typer.Option(None, "--dequant",
                                    help="Dequantize quantized weights to bf16 | fp16 | fp32 (scales dropped)."),
        allow_invalid: list[str] = allow_invalid_option(),
        threads: int = threads_option(),
    ) -> None:
        from .. import api
        from .write_options import invoked

        with invoked():
            report = getattr(api, verb.replace("-", "_"))(
                src, out, to=to, only_mtp=only_mtp, arch=arch, max_shard_size=max_shard_size, dry_run=dry_run,
                plan_json=plan_json, overwrite=overwrite, dequant=dequant, allow_invalid=tuple(allow_invalid or ()),
                progress=not json_output, threads=threads)
        if json_output:
            emit_json(report.to_json())
        elif report.written is None:
            _render(report.experts, out_console())
        else:
            _say(report, out_console())

    run.__doc__ = doc
    run.__name__ = verb.replace("-", "_")
    return run


def register(app: typer.Typer) -> None:
    app.command("fuse-experts")(command(_verb(
        "fuse-experts", "fused",
        "Stack routed experts into one tensor per projection (default: fused gate_up_proj [E, 2I, H]).")))
    app.command("unfuse-experts")(command(_verb(
        "unfuse-experts", "per-expert",
        "Split fused experts apart again (default: per-expert gate_proj / up_proj / down_proj).")))
