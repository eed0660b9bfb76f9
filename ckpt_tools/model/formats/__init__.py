"""Draft formats (tables in mappings/formats/) and the correspondence they define.

``table``: the format model, loading and detection; ``supports``: whether a format can express a family;
``links``: each draft tensor with the verifier tensor(s) it corresponds to (renames, expert re-layouts,
half swaps, column joins - each invertible); ``templates``: the draft's config.json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .links import FUSION_HALVES, Correspondence, ExpertLink, TensorLink, correspond
from .supports import check_expressible, format_env
from .table import (
    CACHE_PREFIX,
    all_formats,
    all_wrappers,
    detect_format,
    formats_dir,
    get_format,
    wrappers_of,
)
from .templates import draft_config, template_env, verifier_name_of

if TYPE_CHECKING:
    from .models import ConfigCheck, ConfigRecipe, DetectRule, FieldRequirement, Format, Supports


def __getattr__(name: str) -> Any:
    """The schema's classes (``models``), imported when asked for: runs read checked tables as plain records."""
    from . import table

    return getattr(table, name)

__all__ = [
    "CACHE_PREFIX", "FUSION_HALVES", "ConfigCheck", "ConfigRecipe", "Correspondence", "DetectRule", "ExpertLink",
    "FieldRequirement", "Format", "Supports", "TensorLink", "all_formats", "all_wrappers", "check_expressible",
    "correspond", "detect_format", "draft_config", "format_env", "formats_dir", "get_format", "template_env",
    "verifier_name_of", "wrappers_of",
]
