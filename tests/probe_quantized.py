"""Quantized copies of the tiny trained verifier (tests/probe_model.py), for `ckpt probe`'s load checks.

Every Linear weight of the trunk and the MTP layer (attention, experts, shared experts, eh_proj) is
quantized; the LM head, the embedding, the routers (``mlp.gate``) and the norms stay as stored, as
ModelOpt 0.47's FP8 export leaves them (its hf_quant_config.json excludes ``lm_head``,
``model.embed_tokens`` and the routers). ModelOpt FP8: ``ckpt_tools.testing.quantizers.modelopt_fp8``
(F8_E4M3 ``weight``, 0-d F32 ``weight_scale`` and ``input_scale``) with ModelOpt's config.json
``quantization_config`` (``quant_method: modelopt``) and hf_quant_config.json. compressed-tensors
FP8_DYNAMIC: compressed-tensors' own compressor and ``update_config``; there the dense identity layers
stay as stored (ignored by a regex), see ``ct_fp8_dynamic``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EXCLUDED = ("lm_head", "model.embed_tokens")


def _linear(key: str, t: torch.Tensor) -> bool:
    return (key.endswith(".weight") and t.ndim == 2 and "norm" not in key and not key.endswith("mlp.gate.weight")
            and key.removesuffix(".weight") not in EXCLUDED)


def _rewrite(src: Path, out: Path, quantize, skip=lambda module: False) -> None:
    """A copy of ``src`` whose Linear weights (but those of modules ``skip`` names) ``quantize({module: weight})``
    replaced, shard by shard."""
    shutil.copytree(src, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        weights = {k.removesuffix(".weight"): v for k, v in tensors.items()
                   if _linear(k, v) and not skip(k.removesuffix(".weight"))}
        if not weights:
            continue
        for m in weights:
            del tensors[f"{m}.weight"], wm[f"{m}.weight"]
        new = quantize(weights)
        tensors.update(new)
        wm.update({k: f.name for k in new})
        save_file(tensors, str(f), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def modelopt_fp8(src: Path, out: Path) -> Path:
    from ckpt_tools.testing import quantizers as q
    from ckpt_tools.testing.quantized import _modelopt_config_json

    _rewrite(src, out, q.modelopt_fp8)
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": list(EXCLUDED)}}
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _modelopt_config_json(hf_quant)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def ct_fp8_dynamic(src: Path, out: Path) -> Path:
    from ckpt_tools.testing import quantizers as q

    compressors = []

    def quantize(weights):
        tensors, compressor = q.ct_compress(weights, q.ct_scheme("FP8_DYNAMIC"), [])
        compressors.append(compressor)
        return tensors

    # The dense identity layers (2 .. depth-2: their outputs are exact zeros, quantized or not) stay as stored,
    # named by a regex in the ignore list: compressed-tensors' per-token FP8 activations in ~400 of them made
    # one probe 6x slower. Quantized: the trained layers, the MoE identity layer (experts) and the MTP layer.
    identity = re.compile(r"model\.layers\.(\d+)\.")
    depth = json.loads((src / "config.json").read_text())["num_hidden_layers"]

    def skip(module: str) -> bool:
        m = identity.match(module)
        return m is not None and 2 <= int(m.group(1)) < depth - 1

    _rewrite(src, out, quantize, skip)
    compressor = compressors[0]
    ignored = "|".join(str(i) for i in range(2, depth - 1))
    # what llm-compressor's recipes ignore, and the identity layers
    compressor.quantization_config.ignore = [*EXCLUDED, f"re:model\\.layers\\.({ignored})\\..*"]
    compressor.update_config(str(out))
    return out


def add_tensor(src: Path, out: Path, key: str, tensor: torch.Tensor) -> Path:
    """A copy of ``src`` with one more tensor, in its own indexed shard."""
    shutil.copytree(src, out)
    save_file({key: tensor}, str(out / "model-extra.safetensors"), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"][key] = "model-extra.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out
