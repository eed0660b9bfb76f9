"""Plans for `ckpt extract`: MTP layers into a draft format, or the trunk without them.

Reads only what the plan needs: headers, then the byte ranges of the MTP tensors.
Renames are byte copies; transposes, casts and dequantization stream one band or one
expert at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import __version__
from ..dtypes import FLOAT_DTYPES, FP8_DTYPES, lookup
from ..errors import InputError, UsageError
from ..io.checkpoint import Checkpoint, raw_header, revision_of, source_name
from ..model.consistency import MTP_RULES, note_allowed
from ..model.formats import Correspondence, Format, correspond, draft_config, format_env, get_format, verifier_name_of
from ..model.gate import require_consistent
from ..model.mtp import MtpView
from ..model.quant.companions import WeightFormat
from ..model.quant.config import SIDE_FILES
from ..numeric import transforms
from ..stream.fingerprint import record_inputs
from ..stream.plan import CopyBytes, OutputFile, OutputTensor, Plan, ShardLayout

DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


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


def dtype_arg(value: str | None, flag: str) -> str | None:
    if value is None or value == "keep":
        return None
    try:
        name = lookup(value).name
    except KeyError:
        raise UsageError(f"{flag} {value!r}: use bf16, fp16 or fp32") from None
    if name not in FLOAT_DTYPES:
        raise UsageError(f"{flag} {value!r}: use bf16, fp16 or fp32")
    return name


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
    fmt_q = view.block_format
    fp8_source = bool(view.quantized) or any(fmt_q.stores(ckpt.tensors[k].dtype) for _, k in view.stored())
    if fp8_source and dequant_to is None and fmt.rename == "roles":
        what = "quantized" if view.quantized else "FP8"
        raise UsageError(f"the source MTP weights are {what}; format {fmt.name} has no place for their scales: "
                         "pass --dequant bf16")
    tensors = draft_tensors(view, corr, cast_to, dequant_to)
    verifier = req.verifier_name or verifier_name_of(req.source or ckpt.root)
    config, omitted = _draft_config(fmt, view, corr, tensors, dequant_to, fp8_source, verifier=verifier)
    files = [OutputFile("config.json", content=(json.dumps(config, indent=2) + "\n").encode())]
    if fmt.carry_files:
        # the verifier's model card describes the verifier, not this draft (push writes a new one); a
        # draft with no quantized tensor must not carry a side file that declares quantization
        # (hf_quant_config.json)
        dropped = {"readme.md"} | ({n.lower() for n in SIDE_FILES} if not output_quantized(tensors) else set())
        files += [f for f in carried_files(ckpt) if f.name.lower() not in dropped]
    groups = {
        e.draft.prefix: {"layout": e.draft.layout.label(), "verifier_prefix": e.verifier.prefix,
                         "verifier_layout": e.verifier.layout.label(), "experts": e.draft.count}
        for e in corr.experts
    }
    manifest = {
        "kind": "mtp-draft",
        "source": {"path": source_name(ckpt), "revision": revision_of(ckpt)},
        "family": view.table.family,
        "format": fmt.name,
        "layers": corr.layers,
        "mtp_count_in_source": view.count,
        "concat_order": fmt.concat_order or view.table.mtp.concat_order,
        "expert_groups": groups,
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


def draft_tensors(view: MtpView, corr: Correspondence, cast_to: str | None, dequant_to: str | None
                  ) -> list[OutputTensor]:
    """Output tensors of the draft: byte copies where names change, computed where values must."""
    ckpt, fmt = view.ckpt, view.block_format
    out: list[OutputTensor] = []
    requested = cast_to
    for link in corr.tensors:
        # a dtype the release fixes (table dtype_fixed) is kept whatever --dtype says: rule stored-dtype
        cast_to = None if link.spec.dtype_fixed else requested
        if link.columns:  # the family's fusion halves joined into the format's one fusion tensor
            out += finish_tensor(_joined(view, link, dequant_to), None, cast_to, None, fmt)
            continue
        ref = ckpt.tensors.get(link.verifier_key) or ckpt.tensors[view.quantized[link.verifier_key].all_keys()[0]]
        meta = {"source": [link.verifier_key], "source_dtype": ref.dtype, "role": link.spec.role}
        if link.spec.depth is not None:
            meta["depth"] = link.spec.depth
        st = view.quantized.get(link.verifier_key)
        if st is not None:  # stored by a quantization scheme table's format
            out += _quantized(view, st, link.draft_key, link.swap_halves, cast_to, dequant_to, meta)
            continue
        t = OutputTensor(link.draft_key, ref.dtype, ref.shape, CopyBytes([ref.segment()]), meta=meta)
        scale = None
        if fmt.stores(ref.dtype):
            sref = ckpt.tensors[fmt.scale_key(link.verifier_key)]
            scale = OutputTensor(fmt.scale_key(link.draft_key), sref.dtype, sref.shape,
                                 CopyBytes([sref.segment()]), meta={"source": [sref.key], "role": "scale"})
        if link.swap_halves:
            if scale is not None:
                raise UsageError(f"{ref.key}: swapping the concat order of an FP8 fusion weight needs --dequant")
            t = transforms.swap_halves(t)
            t.meta["swapped_halves"] = True
        out += finish_tensor(t, scale, cast_to, dequant_to, fmt)
    cast_to = requested
    for link in corr.experts:
        from ..model.experts import BlockDequant, convert_group

        if any(t.key in view.quantized for t in link.verifier.tensors()):
            out += _quantized_experts(view, link, cast_to, dequant_to)
            continue

        # same layout: tensor-by-tensor renames; otherwise byte-level restacking or per-expert compute;
        # with --dequant each expert piece is dequantized before it is laid out
        group_out = convert_group(link.verifier, ckpt.tensors, link.draft, fmt=fmt,
                                  dequant=BlockDequant(dequant_to, fmt) if dequant_to else None)
        by_key = {t.key: t for t in group_out}
        scales = {fmt.scale_key(t.key) for t in group_out if fmt.stores(t.dtype)}
        for t in group_out:
            t.meta.setdefault("role", "expert")
            if t.key in scales:
                continue  # travels with its weight
            scale = by_key.get(fmt.scale_key(t.key)) if fmt.stores(t.dtype) else None
            out += finish_tensor(t, scale, cast_to, dequant_to, fmt)
    return out


def _quantized(view: MtpView, st, draft_key: str, swap: bool, cast_to, dequant_to, meta: dict) -> list[OutputTensor]:
    """A module a quantization scheme table describes: dequantized (then swapped / laid out like any
    float tensor), or its stored tensors renamed."""
    from ..model.quant.dequant import module_outputs

    if dequant_to is None and (swap or cast_to is not None):
        why = "swapping its concat order" if swap else "--dtype"
        raise UsageError(f"{st.module} is {st.label}: {why} needs --dequant")
    out = module_outputs(view.ckpt, st, draft_key, dequant_to, {**meta, "source_dtype": st.label})
    if swap:
        out = [transforms.swap_halves(out[0])]
        out[0].meta["swapped_halves"] = True
    return out


def _quantized_experts(view: MtpView, link, cast_to, dequant_to) -> list[OutputTensor]:
    """Routed experts stored by a quantization scheme table's format: expert by expert, in the layout they
    have (restacking packed experts into another layout is not supported)."""
    src, dst = link.verifier, link.draft
    if src.layout != dst.layout:
        raise UsageError(f"{src.prefix}: the experts are stored quantized ({view.quantized[src.tensors()[0].key].label}"
                         f" ...); the {dst.layout.label()} layout of this format needs them restacked, which is "
                         "supported for float and block-FP8 experts only: extract --format native --dequant bf16, "
                         "then convert that")
    out: list[OutputTensor] = []
    for s, d in zip(src.tensors(), dst.tensors(), strict=True):
        meta = {"source": [s.key], "role": "expert"}
        st = view.quantized.get(s.key)
        if st is not None:
            out += _quantized(view, st, d.key, False, cast_to, dequant_to, meta)
            continue
        ref = view.ckpt.tensors[s.key]
        t = OutputTensor(d.key, ref.dtype, ref.shape, CopyBytes([ref.segment()]),
                         meta={**meta, "source_dtype": ref.dtype})
        out += finish_tensor(t, None, cast_to, dequant_to, view.block_format)
    return out


def _joined(view: MtpView, link, dequant_to: str | None) -> OutputTensor:
    """``link.columns`` side by side along the last axis (FP8 halves are dequantized first)."""
    ckpt, fmt = view.ckpt, view.block_format
    parts = []
    for spec in link.columns:
        ref = ckpt.tensors[spec.key]
        t = OutputTensor(spec.key, ref.dtype, ref.shape, CopyBytes([ref.segment()]), meta={"source": [spec.key]})
        if fmt.stores(ref.dtype):
            if dequant_to is None:
                raise UsageError(f"{spec.key} is FP8: joining it into {link.draft_key} needs --dequant")
            sref = ckpt.tensors[fmt.scale_key(spec.key)]
            scale = OutputTensor(sref.key, sref.dtype, sref.shape, CopyBytes([sref.segment()]))
            t = fmt.decode(t, scale, dequant_to)
        parts.append(t)
    t = transforms.concat_columns(parts, link.draft_key)
    t.meta.update(role=link.spec.role, source_dtype=parts[0].dtype)
    if link.spec.depth is not None:
        t.meta["depth"] = link.spec.depth
    return t


def finish_tensor(t: OutputTensor, scale: OutputTensor | None, cast_to, dequant_to, fmt: WeightFormat
                  ) -> list[OutputTensor]:
    """``t`` (and its ``scale`` companion in block format ``fmt``) as written: dequantized into one tensor (the
    format's decoder), cast, or as they are."""
    if fmt.stores(t.dtype):
        if dequant_to is not None:
            if scale is None:
                raise InputError(f"FP8 weight {t.key} has no block scale to dequantize with", rule="fp8-scale")
            return [fmt.decode(t, scale, dequant_to)]
        if cast_to is not None:
            raise UsageError(f"{t.key} is FP8: --dtype cannot cast block-quantized weights; add --dequant {cast_to}")
        return [t] + ([scale] if scale is not None else [])
    if cast_to is not None and t.dtype in FLOAT_DTYPES:
        t = transforms.cast(t, cast_to)
    return [t] + ([scale] if scale is not None else [])


def _draft_config(fmt: Format, view: MtpView, corr: Correspondence, tensors, dequant_to, fp8_source,
                  verifier: str | None = None):
    ckpt, res = view.ckpt, view.resolved
    src = ckpt.config.raw
    float_dtypes = [t.dtype for t in tensors if t.dtype in FLOAT_DTYPES and t.meta.get("role") != "scale"]
    main = max(set(float_dtypes), key=float_dtypes.count) if float_dtypes else res.dtype
    text = ckpt.config.text
    env = format_env(fmt, view, corr.layers)
    env.update(
        dtype_name=DTYPE_NAMES.get(main, "bfloat16"),
        speculative_tokens=3,
        verifier_name=verifier or verifier_name_of(_checkpoint_dir(ckpt.root)),
        # the verifier config.json's own (top-level) list, as speculators records it
        verifier_architectures=src.get("architectures") or ckpt.config.architectures()[:1] or None,
        text_config={k: v for k, v in text.items() if k != "quantization_config"},
        engine_arch=res.table.engines.get(fmt.requires_engine or "", None),
        has_experts=bool(corr.experts),
    )
    config, omitted = draft_config(fmt, src, env)
    if fmt.config.base == "source":
        if fmt.rename == "native" and len(corr.layers) != view.count:
            config = _set_count(view, config, len(corr.layers))
        if not output_quantized(tensors):
            # the config describes the draft: nothing in it is quantized (dequantized, or the quantizer left
            # the MTP layers in BF16), so no quantization_config may tell loaders otherwise
            config.pop("quantization_config", None)
            if isinstance(config.get("text_config"), dict):
                config["text_config"].pop("quantization_config", None)
        if dequant_to is not None and fp8_source:
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = DTYPE_NAMES[dequant_to]
    return config, omitted


def output_quantized(tensors: list[OutputTensor]) -> bool:
    """Whether any output tensor is stored quantized: FP8 bytes, a quantized module's stored tensors
    (``quant`` in its meta) or a scale."""
    return any(t.dtype in FP8_DTYPES or "quant" in t.meta or t.meta.get("role") == "scale" for t in tensors)


def kept_dtypes(tensors: list[OutputTensor], dequant_to: str | None, cast_to: str | None) -> dict[str, str]:
    """Key -> dtype of every float tensor left in another dtype than the one asked for: with --dequant only,
    those not quantized (e.g. an F32 router bias; --dtype casts them too); with --dtype, those whose dtype
    the release fixes (table dtype_fixed)."""
    target = cast_to or dequant_to
    if target is None:
        return {}
    return {t.key: t.dtype for t in tensors
            if t.dtype in FLOAT_DTYPES and t.dtype != target and "dequantized_from" not in t.meta
            and t.meta.get("role") != "scale"}


def _checkpoint_dir(root: str) -> str:
    """The checkpoint a source names: a ``config.json`` (init-draft's config-only target) means its folder."""
    head, sep, name = root.replace("\\", "/").rpartition("/")
    return (head or ".") if name == "config.json" else root


def _set_count(view: MtpView, config: dict, n: int) -> dict:
    from ..io.config import ConfigView

    table = view.table
    field_var = table.mtp.count_field
    if field_var is None:
        raise UsageError(f"table {table.family} has no mtp.count_field; cannot change the MTP count")
    keys = table.config[field_var].keys
    cv = ConfigView(config)
    present = [k for k in keys if cv.has(k)] or keys[:1]
    return cv.with_values({present[0]: n}).raw


def _quant_info(view: MtpView) -> dict:
    q = view.ckpt.config.get("quantization_config")
    info = {"method": (q or {}).get("quant_method", "fp8"), "block": list(view.block_format.block),
            "scale_suffix": view.block_format.scale_suffix}
    if view.quantized:
        info["schemes"] = sorted({st.scheme for st in view.quantized.values()})
        info["storage"] = sorted({st.label for st in view.quantized.values()})
    return info


def carried_files(ckpt: Checkpoint) -> list[OutputFile]:
    """Tokenizer, generation config, chat template, code, README: copied as they are."""
    if ckpt.local_dir is None:
        fetch = getattr(ckpt, "fetch_file", None)
        return [OutputFile(name, source=fetch(name)) for name in ckpt.files] if fetch else []
    return [OutputFile(name, source=ckpt.local_dir / name) for name in ckpt.files]


# ---------------------------------------------------------------------------
# Trunk: everything but the MTP layers


# --drop-mtp writes no tensor of the MTP namespace, so what is wrong inside it does not reach the output
DROP_MTP_REPAIRS = {rule: "--drop-mtp drops every MTP-namespace tensor" for rule in MTP_RULES}


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
        for k in keep:
            ref = ckpt.tensors[k]
            tensors.append(OutputTensor(k, ref.dtype, ref.shape, CopyBytes([ref.segment()]), shard=shard,
                                        meta={"source": [k]}))
        verbatim = raw_header(ckpt, shard) if len(keep) == len(keys) else None
        layouts[shard] = ShardLayout(order=keep, header_bytes=verbatim)
    config = _set_count(view, ckpt.config.raw, 0) if table.mtp.count_field else dict(ckpt.config.raw)
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
