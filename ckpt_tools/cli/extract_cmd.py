"""`ckpt extract`: MTP layers into a standalone draft, or the trunk without them."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, command_line, emit_json, out_console, output_arg, progress_for
from .gate_options import allow_invalid_option, allowed_rules, say_allowed
from .write_options import json_option, overwrite_option, plan_json_option, resume_option


def _layers(text: str | None) -> list[int] | None:
    """--layers: MTP depths, each below the MTP bound, none twice (extract and stitch)."""
    if text is None:
        return None
    from ..model.tables.resolve import MAX_MTP_LAYERS
    from ..options import index_list

    return index_list("--layers", text, MAX_MTP_LAYERS - 1)


def register(app: typer.Typer) -> None:
    @app.command("extract")
    @command
    def extract(
        src: str = typer.Argument(..., help="Checkpoint directory or hf://org/repo[@rev]."),
        out: str = typer.Option(..., "-o", "--out", help=OUT_HELP),
        arch: str = typer.Option(None, "--arch", help="Table to use instead of detecting the family."),
        layers: str = typer.Option(None, "--layers", help="MTP depths to extract, e.g. 0 or 0,1 (default: all)."),
        fmt: str = typer.Option("native", "--format", help="native | speculators | angelspec | sglang-nextn"),
        with_embed: bool = typer.Option(None, "--with-embed/--no-embed",
                                        help="Carry the embedding (per-layer copy, else the shared one)."),
        with_head: bool = typer.Option(None, "--with-head/--no-head", help="Carry the LM head likewise."),
        dtype: str = typer.Option("keep", "--dtype", help="keep | bf16 | fp16 | fp32 (floating tensors)."),
        dequant: str = typer.Option(None, "--dequant", help="Dequantize FP8 block weights to bf16 / fp32."),
        drop_mtp: bool = typer.Option(False, "--drop-mtp",
                                      help="Write the trunk: everything but MTP, count 0 (mtp-* rules do not block)."),
        verifier_name: str = typer.Option(None, "--verifier-name",
                                          help="How the draft config names its verifier (default: the Hub id "
                                               "of an hf:// or Hub-cache source, else SRC as given)."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="e.g. 500MB, 5GB (at most 50GB)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; write nothing."),
        plan_json: Path = plan_json_option(),
        overwrite: bool = overwrite_option(),
        resume: bool = resume_option(),
        json_output: bool = json_option(),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        """Extract MTP layers into a draft (native, speculators, angelspec, sglang-nextn) or drop them."""
        from ..io.checkpoint import Checkpoint
        from ..ops.extract import ExtractRequest, plan_extract
        from ..ops.validate import validate_output
        from ..stream.plan import parse_size
        from .render import render_plan, report_write

        allow = allowed_rules(allow_invalid)
        dest = output_arg(out)
        req = ExtractRequest(
            arch=arch, layers=_layers(layers), format=fmt, with_embed=with_embed, with_head=with_head,
            dtype=dtype, dequant=dequant, drop_mtp=drop_mtp, max_shard_size=parse_size(max_shard_size),
            command=command_line(), source=src, verifier_name=verifier_name, allow_invalid=allow,
        )
        progress_for(json_output).phase("reading headers")
        with Checkpoint.open(src) as ckpt:
            progress_for(json_output).phase("planning")
            plan = plan_extract(ckpt, req)
            say_allowed(plan.manifest.get("allowed_invalid"))
            if plan_json is not None:
                plan.write_json(plan_json)
            if dry_run:
                if json_output:
                    emit_json(plan.to_json())
                else:
                    render_plan(plan, out_console())
                return
            from ..stream.execute import execute

            validation: dict = {}
            result = execute(plan, dest, overwrite=overwrite, resume=resume, progress=progress_for(json_output),
                             check=lambda path, pending: validation.update(validate_output(path, allow=allow,
                                                                                           pending=pending)))
            bytes_read = result.bytes_read
        from_trunk = plan.manifest.get("shared_from_trunk")
        extra = {"format": fmt, **({"shared_from_trunk": from_trunk} if from_trunk is not None else {})}
        report_write(plan, result, json_output, bytes_read=bytes_read, extra=extra, validation=validation)
        if not json_output:
            for role, key in (from_trunk or {}).items():
                out_console().print(f"{role}: the MTP layer has no per-layer copy; carried the trunk's {key}")
