"""`ckpt graft SOURCE TARGET -o OUT`: a converted checkpoint that lost its MTP gets it back from the release."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, emit_json, out_console
from .gate_options import allow_invalid_option
from .write_options import (
    all_tensors_option,
    auto_options,
    invoked,
    json_option,
    overwrite_option,
    plan_json_option,
    report_option,
    resume_option,
    say_shards_written,
)

# the scheme tables whose storage names an encoder (ops.stitch.graft.mtp_quants(); tests/test_quant_encode.py keeps this
# list equal to the shipped tables', read without loading them at start-up)
MTP_QUANTS = " | ".join(("ct-fp8", "ct-int8", "ct-mxfp4", "ct-nvfp4", "ct-pack", "deepseek-v4", "fp8-block",
                         "modelopt-fp8", "modelopt-nvfp4"))
MTP_QUANT_HELP = (f"{MTP_QUANTS} | auto (every scheme table whose storage names an encoder, registered ones included): "
                  "the linear weights the family table marks quantizable in that scheme (a target whose config "
                  "declares it); the other MTP tensors as --mtp-dtype says, else as the source stores them; auto: "
                  "the smallest scheme the target declares whose acceptance on --prompts is within --max-drop at "
                  "every depth, else as stored")
AUTO = auto_options()


def register(app: typer.Typer) -> None:
    @app.command("graft")
    @command
    def graft(
        source: str = typer.Argument(..., help="Checkpoint with MTP (the original release) or hf://org/repo[@rev]."),
        target: str = typer.Argument(..., help="Quantized / converted checkpoint whose MTP is missing or mangled."),
        out: str = typer.Option(..., "-o", "--out", help=OUT_HELP),
        mtp_dtype: str = typer.Option(None, "--mtp-dtype",
                                      help="bf16 | fp32 | fp16: MTP values in this dtype (quantized ones dequantized); "
                                           "with --mtp-quant, every MTP tensor that option does not encode; a dtype "
                                           "the family table pins is kept; default: as the source stores them"),
        mtp_quant: str = typer.Option(None, "--mtp-quant",
                                      help=MTP_QUANT_HELP),
        link: str = typer.Option("copy", "--link",
                                 help="Untouched shards: copy | reflink | hardlink | remote (an hf:// target's "
                                      "shards stay on the Hub)"),
        arch: str = typer.Option(None, "--arch", help="Family table for both inputs instead of detecting it."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="For the new MTP shards."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Plan, print the report, write nothing."),
        plan_json: Path = plan_json_option(),
        report_file: Path = report_option(),
        overwrite: bool = overwrite_option(),
        resume: bool = resume_option(),
        show_all: bool = all_tensors_option(),
        json_output: bool = json_option(),
        allow_invalid: list[str] = allow_invalid_option(),
        prompts: str = AUTO["prompts"],
        max_drop: float = AUTO["max_drop"],
        depth: int = AUTO["depth"],
        max_new_tokens: int = AUTO["max_new_tokens"],
    ) -> None:
        """Graft the source's MTP layers into a target that lost them: config count and quantization config repaired."""
        from .. import api
        from .quant_render import say_config_changes
        from .summary import render_diffs

        with invoked():
            result = api.graft(source, target, out, mtp_dtype=mtp_dtype, mtp_quant=mtp_quant, link=link, arch=arch,
                               max_shard_size=max_shard_size, dry_run=dry_run, plan_json=plan_json,
                               report=report_file, overwrite=overwrite, resume=resume,
                               allow_invalid=tuple(allow_invalid or ()), progress=not json_output,
                               prompts=prompts, max_drop=max_drop, depth=depth, max_new_tokens=max_new_tokens)
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
