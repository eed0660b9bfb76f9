"""The `ckpt` command line: thin commands that parse options, call ops, render results."""

from __future__ import annotations

import gc
import importlib
import os
import sys

import typer

from ..gcpause import one_command
from . import coerce
from .common import STATE

coerce.install()  # plain values converted without typer's pydantic adapters (cli/coerce.py)

SETTINGS = dict(
    name="ckpt",
    help="Exact, streaming surgery on Hugging Face checkpoints around MTP (multi-token prediction) layers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app = typer.Typer(**SETTINGS)

# One module per verb; each defines register(app).
COMMAND_MODULES = (
    "inspect_cmd",
    "validate_cmd",
    "verify_cmd",
    "extract_cmd",
    "experts_cmd",
    "dequant_cmd",
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


def app_for(args: list[str]) -> typer.Typer:
    """``app`` with only the command that ``args`` run (all of them for ``ckpt --help``, a typo, ...).

    typer turns every registered command's parameters into click ones on each run, 8 ms for all
    of them, though a run uses one.
    """
    verb = next((a for a in args if not a.startswith("-")), None)
    chosen = [c for c in app.registered_commands if c.name == verb]
    if not chosen:
        return app
    one = typer.Typer(**SETTINGS)
    one.registered_callback = app.registered_callback
    one.registered_commands = chosen
    return one


def main() -> None:
    # What is loaded by now lives until the process ends: freezing it spares the collector rescanning it,
    # during the command and again in the full collection at interpreter exit (~20-40 ms per run); so does
    # what each planning burst leaves (gcpause)
    one_command()
    # numpy's OpenBLAS starts a thread per core that spins ~0.1 s of CPU after import, taking a core from the
    # decoding threads; nothing here multiplies matrices (set before numpy is imported: after, it is too late)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        app_for(sys.argv[1:])()
    finally:
        gc.freeze()
