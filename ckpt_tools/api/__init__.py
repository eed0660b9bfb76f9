"""The public Python API: every verb as a function, the same code path the CLI runs.

Keyword arguments mirror the CLI options; each function returns a typed report whose ``to_json()``
is exactly what the command prints with ``--json``; failures are exceptions, one class per exit
code (``ckpt_tools.errors``). Progress is off unless ``progress=True``. Importing this package costs
nothing: each verb's module (and torch / numpy where it needs them) loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees; at run time __getattr__ imports each verb on first use
    from .diffing import diff as diff
    from .inspecting import inspect as inspect
    from .inspecting import inspect_gguf as inspect_gguf
    from .measure import probe as probe
    from .publish import push as push
    from .validating import validate as validate
    from .validating import validate_gguf as validate_gguf
    from .writing import dequant as dequant
    from .writing import extract as extract
    from .writing import extract_gguf as extract_gguf
    from .writing import fuse_experts as fuse_experts
    from .writing import graft as graft
    from .writing import init_draft as init_draft
    from .writing import stitch as stitch
    from .writing import unfuse_experts as unfuse_experts

# public name -> module (under ckpt_tools.api) that defines it
_WHERE = {
    "inspect": "inspecting",
    "validate": "validating",
    "diff": "diffing",
    "extract": "writing",
    "extract_gguf": "writing",
    "inspect_gguf": "inspecting",
    "validate_gguf": "validating",
    "stitch": "writing",
    "graft": "writing",
    "fuse_experts": "writing",
    "unfuse_experts": "writing",
    "init_draft": "writing",
    "dequant": "writing",
    "push": "publish",
    "probe": "measure",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value  # later lookups (and a test's monkeypatch) see a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
