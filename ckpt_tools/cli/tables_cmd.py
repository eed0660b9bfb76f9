"""`ckpt tables`: known families, what they match, and the draft formats each supports."""

from __future__ import annotations

import typer

from .common import command, emit_json, out_console


def register(app: typer.Typer) -> None:
    @app.command("tables")
    @command
    def tables(json_output: bool = typer.Option(False, "--json", help="Print JSON."),
               probe: bool = typer.Option(False, "--probe", help="Also say which families `ckpt probe` supports "
                                                                 "(asks transformers: a few seconds).")) -> None:
        """List the architecture tables (shipped and from $CKPT_TABLES), their extract formats, and whether
        `ckpt probe` supports the family (transformers' MtpModel builds its MTP layers)."""
        from rich.table import Table

        from ..ops.tables_info import tables_info

        rows = tables_info(probe=probe)
        if json_output:
            emit_json(rows)
            return
        t = Table(title="architecture tables")
        cols = ("family", "kind", "architectures / model_type", "MTP prefix", "formats") + (("probe",) if probe else ())
        for col in cols:
            t.add_column(col, overflow="fold")
        for r in rows:
            ok = [f for f, why in r["formats"].items() if why == "ok"]
            t.add_row(r["family"], r["kind"], ", ".join(r["architectures"] + r["model_types"]), r["mtp_prefix"],
                      ", ".join(ok) or "-", *(("yes" if r["probe"] else "-",) if probe else ()))
        out_console().print(t)
