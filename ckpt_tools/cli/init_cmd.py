"""`ckpt init-draft TARGET -o OUT`: a dimension-matched MTP draft, from scratch or from a target layer."""

from __future__ import annotations

import typer

from ..api.options import InitDraft
from .common import command, emit_json, out_console
from .options import takes


def register(app: typer.Typer) -> None:
    @app.command("init-draft")
    @command
    @takes(InitDraft)
    def init_draft(
        target: str = typer.Argument(..., help="Target checkpoint directory, its config.json, or hf://org/repo[@rev]."),
        **o,
    ) -> None:
        """Create an MTP draft whose dimensions match TARGET: from scratch, or warm-started from one of its layers."""
        from .. import api
        from .write_options import invoked, render_plan, say_written

        json_output = o.pop("json")
        with invoked():
            report = api.init_draft(target, o.pop("out"), progress=not json_output, **o)
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

