"""The options every writing verb shares, declared once so that their names and help read the same."""

from __future__ import annotations

import typer


def plan_json_option():
    return typer.Option(None, "--plan-json", help="Write the plan as JSON to this file.")


def report_option():
    return typer.Option(None, "--report", help="Also write the report here.")


def overwrite_option():
    return typer.Option(False, "--overwrite", help="Replace an existing output directory.")


def resume_option():
    return typer.Option(False, "--resume", help="Finish an interrupted run into the same -o.")


def json_option():
    return typer.Option(False, "--json", help="Print a JSON report.")
