"""The `ckpt` command line: thin commands that parse options, call ops, render results."""

from __future__ import annotations

import gc
import importlib

import typer

from .common import STATE

app = typer.Typer(
    name="ckpt",
    help="Exact, streaming surgery on Hugging Face checkpoints around MTP (multi-token prediction) layers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# One module per verb; each defines register(app).
COMMAND_MODULES = (
    "inspect_cmd",
    "validate_cmd",
    "verify_cmd",
    "extract_cmd",
    "experts_cmd",
    "stitch_cmd",
    "graft_cmd",
    "diff_cmd",
    "probe_cmd",
    "init_cmd",
    "push_cmd",
    "tables_cmd",
    "demo_cmd",
)


@app.callback()
def _main(
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks on errors."),
) -> None:
    STATE["debug"] = debug


for _name in COMMAND_MODULES:
    importlib.import_module(f"{__name__}.{_name}").register(app)


def main() -> None:
    # What is loaded by now lives until the process ends: freezing it spares the collector rescanning it,
    # during the command and again in the full collection at interpreter exit (~20-40 ms per run).
    gc.freeze()
    try:
        app()
    finally:
        gc.freeze()
