"""The verbs that read: ``inspect``, ``validate`` (and its one writing mode, ``fix_quant_config=True``) and ``diff``.

Each returns a report whose ``to_json()`` is what ``ckpt VERB --json`` prints. A check that finds
something (validate's problems, diff's differences: exit 1 on the command line) raises
``CheckFailed`` with the report attached, so a script cannot mistake a failed check for a pass.
The reports are the ops' own report classes with ``Report`` as a second base (ops sit below api and
cannot import it): every field and method of the ops' report is there.
"""
# Each verb lives in a module of its own, so that running one imports neither of the others' operations
# (``ckpt inspect`` needs no diff machinery); this module gathers them for ``from ckpt_tools.api.reading import``.
from .diffing import DiffReport, diff
from .fixing import FixQuantConfigReport
from .inspecting import DiscoverReport, InspectReport, inspect
from .validating import ValidateReport, validate

__all__ = ["DiffReport", "DiscoverReport", "FixQuantConfigReport", "InspectReport", "ValidateReport", "diff",
           "inspect", "validate"]
