"""`ckpt stitch DRAFT VERIFIER -o OUT`: a finetuned draft back into its verifier."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import OUT_HELP, command, emit_json, out_console
from .gate_options import allow_invalid_option
from .quant_render import say_config_changes
from .write_options import (
    all_tensors_option,
    invoked,
    json_option,
    overwrite_option,
    plan_json_option,
    report_option,
    resume_option,
    say_shards_written,
)
from .write_options import layers as parse_layers


def register(app: typer.Typer) -> None:
    @app.command("stitch")
    @command
    def stitch(
        draft: str = typer.Argument(..., help="Draft directory (native, speculators, angelspec or sglang-nextn)."),
        verifier: str = typer.Argument(..., help="Verifier checkpoint directory or hf://org/repo[@rev]."),
        out: str = typer.Option(..., "-o", "--out", help=OUT_HELP),
        fmt: str = typer.Option("auto", "--format", help="auto | native | speculators | angelspec | sglang-nextn"),
        mode: str = typer.Option("auto", "--mode",
                                 help="replace (verifier has MTP) | add (it has none; sets the count) | auto"),
        link: str = typer.Option(
            "copy", "--link",
            help="Untouched shards: copy | reflink | hardlink | remote (an hf:// verifier's shards "
                 "stay on the Hub; `ckpt push` copies them server-side)"),
        allow_partial: bool = typer.Option(False, "--allow-partial", help="Keep verifier tensors the draft lacks."),
        dtype: str = typer.Option("verifier", "--dtype", help="verifier (cast to its dtypes) | draft"),
        update_copies: bool = typer.Option(False, "--update-copies", help="Also replace per-layer embed/head copies."),
        keep_bf16: bool = typer.Option(False, "--keep-bf16", help="Write bf16 MTP weights, unquantized."),
        arch: str = typer.Option(None, "--arch", help="Verifier table instead of detecting it."),
        strip_prefix: str = typer.Option(
            None, "--strip-prefix", metavar="P",
            help="Strip P from every draft key (a wrapper prefix no table knows; module., _orig_mod., "
                 "draft_model. and the format's own are stripped without it). A rename only."),
        layers: str = typer.Option(None, "--layers", help="Verifier MTP depth(s) a renumbered draft maps to."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="For new MTP shards (add mode)."),
        accept_divergent: bool = typer.Option(
            False, "--accept-divergent",
            help="Stitch even when replaced tensors diverge from the verifier's beyond what finetuning does "
                 "(cosine < 0.2 or a norm ratio beyond 4x; the report lists them)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Plan and compare, print the report, write nothing."),
        plan_json: Path = plan_json_option(),
        report_file: Path = report_option(),
        overwrite: bool = overwrite_option(),
        resume: bool = resume_option(),
        show_all: bool = all_tensors_option(),
        json_output: bool = json_option(),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        """Stitch a draft into its verifier: exact names, layout and dtypes, with a validation diff."""
        from .. import api
        from .summary import render_diffs

        with invoked():
            result = api.stitch(draft, verifier, out, format=fmt, mode=mode, link=link, allow_partial=allow_partial,
                                dtype=dtype, update_copies=update_copies, keep_bf16=keep_bf16, arch=arch,
                                strip_prefix=strip_prefix, layers=parse_layers(layers), max_shard_size=max_shard_size,
                                accept_divergent=accept_divergent, dry_run=dry_run, plan_json=plan_json,
                                report=report_file, overwrite=overwrite, resume=resume,
                                allow_invalid=tuple(allow_invalid or ()), progress=not json_output)
        if json_output:
            emit_json(result.to_json())
        else:
            report = result.details
            hint = "--all or stitch-report.json lists every key" if not dry_run else "--all or --json lists every key"
            say_how_read(report.draft)
            render_diffs(report.diffs, report.totals(), show_all, title=f"stitch ({report.mode}, {report.format})",
                         more_hint=hint)
            if report.manifest:
                from rich.markup import escape

                out_console().print(f"not evidence: {escape(report.manifest)}", soft_wrap=True)
            if report.divergent():
                out_console().print("divergent, stitched with --accept-divergent: "
                                    + "; ".join(f"{d.key} ({d.divergent})" for d in report.divergent()))
            if report.absent_copies:
                out_console().print(f"per-layer embed/head copies the verifier does not have, left out: "
                                    f"{', '.join(report.absent_copies)}")
            say_config_changes(report.quant_config)
            if report.kept_from_verifier:
                out_console().print(f"kept from the verifier (--allow-partial): {len(report.kept_from_verifier)}")
            if not dry_run:
                say_shards_written(out, report)


def say_how_read(draft: dict) -> None:
    """One line when the draft was not read as safetensors as stored: its reader and notes, the prefix stripped."""
    parts = []
    if draft.get("reader", "safetensors") != "safetensors":
        notes = "; ".join(draft.get("reader_notes") or [])
        parts.append(f"read with the {draft['reader']} reader" + (f" ({notes})" if notes else ""))
    stripped = draft.get("prefix_stripped")
    if stripped:
        parts.append(f"stripped the prefix {stripped['prefix']!r} from every key ({stripped['how']})")
    if parts:
        out_console().print("draft: " + "; ".join(parts), markup=False, soft_wrap=True)
