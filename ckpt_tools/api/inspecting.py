"""``inspect`` as a function (``ckpt inspect``): see ``reading`` for the reading verbs' common contract."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from ..errors import UsageError
from ..ops.inspect import inspect as _inspect
from .options import Inspect, keywords
from .report import Report, as_public

if TYPE_CHECKING:
    from ..ops.inspect.discover import Discovery

PathLike = str | os.PathLike[str]


@dataclass
class InspectReport(_inspect.InspectReport, Report):
    """``ckpt inspect --json``: family, MTP layers, roles, experts, shards, dtypes, status, findings (keys:
    ops/inspect/inspect.py)."""


@dataclass
class DiscoverReport(Report):
    """``ckpt inspect --discover --json``: the MTP tensors found from their names and the draft table (``yaml``)."""

    discovery: Discovery
    written: str | None = None  # the table file written (``write=``)
    allowed_invalid: list[dict[str, Any]] = field(default_factory=list)  # problems let through by allow_invalid

    @property
    def yaml(self) -> str:
        return self.discovery.yaml()

    def to_json(self) -> dict[str, Any]:
        return self.discovery.to_json() | ({"written": self.written} if self.written else {})


# -- inspect ---------------------------------------------------------------------------------------------------


@overload
def inspect(path: PathLike, *, arch: str | None = None, discover: Literal[False] = False, write: None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> InspectReport: ...
@overload
def inspect(path: PathLike, *, arch: str | None = None, discover: Literal[True], write: str | None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> DiscoverReport: ...
@overload
def inspect(path: PathLike, *, arch: str | None = None, discover: bool = False, write: str | None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> InspectReport | DiscoverReport: ...
@keywords(Inspect)
def inspect(path: PathLike, *, arch: str | None = None, discover: bool = False, write: str | None = None,
            allow_invalid: Sequence[str] = (), progress: bool = False) -> InspectReport | DiscoverReport:
    """Describe a checkpoint's MTP layers (headers only): roles, experts, shards, dtypes, parameters and bytes.

    ``path``: a directory, one .safetensors file or ``hf://org/repo@rev``. Never raises for a checkpoint it can read
    and classify: what the consistency gate refuses is in ``InspectReport.findings`` (``notes``: what validate notes);
    ``InputError`` only for unreadable input or an unknown family; an unknown ``allow_invalid`` rule is a
    ``UsageError``. ``discover=True`` returns a ``DiscoverReport`` (its ``yaml``: the draft table).
    """
    from ..model.consistency import parse_allow

    allow = parse_allow(allow_invalid)  # an unknown rule is a usage error before anything is opened
    if discover:
        return _discover(str(path), write, allow)
    if write is not None:
        raise UsageError("--write goes with --discover")
    return as_public(InspectReport, _inspect.inspect_checkpoint(path, arch, allow))


def _discover(path: str, write: str | None, allow: frozenset[str]) -> DiscoverReport:
    from ..io.checkpoint import Checkpoint
    from ..model.gate import require_consistent
    from ..ops.inspect.discover import discover, write_draft
    from ..options import outside_inputs

    if write is not None and not write.endswith((".yaml", ".yml")):
        raise UsageError(f"--write {write}: a table file ends in .yaml")
    with Checkpoint.open(path) as ckpt:
        if write is not None:
            outside_inputs("--write", write, [ckpt.local_dir] if ckpt.local_dir else [])
        gate = require_consistent(ckpt, scope="files", allow=allow)
        found = discover(ckpt, family=Path(write).stem if write else None)
    if write:
        write_draft(found, write)
    return DiscoverReport(found, write, [p.to_json() for p in gate.allowed])


# -- GGUF ------------------------------------------------------------------------------------------------------


@dataclass
class GgufInspectReport(Report):
    """``ckpt inspect X.gguf --json``: trunk, MTP sidecar or both; architecture, blocks, MTP layers, tensor types,
    the MTP tensors missing or unexpected for the family's table (keys: ops/check/gguf.py)."""

    summary: Any

    def to_json(self) -> dict[str, Any]:
        result: dict[str, Any] = self.summary.to_json()
        return result


def inspect_gguf(path: PathLike, *, arch: str | None = None) -> GgufInspectReport:
    """Describe a GGUF file (metadata only): what it is for llama.cpp's MTP drafting and what its MTP blocks
    lack or hold beyond the family's table (``arch``: that family's table instead of every table of the file's
    llama.cpp architecture). Never raises for a readable GGUF: problems are in the report."""
    from ..io.gguf_file import read_gguf
    from ..ops.check.gguf import summarize

    return GgufInspectReport(summarize(read_gguf(path), arch))
