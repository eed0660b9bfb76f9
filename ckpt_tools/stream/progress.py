"""Progress: the sink a command reports its phases and bytes to, and its display on stderr:
one line naming the phase, with a bar, the bytes done of the phase's
total, the speed and the time left (a pulsing bar and the time spent for a phase with no byte total).

One display per command: every ``progress_for`` call of a command returns it, so the phases a command
walks through (reading headers, planning, then the writer's writing, hashing, validating) share one line.
It never shows with --json or when stderr is not a terminal, and it ends before anything is printed on
stdout (``end_progress``): its redraws would overwrite those lines.
"""

from __future__ import annotations

import os
import sys


class Progress:
    """Sink for a command's progress; the CLI plugs a rich display in.

    A command walks through phases ("reading headers", "planning", "writing", "hashing", "validating");
    ``total`` is the bytes the phase will move (0: no byte count, a phase to wait for). ``advance`` adds
    bytes done to the current phase: over a phase they sum to its total.
    """

    def phase(self, name: str, total: int = 0) -> None: ...

    def advance(self, n: int) -> None: ...

    def stop(self) -> None: ...


BAR_WIDTH = 24  # the whole line fits 80 columns with the longest phase name and byte counts in GB

_active: RichProgress | None = None  # the running command's display


def _columns() -> list:
    """rich's columns; imported here, not at CLI start-up (most verbs never show a bar)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class Sized(ProgressColumn):
        """``sized`` for a phase with a byte total, ``unsized`` (or nothing) for one without."""

        def __init__(self, sized: ProgressColumn, unsized: ProgressColumn | None = None) -> None:
            super().__init__()
            self.sized, self.unsized = sized, unsized

        def render(self, task):
            column = self.sized if task.total is not None else self.unsized
            return column(task) if column is not None else Text("")

    # without a total the bar pulses: the phase is alive, its length unknown
    return [TextColumn("{task.description}"), BarColumn(bar_width=BAR_WIDTH), Sized(DownloadColumn()),
            Sized(TransferSpeedColumn()), Sized(TimeRemainingColumn(), TimeElapsedColumn())]


class RichProgress(Progress):
    """A ``Progress`` sink drawn by rich on ``console`` (stderr by default)."""

    def __init__(self, console=None) -> None:
        self.console = console
        self._p = None
        self._task = None

    def phase(self, name: str, total: int = 0) -> None:
        if self._p is None:
            from rich.progress import Progress as RichBar

            # stdout is left alone: what a verb prints there must not be moved to stderr
            self._p = RichBar(*_columns(), console=self.console or _stderr(), transient=True,
                              redirect_stdout=False)
            self._p.start()
        else:
            self._p.refresh()  # the phase that ends, as it ended
            self._p.remove_task(self._task)
        self._task = self._p.add_task(name, total=total or None)  # its own speed and time left
        self._p.refresh()  # every phase is drawn at least once, however short

    def advance(self, n: int) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def interactive() -> bool:
    """Whether stderr is a terminal a bar can redraw: rich's judgement (``TTY_COMPATIBLE=1`` says a non-tty
    is one, ``TTY_INTERACTIVE=0`` refuses animation), except that ``FORCE_COLOR`` alone, which CI logs set
    for colours, does not make a pipe a terminal."""
    if not _stderr().is_interactive:
        return False
    return sys.stderr.isatty() or os.environ.get("TTY_COMPATIBLE") == "1"


def progress_for(json_output: bool, quiet: bool = False) -> Progress:
    """The command's display; a sink that shows nothing with --json, ``quiet``, or stderr not a terminal."""
    global _active
    if json_output or quiet or not interactive():
        return Progress()
    if _active is None:
        _active = RichProgress()
    return _active


def end_progress() -> None:
    """End the command's display (when the command ends, and before anything is printed on stdout)."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None
