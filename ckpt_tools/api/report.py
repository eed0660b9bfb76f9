"""The base of every verb's report: a dataclass whose ``to_json()`` is the command's ``--json`` output."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ..stream.progress import Progress


@dataclass
class Report:
    """A verb's result. Subclasses add typed fields and build ``to_json()`` from them."""

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


def progress_sink(progress: bool) -> Progress:
    """The library's progress: a silent sink unless asked for (then the stderr display, when stderr is a terminal)."""
    from ..stream.progress import progress_for

    return progress_for(json_output=not progress)


_R = TypeVar("_R", bound=Report)


def as_public(cls: type[_R], report: object, **extra: Any) -> _R:
    """The ops report ``report`` as the public subclass ``cls`` (the same field values)."""
    own = {f.name for f in fields(cls)} - set(extra)
    return cls(**{name: getattr(report, name) for name in own if hasattr(report, name)}, **extra)
