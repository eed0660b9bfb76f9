"""`ckpt init-draft TARGET -o OUT`: a dimension-matched MTP draft, from scratch or from a target layer."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, emit_json, out_console
from .gate_options import allow_invalid_option
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
        from .. import api
        from .render import render_plan
        from .write_options import invoked, say_written

        with invoked():
            report = api.init_draft(target, out, arch=arch, num_layers=num_layers, seed=seed, std=std,
                                    from_layer=from_layer, format=fmt, dtype=dtype, dequant=dequant,
                                    max_shard_size=max_shard_size, dry_run=dry_run, plan_json=plan_json,
                                    overwrite=overwrite, allow_invalid=tuple(allow_invalid or ()),
                                    progress=not json_output)
        if json_output:
            emit_json(report.to_json())
            return
        if report.written is None:
            render_plan(report.plan, out_console())
        else:
            say_written(report)
        _say(report.init)


def _say(summary) -> None:
    c = out_console()
    c.print(f"{summary.family} ({summary.table_kind}) draft with {summary.count} MTP layer(s): "
            f"{len(summary.initialised)} tensors initialised (normal std {summary.std:g} from {summary.std_from}), "
            f"{len(summary.copied)} copied from the target")
    if summary.left_out:
        c.print(f"left out (the target has no weights to copy them from; engines use the shared tensors): "
                f"{', '.join(summary.left_out)}")

