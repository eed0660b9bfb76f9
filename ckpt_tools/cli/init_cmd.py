"""`ckpt init-draft TARGET -o OUT`: a dimension-matched MTP draft, from scratch or from a target layer."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, command_line, emit_json, out_console, output_arg, progress_for
from .gate_options import allow_invalid_option, allowed_rules, say_allowed
from .write_options import json_option, overwrite_option, plan_json_option


def register(app: typer.Typer) -> None:
    @app.command("init-draft")
    @command
    def init_draft(
        target: str = typer.Argument(..., help="Target checkpoint directory, its config.json, or hf://org/repo[@rev]."),
        out: str = typer.Option(..., "-o", "--out", help=OUT_HELP),
        arch: str = typer.Option(None, "--arch", help="Table (family or template) instead of detecting it."),
        num_layers: int = typer.Option(None, "--num-layers", help="MTP layers (default: the config's count, else 1)."),
        seed: int = typer.Option(0, "--seed", help="Values are a function of (seed, tensor name) only."),
        std: float = typer.Option(None, "--std", help="Std of normal projections (default: initializer_range, "
                                                      "else 0.02)."),
        from_layer: int = typer.Option(None, "--from-layer",
                                       help="Copy the target's decoder layer L as the block; init only the glue."),
        fmt: str = typer.Option("native", "--format", help="native | speculators | angelspec | sglang-nextn"),
        dtype: str = typer.Option("keep", "--dtype", help="keep (the table's / config's dtypes) | bf16 | fp16 | fp32"),
        dequant: str = typer.Option(None, "--dequant", help="FP8 --from-layer: dequantize to bf16 / fp32."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="e.g. 500MB, 5GB (at most 50GB)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; write nothing."),
        plan_json: Path = plan_json_option(),
        overwrite: bool = overwrite_option(),
        json_output: bool = json_option(),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        """Create an MTP draft whose dimensions match TARGET: from scratch, or warm-started from one of its layers."""
        from ..io.checkpoint import Checkpoint
        from ..ops.init_draft import InitRequest, check_request, plan_init
        from ..ops.validate import validate_output
        from ..stream.plan import parse_size
        from .render import render_plan, report_write

        allow = allowed_rules(allow_invalid)
        dest = output_arg(out)
        req = InitRequest(arch=arch, num_layers=num_layers, seed=seed, std=std, from_layer=from_layer, format=fmt,
                          dtype=dtype, dequant=dequant, max_shard_size=parse_size(max_shard_size),
                          command=command_line(), allow_invalid=allow)
        check_request(req)  # before the target is opened
        progress_for(json_output).phase("reading headers")
        with Checkpoint.open(target) as ckpt:
            progress_for(json_output).phase("planning")
            plan, summary = plan_init(ckpt, req)
            say_allowed(plan.manifest.get("allowed_invalid"))
            if plan_json is not None:
                plan.write_json(plan_json)
            if dry_run:
                if json_output:
                    emit_json({**plan.to_json(), "init": summary.to_json()})
                else:
                    render_plan(plan, out_console())
                    _say(summary)
                return
            from ..stream.execute import execute

            validation: dict = {}  # an invalid output is an output error (exit 4), left without its marker
            result = execute(plan, dest, overwrite=overwrite, progress=progress_for(json_output),
                             check=lambda path, pending: validation.update(validate_output(path, allow=allow,
                                                                                           pending=pending)))
        bytes_read = result.bytes_read
        report_write(plan, result, json_output, bytes_read=bytes_read,
                     extra={"format": fmt, "init": summary.to_json()}, validation=validation)
        if not json_output:
            _say(summary)


def _say(summary) -> None:
    c = out_console()
    c.print(f"{summary.family} ({summary.table_kind}) draft with {summary.count} MTP layer(s): "
            f"{len(summary.initialised)} tensors initialised (normal std {summary.std:g} from {summary.std_from}), "
            f"{len(summary.copied)} copied from the target")
    if summary.left_out:
        c.print(f"left out (the target has no weights to copy them from; engines use the shared tensors): "
                f"{', '.join(summary.left_out)}")

