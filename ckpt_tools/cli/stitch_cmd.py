"""`ckpt stitch DRAFT VERIFIER -o OUT`: a finetuned draft back into its verifier."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from .common import command, command_line, emit_json, out_console, progress_for


def register(app: typer.Typer) -> None:
    @app.command("stitch")
    @command
    def stitch(
        draft: str = typer.Argument(..., help="Draft directory (native, speculators, angelspec or sglang-nextn)."),
        verifier: str = typer.Argument(..., help="Verifier checkpoint directory or hf://org/repo[@rev]."),
        out: Path = typer.Option(..., "-o", "--out", help="Output directory (new or empty; never the verifier)."),
        fmt: str = typer.Option("auto", "--format", help="auto | native | speculators | angelspec | sglang-nextn"),
        mode: str = typer.Option("auto", "--mode", help="replace (verifier has MTP) | add (it has none) | auto"),
        link: str = typer.Option(
            "copy", "--link",
            help="Untouched shards: copy | reflink | hardlink | symlink | remote (an hf:// verifier's shards "
                 "stay on the Hub; `ckpt push` copies them server-side)"),
        allow_partial: bool = typer.Option(False, "--allow-partial", help="Keep verifier tensors the draft lacks."),
        dtype: str = typer.Option("verifier", "--dtype", help="verifier (cast to its dtypes) | draft"),
        update_copies: bool = typer.Option(False, "--update-copies", help="Also replace per-layer embed/head copies."),
        keep_bf16: bool = typer.Option(False, "--keep-bf16", help="FP8 verifier: write bf16 MTP weights, unquantized."),
        arch: str = typer.Option(None, "--arch", help="Verifier table instead of detecting it."),
        layers: str = typer.Option(None, "--layers", help="Verifier MTP depth(s) a renumbered draft maps to."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="For new MTP shards (add mode)."),
        accept_divergent: bool = typer.Option(
            False, "--accept-divergent",
            help="Stitch even when replaced tensors diverge from the verifier's beyond what finetuning does "
                 "(cosine < 0.2 or a norm ratio beyond 4x; the report lists them)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Plan and compare, print the report, write nothing."),
        plan_json: Path = typer.Option(None, "--plan-json", help="Write the plan as JSON to this file."),
        report_file: Path = typer.Option(None, "--report", help="Also write the report here."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
        resume: bool = typer.Option(False, "--resume", help="Finish an interrupted run into the same -o."),
        json_output: bool = typer.Option(False, "--json", help="Print a JSON report."),
    ) -> None:
        """Stitch a draft into its verifier: exact names, layout and dtypes, with a validation diff."""
        from ..checkpoint import Checkpoint
        from ..ops.stitch import StitchRequest, plan_stitch
        from ..plan import OutputFile, parse_size
        from .diff_cmd import render_diffs
        from .extract_cmd import _layers

        req = StitchRequest(format=fmt, mode=mode, link=link, allow_partial=allow_partial, dtype=dtype,
                            update_copies=update_copies, keep_bf16=keep_bf16, arch=arch, layers=_layers(layers),
                            max_shard_size=parse_size(max_shard_size), accept_divergent=accept_divergent,
                            command=command_line())
        plan, report = plan_stitch(Checkpoint.open(draft), Checkpoint.open(verifier), req)
        if plan_json is not None:
            plan.write_json(plan_json)
        if not dry_run:
            from ..writer import execute

            plan.files.append(OutputFile("stitch-report.json", content=b"{}"))  # placeholder, rewritten below
            result = execute(plan, out, overwrite=overwrite, resume=resume, progress=progress_for(json_output))
            from ..ops.validate import validate

            rep = validate(out)
            report.validation = {"ok": rep.ok, "problems": [p.to_json() for p in rep.problems]}
            # tmp + rename: a run killed here leaves the placeholder, never a truncated report
            tmp = out / ".stitch-report.json.partial"
            tmp.write_text(json.dumps(report.to_json(), indent=2) + "\n")
            os.replace(tmp, out / "stitch-report.json")
            _ = result
        data = report.to_json()
        if report_file is not None:
            report_file.write_text(json.dumps(data, indent=2) + "\n")
        if json_output:
            emit_json(data)
        else:
            hint = "stitch-report.json lists every key" if not dry_run else "--json lists every key"
            render_diffs(report.diffs, report.totals(), title=f"stitch ({report.mode}, {report.format})",
                         more_hint=hint)
            if report.divergent():
                out_console().print("divergent, stitched with --accept-divergent: "
                                    + "; ".join(f"{d.key} ({d.divergent})" for d in report.divergent()))
            if report.kept_from_verifier:
                out_console().print(f"kept from the verifier (--allow-partial): {len(report.kept_from_verifier)}")
            if not dry_run:
                out_console().print(f"wrote {out}; rewritten shards: {', '.join(report.rewritten_shards) or '-'}; "
                                    f"new shards: {', '.join(report.new_shards) or '-'}")
        if report.validation is not None and not report.validation.get("ok", True):
            raise typer.Exit(1)
