"""`ckpt graft SOURCE TARGET -o OUT`: a converted checkpoint that lost its MTP gets it back from the release."""

from __future__ import annotations

import typer

from ..api.options import Graft
from .common import command, emit_json, out_console
from .options import takes
from .write_options import invoked, say_shards_written


def register(app: typer.Typer) -> None:
    @app.command("graft")
    @command
    @takes(Graft)
    def graft(
        source: str = typer.Argument(..., help="Checkpoint with MTP (the original release) or hf://org/repo[@rev]."),
        target: str = typer.Argument(..., help="Quantized / converted checkpoint whose MTP is missing or mangled."),
        **o,
    ) -> None:
        """Graft the source's MTP layers into a target that lost them: config count and quantization config repaired."""
        from .. import api
        from .summary import render_diffs
        from .write_options import say_config_changes

        out, json_output, show_all, dry_run = o.pop("out"), o.pop("json"), o.pop("all"), o["dry_run"]
        with invoked():
            result = api.graft(source, target, out, progress=not json_output, **o)
        if json_output:
            emit_json(result.to_json())
            return
        report = result.details
        hint = "--all or graft-report.json lists every key" if not dry_run else "--all or --json lists every key"
        render_diffs(report.diffs, report.totals(), show_all, title=f"graft ({report.family}, MTP {report.storage})",
                     more_hint=hint)
        c = out_console()
        n = report.count
        c.print(f"MTP count ({n['field']}): {n['before']} -> {n['after']}")
        if report.mtp_quant_auto is not None:
            c.print(f"--mtp-quant auto: {report.mtp_quant_auto['chosen']}: {report.mtp_quant_auto['why']}",
                    soft_wrap=True)
        say_config_changes(report.quant_config)
        if not dry_run:
            say_shards_written(out, report)
