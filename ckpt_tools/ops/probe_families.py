"""Which families `ckpt probe` measures: the table engine's support, decided from each table's fixture config
without weights (what `ckpt tables --probe` reports)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..errors import InputError
from .mtp_engine import GLUE_ROLES, check_norm_convention, final_norm_module, match_trunk_layers


@dataclass
class Support:
    """Whether the engine builds a family's MTP (from its table's fixture config), and why not."""

    engine: bool
    reason: str = ""
    reference: bool = False  # transformers' MtpModel builds MTP layers for it too (the cross-check)


def family_support(table) -> Support:
    """Checked without weights: transformers knows the fixture config and its model class; every glue role has a
    place in the step; every MTP sub-block has a trunk layer of the same tensors; the trunk's final norm is a
    module of that class (built on the meta device) and computes the table's norm convention."""
    from ..io.config import ConfigView
    from ..model.tables.resolve import resolve
    from .probe import transformers_module
    from .probe_load import model_class

    transformers = transformers_module("ckpt tables --probe")

    if table.kind != "mtp" or not table.fixture:
        return Support(False, "no MTP table with a fixture config")
    fixture = copy.deepcopy(table.fixture)  # transformers normalises nested values in place; the table is cached
    try:
        config = transformers.AutoConfig.for_model(fixture.pop("model_type", None), **fixture)
        cls = model_class(config)
    except (ValueError, KeyError, TypeError) as e:
        return Support(False, f"transformers has no model for it ({str(e).splitlines()[0][:120]})")
    except InputError as e:
        return Support(False, e.message)
    reference = bool(getattr(config.get_text_config(), "num_mtp_layers", None))
    unplaced = sorted(set(table.mtp.glue) - set(GLUE_ROLES))
    if unplaced:
        return Support(False, f"glue role(s) {unplaced} have no place in the engine's step", reference)
    try:
        res = resolve(table, ConfigView(dict(table.fixture)), mtp_count=1)
        for layer in res.layers:
            match_trunk_layers(res, layer)
        with torch.device("meta"):
            main = cls(copy.deepcopy(config))
        norm = final_norm_module(main, res, None).to_empty(device="cpu")
        check_norm_convention(norm, table.norm, table.family, None)
    except InputError as e:
        return Support(False, e.message, reference)
    return Support(True, "", reference)
