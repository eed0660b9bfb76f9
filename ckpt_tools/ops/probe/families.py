"""Which families `ckpt probe` measures: the table engine's support, decided from each table's fixture config
without weights (what `ckpt tables --probe` reports)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ...errors import InputError
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
    from ...io.config import ConfigView
    from ...model.tables.resolve import resolve
    from .load import model_class
    from .probe import transformers_module

    transformers = transformers_module("ckpt tables --probe")

    if table.kind != "mtp" or not table.fixture:
        return Support(False, "no MTP table with a fixture config")
    fixture = copy.deepcopy(table.fixture)  # transformers normalises nested values in place; the table is cached
    try:
        config = transformers.AutoConfig.for_model(fixture.pop("model_type", None), **fixture)
        cls = model_class(config)
    except InputError as e:
        return Support(False, e.message)
    except Exception as e:  # any refusal of transformers' config class (its validators raise their own types)
        return Support(False, f"transformers has no model for it ({_first_line(e)})")
    reference = bool(getattr(config.get_text_config(), "num_mtp_layers", None))
    unplaced = sorted(set(table.mtp.glue) - set(GLUE_ROLES))
    if unplaced:
        return Support(False, f"glue role(s) {unplaced} have no place in the engine's step", reference)
    try:
        res = resolve(table, ConfigView(dict(table.fixture)), mtp_count=1)
        for layer in res.layers:
            match_trunk_layers(res, layer)
        main = _meta_model(cls, config)
        norm = final_norm_module(main, res, None).to_empty(device="cpu")
        check_norm_convention(norm, table.norm, table.family, None)
    except InputError as e:
        return Support(False, e.message, reference)
    return Support(True, "", reference)


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"


def _meta_model(cls, config):
    """The family's transformers model on the meta device; one whose class cannot be built from the fixture config
    (a composite config its text model reads as flat, say) is a family probe does not support, not a crash of
    the whole listing."""
    try:
        with torch.device("meta"):
            return cls(copy.deepcopy(config))
    except Exception as e:
        raise InputError(f"transformers cannot build its model from the table's fixture config ({_first_line(e)})",
                         rule="probe-family") from None


def probe_row(table) -> dict:
    """``probe``: whether our engine builds the family's MTP; ``probe_reference``: whether transformers' MtpModel
    does too (probe then checks the engine against it); ``probe_reason``: why not. ``probe_engines``: per serving
    engine, the class that would run the family's MTP (transformers: our table engine; vLLM: the table's class)."""
    s = family_support(table)
    engines = {"transformers": "ckpt table engine" + (" + MtpModel" if s.reference else "") if s.engine else None,
               "vllm": f"{table.vllm.cls} ({table.vllm.check})" if table.vllm is not None else None}
    return {"probe": s.engine, "probe_reference": s.reference, **({"probe_reason": s.reason} if s.reason else {}),
            "probe_engines": engines}
