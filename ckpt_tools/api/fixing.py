"""The report of ``validate(fix_quant_config=True)`` (``ckpt validate --fix-quant-config``): a module of its own,
so that a plain ``validate`` imports none of the writing machinery the fix uses."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.convert import fix_quant_config as _fix
from .report import Report


@dataclass
class FixQuantConfigReport(_fix.FixReport, Report):
    """``ckpt validate --fix-quant-config --json``: the config changes, the files written, OUT's validation."""
