"""Tiny quantized checkpoints built with compressed-tensors' own compressors (tests only).

``ct_quantize(state, preset, ignore)`` quantizes every 2-D ``*.weight`` of a bf16 state dict that
is not ignored (compressed-tensors ``match_name``), with scales from the library's own
``calculate_qparams`` / ``generate_gparam``, and compresses it with the library's compressor for
the preset's format; ``ct_config`` is the library's ``QuantizationConfig`` as config.json holds it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def ct():
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from compressed_tensors.utils.match import match_name

    return dict(BaseCompressor=BaseCompressor, CompressionFormat=CompressionFormat,
                QuantizationConfig=QuantizationConfig, QuantizationScheme=QuantizationScheme,
                QuantizationStatus=QuantizationStatus, PRESET_SCHEMES=PRESET_SCHEMES,
                calculate_qparams=calculate_qparams, generate_gparam=generate_gparam, match_name=match_name)


def scheme_for(preset: str, weights: dict | None = None, fmt: str | None = None):
    lib = ct()
    args = dict(lib["PRESET_SCHEMES"][preset])
    if weights:
        w = args["weights"].model_copy(update=weights)
        args["weights"] = w
    from compressed_tensors.compressors.format import infer_module_format

    scheme = lib["QuantizationScheme"](targets=["Linear"], **args)
    scheme.format = fmt or infer_module_format(torch.nn.Linear, scheme).value
    return scheme


def qparams(weight: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """weight_scale / weight_zero_point / weight_global_scale the way an observer's min-max would give them."""
    lib = ct()
    from compressed_tensors.quantization import QuantizationStrategy as S

    w = weight.float()
    out: dict[str, torch.Tensor] = {}
    g = None
    if args.strategy == S.TENSOR_GROUP:
        g = lib["generate_gparam"](w.amin().reshape(1), w.amax().reshape(1))
        out["weight_global_scale"] = g
    if args.strategy == S.TENSOR:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == S.CHANNEL:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    elif args.strategy in (S.GROUP, S.TENSOR_GROUP):
        v = w.unflatten(-1, (math.ceil(w.shape[-1] / args.group_size), args.group_size))
        lo, hi = v.amin(dim=-1), v.amax(dim=-1)
    elif args.strategy == S.BLOCK:
        br, bc = args.block_structure
        r, c = w.shape
        p = torch.nn.functional.pad(w, (0, -c % bc, 0, -r % br))
        blocks = p.reshape(p.shape[0] // br, br, p.shape[1] // bc, bc)
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        raise ValueError(args.strategy)
    scale, zp = lib["calculate_qparams"](lo, hi, args, global_scale=g)
    out["weight_scale"] = scale.to(weight.dtype) if args.scale_dtype is None and scale.dtype.is_floating_point \
        and args.type == "int" else scale
    if not args.symmetric:
        out["weight_zero_point"] = zp
    return out


def ct_quantize(state: dict[str, torch.Tensor], scheme, ignore: list[str]) -> dict[str, torch.Tensor]:
    """Compress every targeted 2-D linear weight of ``state`` with compressed-tensors' own compressor.

    Layers whose width the group size does not divide stay unquantized and are appended to
    ``ignore`` by exact name (what a quantizer that skips them writes)."""
    lib = ct()
    comp = lib["BaseCompressor"].get_value_from_registry(scheme.format)
    group = scheme.weights.group_size
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        module, _, param = key.rpartition(".")
        if param != "weight" or t.dim() != 2 or any(lib["match_name"](module, i) for i in ignore) \
                or not _linear(module):
            out[key] = t
            continue
        if group and t.shape[-1] % group:
            ignore.append(module)
            out[key] = t
            continue
        sd = {"weight": t, **qparams(t, scheme.weights)}
        for k, v in comp.compress(sd, scheme).items():
            out[f"{module}.{k}"] = v.contiguous()
    return out


def _linear(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return not (last.endswith("norm") or last in ("embed_tokens", "embed", "gate") or "layernorm" in last)


def ct_config(scheme, ignore: list[str]) -> dict:
    lib = ct()
    qc = lib["QuantizationConfig"](config_groups={"group_0": scheme}, ignore=ignore, format=scheme.format,
                                   quantization_status=lib["QuantizationStatus"].COMPRESSED)
    return qc.model_dump(exclude_none=False, mode="json") | {"quant_method": "compressed-tensors"}


def write_quantized(src: Path, dst: Path, scheme, ignore: list[str]) -> Path:
    """``src`` (a bf16 fixture) quantized into ``dst`` (model.safetensors + config.json)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    state = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(f))
    ignore = list(ignore)
    save_file(ct_quantize(state, scheme, ignore), dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = ct_config(scheme, ignore)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
