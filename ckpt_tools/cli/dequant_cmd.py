"""`ckpt dequant`: a whole checkpoint (or its MTP layers) from any quantization scheme to a float dtype."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, emit_json, human_bytes, out_console
from .gate_options import allow_invalid_option
from .write_options import (
    invoked,
    json_option,
    overwrite_option,
    plan_json_option,
    resume_option,
    say_written,
    threads_option,
)

DTYPE_HELP = ("bf16 | fp16 | fp32: what every quantized module of a scheme in mappings/quantization/ becomes (block "
              "FP8, DeepSeek-V4, compressed-tensors FP8 / INT8 / INT4 / NVFP4 / MXFP4, ModelOpt FP8 / NVFP4, Quark "
              "MXFP4); scales are dropped, every other tensor is copied as it is.")


def _render(report, console) -> None:
    s = report.dequant.summary()
    storage = ", ".join(f"{n} {label}" for label, n in s["storage"].items())
    console.print(f"plan: {s['modules']} module(s) to {s['dtype']} ({storage}); {s['dropped_tensors']} companion "
                  f"tensor(s) dropped; {s['tensors']} tensors, {human_bytes(s['total_bytes'])}; files: "
                  f"{', '.join(s['files']) or '-'}", soft_wrap=True)
    if s["still_quantized"]:
        console.print(f"{s['still_quantized']} quantized module(s) outside the MTP layers stay as stored")
    if "link" in s:
        console.print(f"--link {s['link']}: {s['linked_shards']} shard(s) without MTP tensors carried whole; "
                      f"rewritten without them: {', '.join(s['rewritten_shards']) or '-'}; MTP layers into "
                      f"{', '.join(s['new_shards'])}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("dequant")
    @command
    def dequant(
        src: str = typer.Argument(..., help="Checkpoint directory or hf://org/repo[@rev]."),
        out: str = typer.Option(None, "-o", "--out", help=OUT_HELP),
        dtype: str = typer.Option("bf16", "--dtype", help=DTYPE_HELP),
        only_mtp: bool = typer.Option(False, "--only-mtp",
                                      help="Decode the MTP layers only; the rest is copied and stays quantized."),
        link: str = typer.Option(None, "--link",
                                 help="With --only-mtp: the shards holding no MTP tensor carried whole, copy | "
                                      "reflink | hardlink | remote (an hf:// source's shards stay on the Hub); the "
                                      "decoded MTP layers go into new model-mtp* shards. Without --link every "
                                      "tensor is copied into new shards (a release's whole trunk)."),
        arch: str = typer.Option(None, "--arch", help="Table to use instead of detecting the family."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="e.g. 500MB, 5GB (at most 50GB)."),
        threads: int = threads_option(),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; write nothing."),
        plan_json: Path = plan_json_option(),
        overwrite: bool = overwrite_option(),
        resume: bool = resume_option(),
        json_output: bool = json_option(),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        """Dequantize a whole checkpoint (or its MTP layers) to bf16 / fp16 / fp32; quantization_config removed."""
        from .. import api

        with invoked():
            report = api.dequant(src, out, dtype=dtype, only_mtp=only_mtp, link=link, arch=arch,
                                 max_shard_size=max_shard_size,
                                 dry_run=dry_run, plan_json=plan_json, overwrite=overwrite, resume=resume,
                                 threads=threads, allow_invalid=tuple(allow_invalid or ()), progress=not json_output)
        if json_output:
            emit_json(report.to_json())
        elif report.written is None:
            _render(report, out_console())
        else:
            say_written(report)
            s = report.dequant.summary()
            out_console().print(f"{s['modules']} module(s) decoded to {s['dtype']} on {report.threads} thread(s); "
                                f"{s['dropped_tensors']} scale/companion tensor(s) dropped"
                                + (f"; {s['still_quantized']} module(s) stay quantized" if s["still_quantized"]
                                   else "; no quantization_config"), soft_wrap=True)
