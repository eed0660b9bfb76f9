"""``diff`` as a function (``ckpt diff``): see ``reading`` for the reading verbs' common contract."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckFailed
from ..ops.diff import diff as _diff
from .options import Diff, keywords
from .report import Report, as_public, progress_sink

PathLike = str | os.PathLike[str]
StateDict = Mapping[str, Any]  # name -> torch.Tensor: a draft still in memory (diff reads it like a directory)


@dataclass
class DiffReport(_diff.DiffReport, Report):
    """``ckpt diff --json``: per changed key its status and statistics; every key with ``all_keys``."""

    all_keys: bool = False  # list unchanged keys too (``all=True``, the CLI's --all)

    def to_json(self, all_keys: bool | None = None) -> dict[str, Any]:
        return super().to_json(all_keys=self.all_keys if all_keys is None else all_keys)


# -- diff ------------------------------------------------------------------------------------------------------


@keywords(Diff)
def diff(a: PathLike | StateDict, b: PathLike | StateDict, *, keys: str | None = None, stats: bool = False,
         dequant: bool = False, all: bool = False, allow_invalid: Sequence[str] = (),
         progress: bool = False) -> DiffReport:
    """Compare two checkpoints (directories, or state dicts in memory) key by key, streaming (memory stays bounded),
    and their config.json (a JSON diff) and side files (by digest). Never refuses a readable checkpoint: the index
    rules' findings on either side are reported (``problems``) and count as differences. ``dequant`` implies
    ``stats``. Raises ``CheckFailed`` (its ``report`` a ``DiffReport``) when they differ.
    """
    from ..io.checkpoint import Checkpoint
    from ..model.consistency import parse_allow
    from ..options import regex

    if keys is not None:
        regex("--keys", keys)  # before any checkpoint is opened
    allow = parse_allow(allow_invalid)
    with Checkpoint.open(a) as ca, Checkpoint.open(b) as cb:
        found = _diff.diff(ca, cb, keys=keys, stats=stats or dequant, dequant=dequant, allow=allow,
                           progress=progress_sink(progress))
    report = as_public(DiffReport, found, all_keys=all)
    if not report.identical:
        raise CheckFailed(f"{report.a} and {report.b} differ: {report.summary()}", report=report)
    return report
