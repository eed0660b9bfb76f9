"""`ckpt extract`: MTP layers into a standalone draft, or the trunk without them."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, emit_json, out_console
from .gate_options import allow_invalid_option
from .write_options import (
    auto_options,
    invoked,
    json_option,
    overwrite_option,
    plan_json_option,
    resume_option,
    say_written,
    threads_option,
)
from .write_options import layers as parse_layers

AUTO = auto_options()

# every scheme table under mappings/quantization/ has a decoder (tests/test_quant_extract.py checks this list)
DEQUANT_HELP = ("bf16 | fp16 | fp32: decode the quantized MTP weights of every scheme in mappings/quantization/ "
                "(block FP8 weight_scale_inv, DeepSeek-V4 FP8 + FP4 experts, compressed-tensors FP8 / INT8 / INT4 / "
                "NVFP4 / MXFP4, ModelOpt FP8 / NVFP4, Quark MXFP4) into this dtype; the config loses "
                "quantization_config. Tensors the source stores unquantized keep their dtype (an F32 router bias "
                "stays F32, as the release and its engines keep it; listed after writing): add --dtype to cast them "
                "too, but for a dtype the family table pins.")


def register(app: typer.Typer) -> None:
    @app.command("extract")
    @command
    def extract(
        src: str = typer.Argument(..., help="Checkpoint directory or hf://org/repo[@rev]."),
        out: str = typer.Option(..., "-o", "--out", help=OUT_HELP),
        arch: str = typer.Option(None, "--arch", help="Table to use instead of detecting the family."),
        layers: str = typer.Option(None, "--layers", help="MTP depths to extract, e.g. 0 or 0,1 (default: all)."),
        fmt: str = typer.Option("native", "--format",
                                help="native | speculators | angelspec | sglang-nextn | gguf (llama.cpp's MTP "
                                     "sidecar; needs --gguf-trunk)"),
        gguf_trunk: str = typer.Option(None, "--gguf-trunk",
                                       help="--format gguf: the trunk GGUF the sidecar goes with (its metadata and "
                                            "vocabulary are copied; its dimensions must be SRC's)."),
        gguf_type: str = typer.Option("f16", "--gguf-type",
                                      help="--format gguf: f32 | f16 | bf16 | q8_0 (norms, 1-D tensors and routers "
                                           "stay F32, as llama.cpp's converter keeps them) | auto (the smallest "
                                           "whose acceptance on --prompts is within --max-drop at every depth)."),
        with_embed: bool = typer.Option(None, "--with-embed/--no-embed",
                                        help="Carry the embedding (per-layer copy, else the shared one)."),
        with_head: bool = typer.Option(None, "--with-head/--no-head", help="Carry the LM head likewise."),
        dtype: str = typer.Option("keep", "--dtype", help="keep | bf16 | fp16 | fp32 (floating tensors; a dtype the "
                                                          "family table pins is kept)."),
        dequant: str = typer.Option(None, "--dequant", help=DEQUANT_HELP),
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
        threads: int = threads_option(),
        prompts: str = AUTO["prompts"],
        max_drop: float = AUTO["max_drop"],
        depth: int = AUTO["depth"],
        max_new_tokens: int = AUTO["max_new_tokens"],
    ) -> None:
        """Extract MTP layers into a draft (native, speculators, angelspec, sglang-nextn) or drop them."""
        from .. import api
        from .render import render_plan

        if fmt == "gguf" or gguf_trunk is not None:
            given = {"--layers": layers, "--with-embed/--no-embed": with_embed, "--with-head/--no-head": with_head,
                     "--dequant": dequant, "--verifier-name": verifier_name, "--plan-json": plan_json,
                     "--dtype": None if dtype == "keep" else dtype, "--drop-mtp": drop_mtp or None,
                     "--resume": resume or None, "--threads": threads}
            _gguf(src, out, fmt, gguf_trunk, gguf_type, arch, dry_run, overwrite, allow_invalid, json_output,
                  [k for k, v in given.items() if v is not None], (prompts, max_drop, depth, max_new_tokens))
            return
        if prompts is not None:
            from ..errors import UsageError

            raise UsageError("--prompts measures for --format gguf --gguf-type auto only", rule="mtp-quant-auto")
        with invoked():
            report = api.extract(src, out, arch=arch, layers=parse_layers(layers), format=fmt, with_embed=with_embed,
                                 with_head=with_head, dtype=dtype, dequant=dequant, drop_mtp=drop_mtp,
                                 verifier_name=verifier_name, max_shard_size=max_shard_size, dry_run=dry_run,
                                 plan_json=plan_json, overwrite=overwrite, resume=resume,
                                 allow_invalid=tuple(allow_invalid or ()), progress=not json_output,
                                 threads=threads)
        if json_output:
            emit_json(report.to_json())
        elif report.written is None:
            render_plan(report.plan, out_console())
        else:
            say_written(report)
            c = out_console()
            for role, key in (report.shared_from_trunk or {}).items():
                c.print(f"{role}: the MTP layer has no per-layer copy; carried the trunk's {key}")
            if report.kept_dtype:
                kept = ", ".join(f"{k} {d}" for k, d in sorted(report.kept_dtype.items()))
                c.print(f"kept as stored (not quantized, or a dtype the table pins): {kept}", soft_wrap=True)


def _gguf(src, out, fmt, trunk, gguf_type, arch, dry_run, overwrite, allow_invalid, json_output, given,
          auto) -> None:
    from .. import api
    from ..errors import UsageError

    if fmt != "gguf" or trunk is None:
        raise UsageError("--format gguf and --gguf-trunk TRUNK.gguf go together")
    if given:
        raise UsageError(f"--format gguf writes every MTP layer as llama.cpp's converter does: {', '.join(given)} "
                         "do not apply (--gguf-type chooses the type)")
    with invoked():
        report = api.extract_gguf(src, out, trunk, gguf_type=gguf_type, arch=arch, dry_run=dry_run,
                                  overwrite=overwrite, allow_invalid=tuple(allow_invalid or ()), prompts=auto[0],
                                  max_drop=auto[1], depth=auto[2], max_new_tokens=auto[3])
    if json_output:
        emit_json(report.to_json())
        return
    c = out_console()
    m = report.manifest
    what = "would write" if report.path is None else f"wrote {report.path} ({report.size:,} bytes)"
    c.print(f"{what}: {len(m['tensors'])} tensors, llama.cpp {m['llama_cpp_arch']}, block_count {m['block_count']}, "
            f"nextn_predict_layers {m['nextn_predict_layers']}, {m['gguf_type']}", soft_wrap=True)
    if "mtp_quant_auto" in m:
        c.print(f"--gguf-type auto: {m['mtp_quant_auto']['chosen']}: {m['mtp_quant_auto']['why']}", soft_wrap=True)
    if report.path is not None:
        c.print(f"serve: llama-server -m {m['trunk']['path']} -md {report.path} --spec-type draft-mtp", soft_wrap=True)
