"""`ckpt fuse-experts` / `ckpt unfuse-experts`: rewrite routed experts in another layout."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, command_line, emit_json, human_bytes, out_console, output_arg, progress_for
from .gate_options import allow_invalid_option, allowed_rules, say_allowed
from .write_options import json_option, overwrite_option, plan_json_option

LAYOUT_HELP = (
    "per-expert | fused | stacked | stacked-transposed | fused-transposed, with options after ':' "
    "(fused:up-first, fused-transposed:interleaved)"
)
# fuse: one tensor per projection (or gate+up); unfuse: gate and up apart again
FUSE_TARGETS = ("fused", "stacked", "stacked-transposed", "fused-transposed")
UNFUSE_TARGETS = ("per-expert", "stacked", "stacked-transposed")


def _layout(text: str, verb: str, allowed: tuple[str, ...]):
    from ..errors import UsageError
    from ..model.expert_layouts import ExpertLayout

    try:
        layout = ExpertLayout.parse(text)
    except ValueError as e:
        raise UsageError(f"--to {text!r}: {e}") from None
    if layout.name not in allowed:
        other = "unfuse-experts" if verb == "fuse-experts" else "fuse-experts"
        raise UsageError(f"{verb} --to {text!r}: {verb} writes {' | '.join(allowed)}; use `ckpt {other}` for "
                         f"{layout.name}")
    return layout


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


def _run(verb: str, allowed: tuple[str, ...], src: str, out: str | None, to: str, only_mtp: bool, arch: str | None,
         max_shard_size: str, dry_run: bool, plan_json: Path | None, json_output: bool, overwrite: bool,
         dequant: str | None = None, allow_invalid: list[str] | None = None) -> None:
    from ..errors import UsageError
    from ..io.checkpoint import Checkpoint
    from ..ops.experts import ExpertsRequest, plan_experts, stats
    from ..ops.validate import validate_output
    from ..stream.plan import parse_size

    layout = _layout(to, verb, allowed)
    allow = allowed_rules(allow_invalid)
    if out is None and not dry_run:
        raise UsageError(f"{verb} needs -o OUT (or --dry-run)")
    req = ExpertsRequest(layout, only_mtp=only_mtp, arch=arch, max_shard_size=parse_size(max_shard_size),
                         command=command_line(), dequant=dequant, allow_invalid=allow)
    progress_for(json_output).phase("reading headers")
    with Checkpoint.open(src) as ckpt:
        progress_for(json_output).phase("planning")
        xplan = plan_experts(ckpt, req)
        say_allowed(xplan.plan.manifest.get("allowed_invalid"))
        if plan_json is not None:
            xplan.plan.write_json(plan_json)
        if dry_run:
            if json_output:
                emit_json({**xplan.summary(), "plan": xplan.plan.to_json()})
            else:
                _render(xplan, out_console())
            return
        from ..stream.execute import execute

        report: dict = {}
        result = execute(xplan.plan, output_arg(out), overwrite=overwrite, progress=progress_for(json_output),
                         check=lambda path, pending: report.update(validate_output(path, arch=arch, allow=allow,
                                                                                   pending=pending)))
    summary = {
        "output": str(result.out_dir),
        "layout": layout.label(),
        "groups": [g.to_json() for g in xplan.groups],
        "tensors": len(xplan.plan.tensors),
        "bytes_written": result.bytes_written,
        "bytes_read": result.bytes_read,
        **stats(xplan),
        "files": result.files,
        "seconds": round(result.seconds, 3),
        "validated": bool(report),
    }
    if json_output:
        emit_json(summary)
        return
    changed = sum(1 for g in xplan.groups if g.source != g.target)
    out_console().print(
        f"wrote {summary['tensors']} tensors ({human_bytes(xplan.plan.total_bytes)}) to {result.out_dir} in "
        f"{summary['seconds']} s: {changed} of {len(xplan.groups)} expert group(s) now {layout.label()}; "
        f"{human_bytes(summary['bytes_copied'])} copied by range, {human_bytes(summary['bytes_computed'])} computed"
        + ("; validated" if report else "")
    )


def _verb(verb: str, allowed: tuple[str, ...], default_to: str, doc: str):
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
                                    help="Dequantize FP8 block weights to bf16 | fp16 | fp32 (scales dropped)."),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        _run(verb, allowed, src, out, to, only_mtp, arch, max_shard_size, dry_run, plan_json, json_output,
             overwrite, dequant, allow_invalid)

    run.__doc__ = doc
    run.__name__ = verb.replace("-", "_")
    return run


def register(app: typer.Typer) -> None:
    app.command("fuse-experts")(command(_verb(
        "fuse-experts", FUSE_TARGETS, "fused",
        "Stack routed experts into one tensor per projection (default: fused gate_up_proj [E, 2I, H]).")))
    app.command("unfuse-experts")(command(_verb(
        "unfuse-experts", UNFUSE_TARGETS, "per-expert",
        "Split fused experts apart again (default: per-expert gate_proj / up_proj / down_proj).")))
