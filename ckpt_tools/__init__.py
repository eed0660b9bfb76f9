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
    from .api import extract_gguf as extract_gguf
    from .api import fuse_experts as fuse_experts
    from .api import graft as graft
    from .api import init_draft as init_draft
    from .api import inspect as inspect
    from .api import inspect_gguf as inspect_gguf
    from .api import probe as probe
    from .api import push as push
    from .api import stitch as stitch
    from .api import unfuse_experts as unfuse_experts
    from .api import validate as validate
    from .api import validate_gguf as validate_gguf

__version__ = "0.1.0"

_VERBS = (
    "dequant",
    "diff",
    "extract",
    "extract_gguf",
    "fuse_experts",
    "graft",
    "init_draft",
    "inspect",
    "inspect_gguf",
    "probe",
    "push",
    "stitch",
    "unfuse_experts",
    "validate",
    "validate_gguf",
)
__all__ = [*_VERBS, "CheckFailed", "CkptError", "InputError", "OutputError", "UsageError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _VERBS:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
