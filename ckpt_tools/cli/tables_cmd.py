"""`ckpt tables [FAMILY]`: known families, what they match, and the draft formats each supports."""

from __future__ import annotations

import typer

from ..api.options import Tables
from .common import command, emit_json
from .options import takes


def register(app: typer.Typer) -> None:
    @app.command("tables")
    @command
    @takes(Tables)
    def tables(family: str | None = typer.Argument(None, metavar="[FAMILY]",
                                                   help="Show this family in full: its MTP prefix template, norm, "
                                                        "fusion order and why each format does or does not apply."),
               **o) -> None:
        """List the architecture tables (shipped and from $CKPT_TABLES), their extract formats, vLLM's MTP class
        for each family with the level it was checked at (served / loaded / names), and whether `ckpt probe`
        supports the family (our table engine builds its MTP layers; "+ref" when transformers' MtpModel does
        too, the reference probe checks the engine against)."""
        from ..ops.inspect.tables import tables_info
        from .tables_render import render_family, render_tables

        json_output, probe = o["json"], o["probe"]
        support = None
        if probe:
            from ..ops.probe.families import probe_row  # imports transformers (and torch): only for --probe

            support = probe_row
        rows = tables_info(family=family, probe_support=support)
        if json_output:
            emit_json(rows if family is None else rows[0])
        elif family is None:
            render_tables(rows, probe)
        else:
            render_family(rows[0])
