"""A draft built from a verifier's MTP layers (extract, init-draft): its tensors in a format's names,
layouts and dtypes (``draft_tensors``) and its config.json (``build_draft_config``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...dtypes import FLOAT_DTYPES, FP8_DTYPES
from ...errors import UsageError
from ...model.formats import Correspondence, draft_config, format_env, verifier_name_of
from ...model.mtp import MtpView
from ...numeric import transforms
from ...stream.plan import CopyBytes, OutputTensor
from ..writing.out_dtype import DTYPE_NAMES, finish_tensor, requested_for
from ..writing.output_config import set_count

if TYPE_CHECKING:
    from ...model.formats import Format


def draft_tensors(view: MtpView, corr: Correspondence, cast_to: str | None, dequant_to: str | None
                  ) -> list[OutputTensor]:
    """Output tensors of the draft: byte copies where names change, computed where values must."""
    ckpt, fmt = view.ckpt, view.codec
    out: list[OutputTensor] = []
    requested = cast_to
    for link in corr.tensors:
        cast_to = requested_for(link.spec, requested)  # a dtype the table pins is kept whatever --dtype says
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
        from ...model.experts import BlockDequant, convert_group

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
    from ...model.quant.dequant import module_outputs

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
        out += finish_tensor(t, None, cast_to, dequant_to, view.codec)
    return out


def _joined(view: MtpView, link, dequant_to: str | None) -> OutputTensor:
    """``link.columns`` side by side along the last axis (FP8 halves are dequantized first)."""
    ckpt, fmt = view.ckpt, view.codec
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


def build_draft_config(fmt: Format, view: MtpView, corr: Correspondence, tensors, dequant_to, fp8_source,
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
            config = set_count(view, config, len(corr.layers))
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


def _checkpoint_dir(root: str) -> str:
    """The checkpoint a source names: a ``config.json`` (init-draft's config-only target) means its folder."""
    head, sep, name = root.replace("\\", "/").rpartition("/")
    return (head or ".") if name == "config.json" else root
