"""`ckpt dequant`: a whole checkpoint (or its MTP layers) from any quantization scheme to a float dtype."""

from __future__ import annotations

import typer

from ..api.options import Dequant
from .common import command, emit_json, human_bytes, out_console
from .options import takes
from .write_options import invoked, say_written


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
    @takes(Dequant)
    def dequant(src: str = typer.Argument(..., help="Checkpoint directory or hf://org/repo[@rev]."), **o) -> None:
        """Dequantize a whole checkpoint (or its MTP layers) to bf16 / fp16 / fp32; quantization_config removed."""
        from .. import api

        json_output = o.pop("json")
        with invoked():
            report = api.dequant(src, o.pop("out"), progress=not json_output, **o)
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
