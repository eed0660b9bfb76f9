"""What every writing verb shares: its common options (declared once, so that their names and help read the
same), ``--layers`` parsing, the invocation the manifest records, and the lines said after a write."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import typer

from .common import command_line, human_bytes, out_console
from .gate_options import say_allowed


def plan_json_option():
    return typer.Option(None, "--plan-json", help="Write the plan as JSON to this file.")


def report_option():
    return typer.Option(None, "--report", help="Also write the report here.")


def overwrite_option():
    return typer.Option(False, "--overwrite", help="Replace an existing output directory.")


def resume_option():
    return typer.Option(False, "--resume", help="Finish an interrupted run into the same -o.")


def _cap_threads(value: int | None) -> int | None:
    """--threads above the CPUs available is capped, and said so on stderr."""
    from ..parallel import capped_threads
    from .common import err_console

    used, message = capped_threads(value)
    if message:
        err_console().print(message, markup=False, soft_wrap=True)
    return used


def threads_option():
    return typer.Option(None, "--threads", min=1, callback=_cap_threads,
                        help="Threads decoding quantized weights (default, and at most: every core this process "
                             "may use).")


def auto_options() -> dict:
    """--prompts, --max-drop, --depth, --max-new-tokens: how ``--mtp-quant auto`` / ``--gguf-type auto`` measure."""
    return {
        "prompts": typer.Option(None, "--prompts", help="With auto: the prompts the MTP's acceptance is measured on "
                                                        "(FILE.jsonl or one prompt a line; required)."),
        "max_drop": typer.Option(0.01, "--max-drop", help="With auto: the acceptance drop accepted at each depth."),
        "depth": typer.Option(1, "--depth", help="With auto: acceptance measured at depths 1..K."),
        "max_new_tokens": typer.Option(32, "--max-new-tokens", help="With auto: tokens generated per prompt."),
    }


def json_option():
    return typer.Option(False, "--json", help="Print a JSON report.")


def all_tensors_option():
    return typer.Option(False, "--all", help="List every MTP tensor, unchanged and added ones too (no row limit).")


def layers(text: str | None) -> list[int] | None:
    """--layers: MTP depths, each below the MTP bound, none twice (extract and stitch)."""
    if text is None:
        return None
    from ..model.tables.resolve import MAX_MTP_LAYERS
    from ..options import index_list

    return index_list("--layers", text, MAX_MTP_LAYERS - 1)


@contextlib.contextmanager
def invoked() -> Iterator[None]:
    """Around a writing verb's call: the manifest records the command line, and what --allow-invalid let
    in is said once the plan is made (before anything is written)."""
    from ..api.writing import invocation

    with invocation(command_line(), on_plan=lambda plan: say_allowed(plan.manifest.get("allowed_invalid"))):
        yield


def say_written(report: Any) -> None:
    """The line after a write: tensors, bytes, where, how long, how much was read."""
    w = report.written
    out_console().print(f"wrote {w.tensors} tensors ({human_bytes(w.tensor_bytes)}) to {w.output} "
                        f"in {w.seconds} s; read {human_bytes(w.bytes_read)} from the source")


def say_shards_written(out: str, report: Any) -> None:
    """The line after a stitch or graft: which of the verifier's shards were rewritten, which are new."""
    out_console().print(f"wrote {out}; rewritten shards: {', '.join(report.rewritten_shards) or '-'}; "
                        f"new shards: {', '.join(report.new_shards) or '-'}")
