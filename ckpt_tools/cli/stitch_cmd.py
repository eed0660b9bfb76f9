"""`ckpt stitch DRAFT VERIFIER -o OUT`: a finetuned draft back into its verifier."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from ..targets import Output
from .common import OUT_HELP, command, command_line, emit_json, out_console, output_arg, progress_for
from .gate_options import allow_invalid_option, allowed_rules, say_allowed
from .quant_render import say_config_changes
from .write_options import json_option, overwrite_option, plan_json_option, report_option, resume_option


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
        keep_bf16: bool = typer.Option(False, "--keep-bf16", help="FP8 verifier: write bf16 MTP weights, unquantized."),
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
        show_all: bool = typer.Option(False, "--all", help="List every MTP tensor, unchanged and added ones "
                                                            "too (no row limit)."),
        json_output: bool = json_option(),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        """Stitch a draft into its verifier: exact names, layout and dtypes, with a validation diff."""
        from ..checkpoint import Checkpoint
        from ..errors import UsageError
        from ..ops.stitch import StitchRequest, plan_stitch
        from ..plan import parse_size
        from .extract_cmd import _layers
        from .summary import render_diffs

        allow = allowed_rules(allow_invalid)
        if strip_prefix is not None and not strip_prefix:
            raise UsageError("--strip-prefix needs a non-empty prefix (e.g. --strip-prefix model.)")
        req = StitchRequest(format=fmt, mode=mode, link=link, allow_partial=allow_partial, dtype=dtype,
                            update_copies=update_copies, keep_bf16=keep_bf16, arch=arch, layers=_layers(layers),
                            max_shard_size=parse_size(max_shard_size), accept_divergent=accept_divergent,
                            strip_prefix=strip_prefix, command=command_line(), allow_invalid=allow)
        progress_for(json_output).phase("reading headers")
        with Checkpoint.open(draft) as d, Checkpoint.open(verifier) as v:
            progress_for(json_output).phase("planning")
            plan, report = plan_stitch(d, v, req)
            outputs = Outputs(output_arg(out), dry_run, plan_json, report_file, overwrite, resume, json_output)
            execute_and_report(plan, report, outputs, allow)
        if not json_output:
            hint = "--all or stitch-report.json lists every key" if not dry_run else "--all or --json lists every key"
            say_how_read(report.draft)
            render_diffs(report.diffs, report.totals(), show_all, title=f"stitch ({report.mode}, {report.format})",
                         more_hint=hint)
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
                out_console().print(f"wrote {out}; rewritten shards: {', '.join(report.rewritten_shards) or '-'}; "
                                    f"new shards: {', '.join(report.new_shards) or '-'}")


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


@dataclass(frozen=True)
class Outputs:
    """Where a writing verb's results go (its -o, --dry-run, --plan-json, --report, ... options)."""

    out: Output
    dry_run: bool
    plan_json: Path | None
    report_file: Path | None
    overwrite: bool
    resume: bool
    json_output: bool


def execute_and_report(plan, report, o: Outputs, allow: frozenset[str], name: str = "stitch-report.json") -> None:
    """Say what --allow-invalid let in, write the plan JSON, execute the plan (unless --dry-run), write the
    report file and, with --json, print the report. Inputs stay open meanwhile (the writer reads them)."""
    from ..jsonutil import write_json_file
    from ..options import outside_inputs

    say_allowed(plan.manifest.get("allowed_invalid"))
    if o.report_file is not None:
        outside_inputs("--report", o.report_file, plan.inputs)  # before anything is written
    if o.plan_json is not None:
        plan.write_json(o.plan_json)
    if not o.dry_run:
        _write(plan, report, o.out, o.overwrite, o.resume, o.json_output, allow, name)
    data = report.to_json()
    if o.report_file is not None:
        write_json_file(o.report_file, data, "--report", plan.inputs)
    if o.json_output:
        emit_json(data)


def _write(plan, report, out: Output, overwrite: bool, resume: bool, json_output: bool, allow: frozenset[str],
           name: str = "stitch-report.json") -> None:
    """Execute the stitch (or graft); the output is validated before its index appears (a failure is exit 4),
    then the report is written as ``name``.

    What --allow-invalid let in from the verifier may be carried out: those rules do not fail it.
    """
    from ..jsonutil import dumps_strict
    from ..ops.validate import validate_output
    from ..plan import OutputFile
    from ..targets import write_output_file
    from ..writer import execute

    def check(path: Path, pending) -> None:
        result = validate_output(path, allow=allow, pending=pending)
        report.validation = {"ok": True, "problems": [], **({"allowed": result["allowed"]} if "allowed" in result
                                                            else {})}

    plan.files.append(OutputFile(name, content=b"{}"))  # placeholder, rewritten below
    execute(plan, out, overwrite=overwrite, resume=resume, progress=progress_for(json_output), check=check)
    # tmp + rename: a run killed here leaves the placeholder, never a truncated report
    write_output_file(out, name, (dumps_strict(report.to_json(), indent=2) + "\n").encode())
