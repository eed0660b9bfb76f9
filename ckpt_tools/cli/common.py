"""Shared CLI plumbing: error handling, JSON output, progress bars, consoles."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import typer

from ..errors import EXIT_INPUT, CkptError
from ..jsonutil import dumps_strict
from ..stream.progress import end_progress, progress_for

INTERNAL_ERROR = 5
EXIT_BROKEN_PIPE = 128 + 13  # like a process killed by SIGPIPE, which Python ignores in favour of an exception
STATE = {"debug": False}
# Signals that stop a command the way Ctrl-C does: cleanup runs, exit code 128 + signal number.
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


class Terminated(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived while a command ran.

    A KeyboardInterrupt, so every cleanup path written for Ctrl-C (the writer's finally blocks,
    stitch's statistics threads) runs for the other signals too.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While a command runs, the stop signals raise ``Terminated`` in the main thread.

    Only default dispositions are replaced: a signal someone chose to ignore (``nohup``, SIGINT
    of a background job) stays ignored and a host program's own handler stays in place. The
    previous handlers come back afterwards, so library use and in-process runners are unaffected.
    """
    installed: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():  # signal.signal works there only
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None and signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                installed[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)


def _in_writer(tb) -> bool:
    """Whether an exception was raised while the writer ran (its frames are on the traceback)."""
    return any(frame.f_globals.get("__name__") == "ckpt_tools.stream.writer" for frame, _ in traceback.walk_tb(tb))


def stopped_message(e: KeyboardInterrupt, kwargs: dict) -> tuple[str, int]:
    """The one line and the exit code (128 + signal number) for a command stopped by a signal."""
    signum = getattr(e, "signum", signal.SIGINT)
    how = "interrupted" if signum == signal.SIGINT else "terminated"
    text = f"{how} by {signal.Signals(signum).name}"
    if _in_writer(e.__traceback__):
        out = kwargs.get("out")
        rerun = "--resume to finish" if "resume" in kwargs else "--overwrite to start again"
        text += f" while writing{f' {out}' if out else ''}; no output was marked complete; rerun with {rerun}"
    else:
        text += " before the command finished"
    return text, 128 + signum


@functools.cache
def _console_class():
    from rich.console import Console

    class WordWrapped(Console):
        """``print(..., soft_wrap=True)`` keeps a record on one line for a pipe (grep, a log); a terminal still
        wraps it between words, where its own wrapping would split a key or a path anywhere."""

        def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
            super().print(*objects, soft_wrap=soft_wrap and not self.is_terminal, **kwargs)

    return WordWrapped


def err_console():
    return _console_class()(stderr=True, highlight=False)


def out_console():
    """stdout's console. A progress display ends first: its redraws would overwrite what stdout prints."""
    end_progress()
    return _console_class()(highlight=False)


def command(fn: Callable) -> Callable:
    """Wrap a command: CkptError -> message + its exit code; anything else -> internal error.

    Tracebacks are printed only with ``ckpt --debug``.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        stats = sys.modules.get("ckpt_tools.io.sources.stats")
        if stats is not None:  # count this command's downloads only (several commands may share a process)
            stats.DOWNLOADS.reset()
        try:
            with stop_signals_raise():
                try:
                    return fn(*args, **kwargs)
                finally:
                    end_progress()
                    _report_downloads()
        except typer.Exit:
            raise
        except CkptError as e:
            if STATE["debug"]:
                traceback.print_exc()
            from rich.markup import escape

            err_console().print(f"[bold red]error:[/] {escape(str(e) or _no_message(e))}", soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:
            if STATE["debug"]:
                traceback.print_exc()
            text, code = stopped_message(e, kwargs)
            err_console().print(text, markup=False, soft_wrap=True)
            raise typer.Exit(code) from None
        except (Exception, SystemExit) as e:  # a bug (a stray sys.exit too): say so, no traceback unless asked
            if _broken_pipe(e):
                err_console().print("stdout was closed before the output was complete (broken pipe)")
                raise typer.Exit(EXIT_BROKEN_PIPE) from None
            if STATE["debug"]:
                traceback.print_exc()
            from rich.markup import escape

            err_console().print(
                f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e) or _no_message(e))} (rerun with "
                "`ckpt --debug ...` for a traceback and report it)", soft_wrap=True,
            )
            raise typer.Exit(INTERNAL_ERROR) from None

    return wrapper


def _broken_pipe(e: BaseException) -> bool:
    """Whether stdout's reader went away (``ckpt ... | head``); rich turns that into SystemExit(1).

    Then stdout is pointed at /dev/null, so the interpreter's last flush does not fail again.
    """
    if not (isinstance(e, BrokenPipeError) or isinstance(e, SystemExit) and isinstance(e.__context__, BrokenPipeError)):
        return False
    with contextlib.suppress(OSError, ValueError):  # no real stdout (an in-process runner)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return True


def _no_message(e: BaseException) -> str:
    """What to print for an exception that carries no text: a line must still name the cause."""
    if isinstance(e, MemoryError):
        return "out of memory"
    rule = getattr(e, "rule", None)
    return f"{type(e).__name__}{f' [{rule}]' if rule else ''} (no message)"


def _report_downloads() -> None:
    """Commands that read from a remote source say how much they downloaded (on stderr)."""
    stats = sys.modules.get("ckpt_tools.io.sources.stats")
    summary = stats.transfer_summary() if stats is not None else None
    if summary:
        err_console().print(summary)


def say_allowed(problems: list[dict] | None) -> None:
    """One line on stderr for what --allow-invalid let through (``Problem.to_json`` dicts): never silent."""
    if not problems:
        return
    from rich.markup import escape

    rules = sorted({p["rule"] for p in problems})
    first = problems[0]
    where = f"{first['path']}: " if first.get("path") else ""
    key = f"{first['key']}: " if first.get("key") else ""
    err_console().print(f"[yellow]note:[/] proceeding despite {len(problems)} problem(s) allowed by --allow-invalid "
                        f"({', '.join(rules)}); first: {escape(where + key + first['message'])}", soft_wrap=True)


def emit_json(obj: Any) -> None:
    """Strict JSON on stdout: no bare NaN / Infinity (NaN -> null, +-inf -> "inf" / "-inf"; see jsonutil)."""
    sys.stdout.write(dumps_strict(obj, indent=2) + "\n")


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
