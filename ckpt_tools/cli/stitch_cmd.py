"""`ckpt stitch DRAFT VERIFIER -o OUT`: a finetuned draft back into its verifier."""

from __future__ import annotations

import typer

from ..api.options import Stitch
from .common import command, emit_json, out_console
from .options import takes
from .write_options import invoked, say_config_changes, say_shards_written
from .write_options import layers as parse_layers


def register(app: typer.Typer) -> None:
    @app.command("stitch")
    @command
    @takes(Stitch)
    def stitch(
        draft: str = typer.Argument(..., help="Draft directory (native, speculators, angelspec or sglang-nextn)."),
        verifier: str = typer.Argument(..., help="Verifier checkpoint directory or hf://org/repo[@rev]."),
        **o,
    ) -> None:
        """Stitch a draft into its verifier: exact names, layout and dtypes, with a validation diff."""
        from .. import api
        from .summary import render_diffs

        out, json_output, show_all, dry_run = o.pop("out"), o.pop("json"), o.pop("all"), o["dry_run"]
        with invoked():
            result = api.stitch(draft, verifier, out, layers=parse_layers(o.pop("layers")),
                                progress=not json_output, **o)
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
