"""Pause the cyclic garbage collector while a burst of acyclic objects is built.

Opening a release builds ~92,000 header entries and tensor references (plus the parsed JSON they come
from): the collector's young-generation passes and its full passes over the growing heap cost ~20% of
opening, and find nothing (headers hold no reference cycles). Reference counting frees everything as
usual meanwhile. When the block ends the collector resumes as it was. In a process that runs one command
(the CLI: ``one_command``) what the block leaves is frozen (``gc.freeze``): the next young collection would
otherwise scan all of it (20-30 ms), and move it on to be scanned again. Elsewhere nothing is frozen: in a
long-lived process (the Python API, a fuzzer) a frozen cycle, such as a refused input's exception and its
traceback, would never be collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_FREEZE = False  # this process runs one command (one_command)


def one_command() -> None:
    """Freeze what is loaded now, and what each paused block leaves: the process ends after one command."""
    global _FREEZE
    _FREEZE = True
    gc.freeze()


@contextmanager
def gc_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _FREEZE:
            gc.freeze()
        if was:
            gc.enable()
