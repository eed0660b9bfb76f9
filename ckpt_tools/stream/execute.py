"""Run a plan into its output: a local directory, or an object store's URL (see ``targets``)."""

from __future__ import annotations

from .plan import Plan
from .targets import writer_for
from .writer import WriteResult


def execute(plan: Plan, out_dir, **kwargs) -> WriteResult:
    """Run ``plan`` into ``out_dir`` with the writer its kind of output needs."""
    return writer_for(plan, out_dir, **kwargs).run()
