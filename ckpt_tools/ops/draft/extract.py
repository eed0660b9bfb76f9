"""Plans for `ckpt extract`: MTP layers into a draft format, or the trunk without them.

Reads only what the plan needs: headers, then the byte ranges of the MTP tensors.
Renames are byte copies; transposes, casts and dequantization stream one band or one
expert at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ... import __version__
from ...dtypes import FLOAT_DTYPES
from ...errors import InputError, UsageError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint, raw_header, revision_of, source_name
from ...model.consistency import MTP_RULES, note_allowed
from ...model.formats import Correspondence, correspond, get_format, verifier_name_of
from ...model.gate import require_consistent
from ...model.mtp import MtpView
from ...model.quant.config import SIDE_FILES
from ...stream.fingerprint import record_inputs
from ...stream.plan import OutputFile, OutputTensor, Plan, ShardLayout, copy_of
from ..writing.carry import carried_files
from ..writing.out_dtype import dtype_arg
from ..writing.output_config import set_count
from .build import build_draft_config, draft_tensors, expert_groups, output_quantized, quantized_source


@dataclass
class ExtractRequest:
    arch: str | None = None
    layers: list[int] | None = None
    format: str = "native"
    with_embed: bool | None = None
    with_head: bool | None = None
    dtype: str = "keep"  # keep | bf16 | fp16 | fp32
    dequant: str | None = None  # None | bf16 | fp16 | fp32: FP8 block weights become this dtype
    drop_mtp: bool = False
    max_shard_size: int = 5 * 10**9
    command: str = "ckpt extract"
    speculative_tokens: int = 3
    source: str | None = None  # the source exactly as the user gave it
    verifier_name: str | None = None  # --verifier-name: what a draft config names its verifier
    notes: list[str] = field(default_factory=list)
    allow_invalid: frozenset[str] = frozenset()  # consistency rules the user lets through (--allow-invalid)


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def plan_extract(ckpt: Checkpoint, req: ExtractRequest) -> Plan:
    if req.drop_mtp:
        return plan_trunk(ckpt, req)
    gate = require_consistent(ckpt, arch=req.arch, allow=req.allow_invalid)
    view, table = gate.view, gate.table
    if view.count == 0:
        hint = (f" (but {len(view.beyond)} MTP-looking tensors are present, e.g. {view.beyond[0]})"
                if view.beyond else "")
        raise InputError(f"{ckpt.root}: the config declares no MTP layers for {table.family}{hint}; nothing to "
                         "extract", rule="no-mtp")
    view.require_complete()
    fmt = get_format(req.format)
    cast_to = dtype_arg(req.dtype, "--dtype")
    dequant_to = dtype_arg(req.dequant, "--dequant")
    corr = correspond(fmt, view, req.layers, with_embed=req.with_embed, with_head=req.with_head)
    if fmt.rename == "native" and corr.layers != list(range(len(corr.layers))):
        raise UsageError(f"--layers {corr.layers}: the native format keeps layer indices, so it needs layers "
                         f"0..k-1; use --format sglang-nextn / speculators to renumber a single layer")
    fp8_source = quantized_source(view)
    if fp8_source and dequant_to is None and fmt.rename == "roles":
        what = "quantized" if view.quantized else "FP8"
        raise UsageError(f"the source MTP weights are {what}; format {fmt.name} has no place for their scales: "
                         "pass --dequant bf16")
    tensors = draft_tensors(view, corr, cast_to, dequant_to)
    verifier = req.verifier_name or verifier_name_of(req.source or ckpt.root)
    config, omitted = build_draft_config(fmt, view, corr, tensors, dequant_to, fp8_source, verifier=verifier)
    files = [OutputFile("config.json", content=(json.dumps(config, indent=2) + "\n").encode())]
    if fmt.carry_files:
        # the verifier's model card describes the verifier, not this draft (push writes a new one); a
        # draft with no quantized tensor must not carry a side file that declares quantization
        # (hf_quant_config.json)
        dropped = {"readme.md"} | ({n.lower() for n in SIDE_FILES} if not output_quantized(tensors) else set())
        files += [f for f in carried_files(ckpt) if f.name.lower() not in dropped]
    manifest = {
        "kind": "mtp-draft",
        "source": {"path": source_name(ckpt), "revision": revision_of(ckpt)},
        "family": view.table.family,
        "format": fmt.name,
        "layers": corr.layers,
        "mtp_count_in_source": view.count,
        "concat_order": fmt.concat_order or view.table.mtp.concat_order,
        "expert_groups": expert_groups(corr),
        "source_quantization": _quant_info(view) if fp8_source else None,
        "dequantized_to": dequant_to,
        # float tensors --dequant left in their stored dtype (it decodes quantized weights only)
        "kept_dtype": kept_dtypes(tensors, dequant_to, cast_to),
        "config_fields_omitted": omitted,
        "shared_from_trunk": shared_from_trunk(view, corr),
        "tool_version": __version__,
    }
    return record_inputs(Plan(req.command, tensors, files, max_shard_size=req.max_shard_size,
                              manifest=note_allowed(manifest, gate)), source=ckpt)


def shared_from_trunk(view: MtpView, corr: Correspondence) -> dict[str, str]:
    """Role -> trunk key for each embed / head carried from the trunk (--with-embed / --with-head where
    the MTP layer has no per-layer copy), so the draft says whose tensor it holds."""
    shared = {s.key for s in view.resolved.shared.values()}
    return {t.spec.role: t.verifier_key for t in corr.tensors if t.verifier_key in shared}


def kept_dtypes(tensors: list[OutputTensor], dequant_to: str | None, cast_to: str | None) -> dict[str, str]:
    """Key -> dtype of every float tensor left in another dtype than the one asked for: with --dequant only,
    those not quantized (e.g. an F32 router bias; --dtype casts them too); with --dtype, those whose dtype
    the table pins (out_dtype.pinned)."""
    target = cast_to or dequant_to
    if target is None:
        return {}
    return {t.key: t.dtype for t in tensors
            if t.dtype in FLOAT_DTYPES and t.dtype != target and "dequantized_from" not in t.meta
            and t.meta.get("role") != "scale"}


def _quant_info(view: MtpView) -> dict:
    q = view.ckpt.config.get("quantization_config")
    info = {"method": (q or {}).get("quant_method", view.codec.quant_method), "block": list(view.codec.block),
            "scale_suffix": view.codec.scale_suffix}
    if view.quantized:
        info["schemes"] = sorted({st.scheme for st in view.quantized.values()})
        info["storage"] = sorted({st.label for st in view.quantized.values()})
    return info


# ---------------------------------------------------------------------------
# Trunk: everything but the MTP layers


# --drop-mtp writes no tensor of the MTP namespace, so what is wrong inside it does not reach the output
DROP_MTP_REPAIRS = {rule: "--drop-mtp drops every MTP-namespace tensor" for rule in MTP_RULES}


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def plan_trunk(ckpt: Checkpoint, req: ExtractRequest) -> Plan:
    gate = require_consistent(ckpt, arch=req.arch, allow=req.allow_invalid, waive=DROP_MTP_REPAIRS)
    view, table = gate.view, gate.table
    drop = set(view.keys()) | set(view.beyond) | set(view.extra)
    if not drop:
        raise InputError(f"{ckpt.root}: no MTP tensors to drop ({table.family} declares {view.count})",
                         rule="no-mtp")
    tensors: list[OutputTensor] = []
    layouts: dict[str, ShardLayout] = {}
    for shard, keys in ckpt.shard_keys.items():
        # a key its shard holds but the index does not list is invisible to loaders: not carried
        keep = [k for k in keys if k not in drop and (ckpt.index is None or ckpt.index["weight_map"].get(k) == shard)]
        if not keep:
            continue
        tensors += [copy_of(ckpt.tensors[k], k, None, shard) for k in keep]
        verbatim = raw_header(ckpt, shard) if len(keep) == len(keys) else None
        layouts[shard] = ShardLayout(order=keep, header_bytes=verbatim)
    config = set_count(view, ckpt.config.raw, 0) if table.mtp.count_field else dict(ckpt.config.raw)
    files = [OutputFile("config.json", content=(json.dumps(config, indent=2) + "\n").encode())]
    files += carried_files(ckpt)
    manifest = {
        "kind": "trunk",
        "source": {"path": source_name(ckpt), "revision": revision_of(ckpt)},
        "family": table.family,
        "dropped_mtp_layers": view.count,
        "dropped_tensors": len(drop),
        "tool_version": __version__,
    }
    note_allowed(manifest, gate)
    plan = record_inputs(Plan(req.command, tensors, files, max_shard_size=req.max_shard_size, manifest=manifest,
                              shard_layouts=layouts), source=ckpt)
    if len(layouts) == 1 and ckpt.index is None:
        plan.single_file_name = next(iter(layouts))
    return plan
