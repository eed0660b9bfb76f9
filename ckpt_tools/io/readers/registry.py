"""The readers, by name: how each recognises its weights (detect) and turns them into a WeightSet (read).

Every weight format registers one ``Reader`` here (``register``); the checkpoint layer asks this
registry which reader a directory, a file or an object needs, and never branches on a format itself.
A new trainer format is one reader module that registers itself (tests/test_reader_registry.py adds one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InputError
from .base import Confine, ReadIndex, WeightSet

# directory, confine, read_index, only (one file of the directory, or None for all) -> its tensors
ReadDir = Callable[[Path, Confine, ReadIndex, "str | None"], WeightSet]


@dataclass(frozen=True)
class Reader:
    """One weight format.

    ``detect(d)`` says what of directory ``d`` it would read ("torch files (a.bin)"), or None.
    ``read`` reads a directory (or its file ``only``); None for the native format (safetensors),
    which the checkpoint layer opens itself from its headers and index - and which wins over every
    other reader when it detects. ``suffixes``: single files it reads when given one.
    ``accepts`` / ``read_object``: objects it reads instead of paths (a state dict in memory), named
    ``display`` in messages and reports (an object has no path).
    """

    name: str
    describe: str  # how "no weights found" lists it: "torch (.bin/.pt/.pth)"
    detect: Callable[[Path], str | None] | None = None
    read: ReadDir | None = None
    suffixes: tuple[str, ...] = ()
    accepts: Callable[[object], bool] | None = None
    read_object: Callable[[Any], WeightSet] | None = None  # Any: what ``accepts`` admitted
    display: str = ""

    @property
    def native(self) -> bool:
        return self.read is None and self.read_object is None


READERS: dict[str, Reader] = {}  # in registration order: the order detection asks them


def register(reader: Reader) -> Reader:
    """Add ``reader`` (a name already taken is refused: two readers must not claim one name)."""
    if reader.name in READERS:
        raise ValueError(f"a reader named {reader.name!r} is already registered")
    READERS[reader.name] = reader
    return reader


def unregister(name: str) -> None:
    READERS.pop(name, None)


def detect(d: Path, *, native: bool = True) -> Reader | None:
    """The reader for directory ``d`` by what it holds, or None when no reader recognises it.

    The native format wins whatever lies beside it (``native=False``: it is not asked); two other
    readers both recognising ``d`` is ambiguous (InputError): the caller must pass the one to read.
    """
    found: list[tuple[Reader, str]] = []
    for reader in READERS.values():
        if reader.detect is None or (reader.native and not native):
            continue
        what = reader.detect(d)
        if what is None:
            continue
        if reader.native:
            return reader
        found.append((reader, what))
    if len(found) > 1:
        whats = [w for _, w in found]
        both = "both " if len(whats) == 2 else ""
        raise InputError(f"holds {both}{', '.join(whats[:-1])} and {whats[-1]}; pass the one to read",
                         rule="ambiguous-weights", path=str(d))
    return found[0][0] if found else None


def for_file(path: Path) -> Reader | None:
    """The reader of a single weight file, by its suffix."""
    return next((r for r in READERS.values() if path.suffix in r.suffixes), None)


def for_object(obj: object) -> Reader | None:
    """The reader of an object given instead of a path (a mapping of tensors)."""
    return next((r for r in READERS.values() if r.accepts is not None and r.accepts(obj)), None)


def read_weights(d: Path, confine: Confine, read_index: ReadIndex, *, only: str | None = None,
                 kind: str | None = None) -> WeightSet:
    """Read the weights in directory ``d`` (or its file ``only``) with the reader ``kind`` or the detected one.

    ``confine`` and ``read_index`` come from the checkpoint layer: the same rules for file names and
    index files as for safetensors checkpoints.
    """
    reader: Reader | None
    if kind is not None:
        reader = READERS.get(kind)
        if reader is None or reader.read is None:
            known = ", ".join(n for n, r in READERS.items() if r.read is not None)
            raise InputError(f"unknown reader {kind!r} (known: {known})", rule="no-weights", path=str(d))
    elif only is not None:
        reader = for_file(Path(only))
    else:
        reader = detect(d, native=False)
    if reader is None or reader.read is None:
        listed = [r.describe for r in READERS.values() if r.detect is not None]
        raise InputError(f"no {', '.join(listed[:-1])} or {listed[-1]} weights found", rule="no-weights",
                         path=str(d))
    return reader.read(d, confine, read_index, only)
