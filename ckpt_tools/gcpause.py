"""Pause the cyclic garbage collector while a burst of acyclic objects is built.

Opening a release builds ~92,000 header entries and tensor references (plus the parsed JSON they come
from): the collector's young-generation passes and its full passes over the growing heap cost ~20% of
opening, and find nothing (headers hold no reference cycles). Reference counting frees everything as
usual meanwhile. When the block ends, what it built is moved out of the collector's generations
(``gc.freeze``: it lives as long as the checkpoint, and rescanning it would only move the cost to the
next phase of the command); then the collector resumes as it was.
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
            gc.freeze()
            gc.enable()
