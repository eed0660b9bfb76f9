r"""Quantized checkpoints as tables: which scheme a configuration declares, how a module is stored,
what the configuration declares for it, and the exclusion entries that make it load unquantized.

The schemes are data (``mappings/quantization/*.yaml``, one per scheme, schema in ``schema``);
no verb branches on a scheme name. The API:

``detect_scheme(ckpt) -> QuantScheme | None``
    What config.json ``quantization_config`` / ``hf_quant_config.json`` declare: the scheme
    tables involved (a compressed-tensors config can mix groups of several schemes; a ModelOpt
    MIXED_PRECISION config names its modules) and every place that declares them. None when the
    checkpoint declares no quantization; InputError (rule ``quant-unknown``) when it declares one
    no table describes.

``module_storage(ckpt, scheme, module, shape=None, fused=None) -> Storage``
    How ``module`` (e.g. ``model.layers.61.eh_proj``) is stored: ``unquantized`` (its float
    dtype), ``quantized`` (which table and format, which tensors, which companions are missing
    or wrong) or ``absent``.

``declared(scheme, config, module, fused) -> "quantized" | "excluded" | "conflict"``
    What the configuration declares for ``module``, with each consumer's own matching rules
    (``match``): compressed-tensors ``match_name`` (exact, ``re:``, class targets, fused names by
    their shards), ModelOpt fnmatch globs over ``ignore`` / ``exclude_modules`` and per-module
    ``quantized_layers``, Quark ``exclude``, transformers ``modules_to_not_convert``. ``config``:
    the files to read (None: as detected), e.g. a repaired copy. ``fused``: the engine's fused
    layers (vLLM ``packed_modules_mapping`` form: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``).
    ``declaration`` gives the group and the reason too.

``exclusion_entries(scheme, modules, fused, subtrees=()) -> ConfigPatch``
    The configuration change that makes every listed module excluded, in the form each list's
    consumers match, fused names included; ``subtrees`` (MTP layer prefixes) get one entry each
    where the list's matcher can say "everything under" (``re:^prefix\..*``, ``prefix.*``).
    ``patch.apply(files)`` returns the changed files.

``weight_format(ckpt=None, hint=None) -> WeightFormat``
    The checkpoint's *block format* (one FP8 scale companion over fixed tiles: ``fp8-block``'s
    ``weight_scale_inv``, ``deepseek-v4``'s ``.scale``), from the scheme table its storage shows,
    else the one it declares, else the family's hint: how a stacked experts tensor (no module of its
    own) carries its scale (``companions(key, shape)``, ``scale_key``, ``decode``, ``storage``). A
    per-module weight in a block format is a ``Storage`` like every other scheme's.

``quant_files(ckpt)`` reads the configuration files a scheme may be declared in.

Adding a scheme from outside the package (docs/quantization.md "Adding a scheme"):
``register_scheme_dir(path)`` reads the tables in ``path`` too; ``register_encoder(name, fn, layout)``
adds the encoder a table's ``encoder:`` names (stitch and graft write the scheme with it; a table may name
a shipped one, as a block scheme naming ``fp8-block``); decoding is
the table's own ``decoder:`` data, over the code kinds built in or added with ``register_codes(name,
values)``. ``unregister_scheme_dir`` / ``unregister_encoder`` / ``unregister_codes`` undo them.
"""

from __future__ import annotations

from typing import Any

from .companions import Companion, WeightFormat, weight_format
from .config import quant_files
from .declared import Declared, declaration, declared
from .detect import Declaration, Group, QuantScheme, detect_in, detect_scheme
from .encode import EncodeArgs, register_encoder, unregister_encoder
from .exclude import Change, ConfigPatch, engine_names, exclusion_entries
from .storage import Storage, module_storage, scale_grid
from .tables import all_schemes, get_scheme, register_scheme_dir, reload_schemes, unregister_scheme_dir

__all__ = [
    "Change", "Companion", "ConfigPatch", "Declaration", "Declared", "EncodeArgs", "Group", "QuantScheme", "Storage",
    "all_schemes", "declaration", "declared", "detect_in", "detect_scheme", "engine_names", "exclusion_entries",
    "get_scheme", "module_storage", "quant_files", "register_codes", "register_encoder", "register_scheme_dir",
    "reload_schemes", "scale_grid", "unregister_codes", "unregister_encoder", "unregister_scheme_dir", "WeightFormat",
    "weight_format",
]


def register_codes(name: str, values: Any) -> Any:
    """``decode.register_codes`` (imported when called: decoding needs numpy, most commands never load it)."""
    from .decode import register_codes as register

    return register(name, values)


def unregister_codes(name: str) -> None:
    from .decode import unregister_codes as unregister

    unregister(name)
