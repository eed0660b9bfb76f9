"""ckpt-tools: exact, streaming surgery on Hugging Face checkpoints around MTP layers.

The verbs are functions (``from ckpt_tools import extract, stitch, ...``; see ``ckpt_tools.api``) and
the exceptions they raise are importable from here. Nothing heavy is imported until a verb runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import CheckFailed, CkptError, InputError, OutputError, UsageError

if TYPE_CHECKING:  # the verbs' types for a type checker; at run time __getattr__ imports them on first use
    from .api import dequant as dequant
    from .api import diff as diff
    from .api import extract as extract
    from .api import fuse_experts as fuse_experts
    from .api import graft as graft
    from .api import init_draft as init_draft
    from .api import inspect as inspect
    from .api import probe as probe
    from .api import push as push
    from .api import stitch as stitch
    from .api import unfuse_experts as unfuse_experts
    from .api import validate as validate

__version__ = "0.1.0"

_VERBS = (
    "dequant",
    "diff",
    "extract",
    "fuse_experts",
    "graft",
    "init_draft",
    "inspect",
    "probe",
    "push",
    "stitch",
    "unfuse_experts",
    "validate",
)
__all__ = [*_VERBS, "CheckFailed", "CkptError", "InputError", "OutputError", "UsageError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _VERBS:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
