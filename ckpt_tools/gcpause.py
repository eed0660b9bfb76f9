"""Pause the cyclic garbage collector while a burst of acyclic objects is built.

Opening a release builds ~92,000 header entries and tensor references (plus the parsed JSON they come
from): the collector's young-generation passes and its full passes over the growing heap cost ~20% of
opening, and find nothing (headers hold no reference cycles). Reference counting frees everything as
usual meanwhile. When the block ends the collector resumes as it was. Nothing is frozen (``gc.freeze``):
in a long-lived process (the Python API, a fuzzer) a frozen cycle, such as a refused input's exception
and its traceback, would never be collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
