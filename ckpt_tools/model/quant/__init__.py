"""Quantized checkpoints as tables: which scheme a configuration declares, how a module is stored,
what the configuration declares for it, and the exclusion entries that make it load unquantized.

The schemes are data (``mappings/quantization/*.yaml``, one per scheme, schema in ``schema``); no
verb branches on a scheme name. The API: ``detect_scheme`` (what config.json / hf_quant_config.json
declare), ``module_storage`` (how a module is stored: unquantized, quantized in which format, absent),
``declared`` / ``declaration`` (what the configuration declares for a module, each consumer's own
matching rules), ``exclusion_entries`` (the configuration change that excludes modules, fused names
included), ``CODECS`` (one codec per scheme's format, by name: encode, decode, capabilities),
``checkpoint_codec`` (the codec a checkpoint's scaled weights use) and ``quant_files``.

Adding a scheme from outside the package (docs/quantization.md): ``register_scheme_dir(path)``,
``register_codec(name, encode, layout)`` and ``register_codes(name, values)``; the ``unregister_*``
functions undo them.
"""

from __future__ import annotations

from typing import Any

from .codec import CODECS, Codec, Companion, checkpoint_codec, register_codec, unregister_codec
from .config import quant_files
from .declared import Declared, declaration, declared
from .detect import Declaration, Group, QuantScheme, detect_in, detect_scheme
from .encode_core import EncodeArgs
from .exclude import Change, ConfigPatch, engine_names, exclusion_entries
from .storage import Storage, module_storage, scale_grid
from .tables import all_schemes, get_scheme, register_scheme_dir, reload_schemes, unregister_scheme_dir

__all__ = [
    "CODECS", "Change", "Codec", "Companion", "ConfigPatch", "Declaration", "Declared", "EncodeArgs", "Group",
    "QuantScheme", "Storage", "all_schemes", "checkpoint_codec", "declaration", "declared", "detect_in",
    "detect_scheme", "engine_names", "exclusion_entries", "get_scheme", "module_storage", "quant_files",
    "register_codec", "register_codes", "register_scheme_dir", "reload_schemes", "scale_grid", "unregister_codec",
    "unregister_codes", "unregister_scheme_dir",
]


def register_codes(name: str, values: Any) -> Any:
    """``decode.register_codes`` (imported when called: decoding needs numpy, most commands never load it)."""
    from .decode import register_codes as register

    return register(name, values)


def unregister_codes(name: str) -> None:
    from .decode import unregister_codes as unregister

    unregister(name)
