"""`ckpt extract`: MTP layers into a standalone draft, or the trunk without them."""

from __future__ import annotations

import typer

from ..api.options import Extract, declared
from .common import command, emit_json, out_console
from .options import takes
from .write_options import invoked, say_written
from .write_options import layers as parse_layers


def register(app: typer.Typer) -> None:
    @app.command("extract")
    @command
    @takes(Extract)
    def extract(src: str = typer.Argument(..., help="Checkpoint directory or hf://org/repo[@rev]."), **o) -> None:
        """Extract MTP layers into a draft (native, speculators, angelspec, sglang-nextn) or drop them."""
        from .. import api
        from .write_options import render_plan

        out, json_output, trunk, gguf_type = o.pop("out"), o.pop("json"), o.pop("gguf_trunk"), o.pop("gguf_type")
        auto = {k: o.pop(k) for k in AUTO}
        if o["format"] == "gguf" or trunk is not None:
            _gguf(src, out, trunk, gguf_type, o, auto, json_output)
            return
        if auto["prompts"] is not None:
            from ..errors import UsageError

            raise UsageError("--prompts measures for --format gguf --gguf-type auto only", rule="mtp-quant-auto")
        with invoked():
            report = api.extract(src, out, layers=parse_layers(o.pop("layers")), progress=not json_output, **o)
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


AUTO = ("prompts", "max_drop", "depth", "max_new_tokens")  # how --gguf-type auto measures

# what --format gguf does not take: llama.cpp's converter writes every MTP layer (--gguf-type chooses the type)
NOT_GGUF = ("layers", "with_embed", "with_head", "dequant", "verifier_name", "plan_json", "dtype", "drop_mtp", "resume",
            "threads")


def _gguf(src: str, out: str, trunk: str | None, gguf_type: str, o: dict, auto: dict, json_output: bool) -> None:
    from .. import api
    from ..errors import UsageError

    if o["format"] != "gguf" or trunk is None:
        raise UsageError("--format gguf and --gguf-trunk TRUNK.gguf go together")
    given = [d.flags for n in NOT_GGUF for d in declared(Extract) if d.name == n and o[n] != d.default]
    if given:
        raise UsageError(f"--format gguf writes every MTP layer as llama.cpp's converter does: {', '.join(given)} "
                         "do not apply (--gguf-type chooses the type)")
    with invoked():
        report = api.extract_gguf(src, out, trunk, gguf_type=gguf_type, arch=o["arch"], dry_run=o["dry_run"],
                                  overwrite=o["overwrite"], allow_invalid=o["allow_invalid"], **auto)
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
