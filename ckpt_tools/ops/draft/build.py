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
from ...stream.plan import OutputTensor
from ..writing.moves import Join, Mover, Rename, Restack, Step
from ..writing.out_dtype import DTYPE_NAMES, finish_tensor, requested_for
from ..writing.output_config import set_count

if TYPE_CHECKING:
    from ...model.formats import Format
    from ...model.quant.storage import Storage
    from ...model.tables.resolve import Spec


def draft_tensors(view: MtpView, corr: Correspondence, cast_to: str | None, dequant_to: str | None
                  ) -> list[OutputTensor]:
    """Output tensors of the draft: byte copies where names change, computed where values must."""
    fmt = view.codec
    steps: list[Step] = []
    for link in corr.tensors:
        if link.columns:  # the family's fusion halves joined into the format's one fusion tensor
            steps.append(Join([s.key for s in link.columns], link.draft_key, link.spec, dequant_to))
            continue
        ref = view.ckpt.tensors.get(link.verifier_key)  # None: stored by a scheme table (its label is said)
        meta = {"source": [link.verifier_key], "source_dtype": getattr(ref, "dtype", None), "role": link.spec.role}
        if link.spec.depth is not None:
            meta["depth"] = link.spec.depth
        steps.append(Rename(link.verifier_key, link.draft_key, link.spec, meta, link.swap_halves))
    # same layout: tensor-by-tensor renames; otherwise byte-level restacking or per-expert compute;
    # with --dequant each expert piece is dequantized before it is laid out
    dequant = None
    if dequant_to:  # the expert converters' module only where experts are dequantized (frozen: one for all)
        from ...model.experts import BlockDequant

        dequant = BlockDequant(dequant_to, fmt)
    steps += [Restack(link.verifier, link.draft, dequant) for link in corr.experts]
    policy = _AsAsked(view, cast_to, dequant_to)
    Mover(view.ckpt.tensors, fmt, fmt, view.quantized).run(steps, policy)
    return policy.out


class _AsAsked:
    """extract's and init-draft's policy: each tensor cast (``--dtype``; a dtype the table pins is kept) or
    dequantized (``--dequant``), else as it is; a module a scheme table stores: dequantized or renamed."""

    def __init__(self, view: MtpView, cast_to: str | None, dequant_to: str | None) -> None:
        self.view, self.cast_to, self.dequant_to = view, cast_to, dequant_to
        self.out: list[OutputTensor] = []

    def take(self, t: OutputTensor, scale: OutputTensor | None, spec: Spec | None, step: Step) -> None:
        if isinstance(step, Rename) and step.swap:
            t.meta["swapped_halves"] = True
        if spec is None:
            t.meta.setdefault("role", "expert")
        self.out += finish_tensor(t, scale, requested_for(spec, self.cast_to), self.dequant_to, self.view.codec)

    def stored(self, step: Rename, st: Storage) -> None:
        """Dequantized (then swapped like any float tensor), or its stored tensors renamed."""
        from ...model.quant.dequant import module_outputs

        cast_to = requested_for(step.spec, self.cast_to)
        if self.dequant_to is None and (step.swap or cast_to is not None):
            why = "swapping its concat order" if step.swap else "--dtype"
            raise UsageError(f"{st.module} is {st.label}: {why} needs --dequant")
        out = module_outputs(self.view.ckpt, st, step.dst, self.dequant_to, {**step.meta, "source_dtype": st.label})
        if step.swap:
            out = [transforms.swap_halves(out[0])]
            out[0].meta["swapped_halves"] = True
        self.out += out


def expert_groups(corr: Correspondence) -> dict[str, dict]:
    """The manifest's record of each expert group: its layout in the draft and in the verifier."""
    return {e.draft.prefix: {"layout": e.draft.layout.label(), "verifier_prefix": e.verifier.prefix,
                             "verifier_layout": e.verifier.layout.label(), "experts": e.draft.count}
            for e in corr.experts}


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


def quantized_source(view: MtpView) -> bool:
    """Whether the MTP tensors a draft takes from ``view`` are stored quantized (by any scheme table)."""
    return bool(view.quantized) or any(view.codec.stores(view.ckpt.tensors[k].dtype) for _, k in view.stored())


def output_quantized(tensors: list[OutputTensor]) -> bool:
    """Whether any output tensor is stored quantized: FP8 bytes, a quantized module's stored tensors
    (``quant`` in its meta) or a scale."""
    return any(t.dtype in FP8_DTYPES or "quant" in t.meta or t.meta.get("role") == "scale" for t in tensors)


def _checkpoint_dir(root: str) -> str:
    """The checkpoint a source names: a ``config.json`` (init-draft's config-only target) means its folder."""
    head, sep, name = root.replace("\\", "/").rpartition("/")
    return (head or ".") if name == "config.json" else root
