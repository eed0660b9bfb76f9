"""`ckpt fuse-experts` / `ckpt unfuse-experts`: rewrite routed experts in another layout."""

from __future__ import annotations

import typer

from ..api.options import FuseExperts, UnfuseExperts
from .common import command, emit_json, human_bytes, out_console
from .options import takes


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


def _verb(verb: str, options: type, doc: str):
    """The CLI function of one direction; both share every option but the default target."""

    @takes(options)
    def run(src: str = typer.Argument(..., help="Checkpoint or draft directory."), **o) -> None:
        from .. import api
        from .write_options import invoked

        json_output = o.pop("json")
        with invoked():
            report = getattr(api, verb.replace("-", "_"))(src, o.pop("out"), progress=not json_output, **o)
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
        "fuse-experts", FuseExperts,
        "Stack routed experts into one tensor per projection (default: fused gate_up_proj [E, 2I, H]).")))
    app.command("unfuse-experts")(command(_verb(
        "unfuse-experts", UnfuseExperts,
        "Split fused experts apart again (default: per-expert gate_proj / up_proj / down_proj).")))
