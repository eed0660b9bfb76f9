"""What vLLM reads of a ModelOpt checkpoint's two quantization files and of its KV-cache scales (run in .venv-vllm).

Prints one JSON object: ``quant_algo``, the algo vLLM's config loader takes for the checkpoint directory given
(config.json's quantization_config, or hf_quant_config.json when config.json has none); ``kv``, for each
(k_scale, v_scale) pair, what BaseKVCacheMethod.process_weights_after_loading makes of it with an FP8 cache.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.transformers_utils.config import get_config


def kv(k: float, v: float) -> str:
    layer = torch.nn.Module()
    layer.kv_cache_dtype = "fp8"
    method = BaseKVCacheMethod(None)
    method.create_weights(layer)
    for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale", "_k_scale_cpu", "_v_scale_cpu"):
        setattr(layer, name, torch.tensor(1.0))
    layer.k_scale.data.fill_(k)
    layer.v_scale.data.fill_(v)
    try:
        method.process_weights_after_loading(layer)
    except AssertionError:
        return "refused"
    return f"k={layer._k_scale_float:.3g} v={layer._v_scale_float:.3g}"


def main() -> None:
    config = get_config(sys.argv[1], trust_remote_code=False)
    qc = config.quantization_config  # either file's object, as vLLM's ModelOpt from_config reads both shapes
    algo = qc["quantization"].get("quant_algo") if isinstance(qc.get("quantization"), dict) else qc.get("quant_algo")
    pairs = [(0.05, 0.05), (0.0, 0.05), (float("nan"), 0.05), (-0.5, -0.5), (0.05, 0.0), (0.05, float("nan")),
             (0.05, -0.5)]
    print(json.dumps({"quant_algo": algo,
                      "kv": {f"{k} {v}": kv(k, v) for k, v in pairs}}))


if __name__ == "__main__":
    main()
