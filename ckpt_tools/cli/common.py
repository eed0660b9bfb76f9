"""Shared CLI plumbing: error handling, JSON output, progress bars, consoles."""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import typer

from ..errors import EXIT_INPUT, CkptError
from ..writer import Progress

INTERNAL_ERROR = 5
STATE = {"debug": False}


def err_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def out_console():
    from rich.console import Console

    return Console(highlight=False)


def command(fn: Callable) -> Callable:
    """Wrap a command: CkptError -> message + its exit code; anything else -> internal error.

    Tracebacks are printed only with ``ckpt --debug``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        hub = sys.modules.get("ckpt_tools.hub")
        if hub is not None:  # count this command's downloads only (several commands may share a process)
            hub.HUB_STATS.reset()
        try:
            try:
                return fn(*args, **kwargs)
            finally:
                _report_downloads()
        except typer.Exit:
            raise
        except CkptError as e:
            if STATE["debug"]:
                traceback.print_exc()
            from rich.markup import escape

            err_console().print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console().print("interrupted; no output was marked complete")
            raise typer.Exit(130) from None
        except Exception as e:  # a bug: say so, without a traceback unless asked
            if STATE["debug"]:
                traceback.print_exc()
            from rich.markup import escape

            err_console().print(
                f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} (rerun with `ckpt --debug ...` "
                "for a traceback and report it)", soft_wrap=True,
            )
            raise typer.Exit(INTERNAL_ERROR) from None

    return wrapper


def _report_downloads() -> None:
    """Commands that read from the Hub say how much they downloaded (on stderr)."""
    hub = sys.modules.get("ckpt_tools.hub")
    summary = hub.transfer_summary() if hub is not None else None
    if summary:
        err_console().print(summary)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


class RichProgress(Progress):
    """One bar for the whole plan, in bytes and bytes/s."""

    def __init__(self) -> None:
        self._p = None
        self._task = None

    def start(self, total: int, description: str) -> None:
        from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn
        from rich.progress import Progress as RP

        self._p = RP("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                     TransferSpeedColumn(), TimeRemainingColumn(), console=err_console(), transient=True)
        self._p.start()
        self._task = self._p.add_task(description.split(" ")[0] if description else "writing", total=total)

    def advance(self, n: int) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


def progress_for(json_output: bool, quiet: bool = False) -> Progress:
    if json_output or quiet or not sys.stderr.isatty():
        return Progress()
    return RichProgress()


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def command_line() -> str:
    import shlex

    return "ckpt " + " ".join(shlex.quote(a) for a in sys.argv[1:])


__all__ = ["EXIT_INPUT", "command", "emit_json", "progress_for", "human_bytes", "command_line", "STATE"]
