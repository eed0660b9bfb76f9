"""Quantize tiny fixture weights the way real tools store them.

Each producer takes ``{module name: BF16 weight [out, in]}`` and returns the tensors the tool writes,
keyed by full checkpoint name. Where a library exists its own code does the work: compressed-tensors
(``apply_quantization_config``, llm-compressor's min-max observers, ``ModelCompressor`` compresses and
writes ``quantization_config``); ModelOpt NVFP4 is compressed-tensors NVFP4 renamed by the inverse of
``ModelOptNvfp4Converter``, with 0-d F32 per-tensor scales. DeepSeek block FP8 with UE8M0 scales
(V3.1 / V3.2) and the V4 layout (F8_E8M0 128x128 ``.scale``; experts FP4 e2m1 in I8 with per-32 scales)
have no quantizer library: their FP4 codes and MX exponents come from compressed-tensors' MXFP4
compressor (the same OCP MX math). compressed-tensors is imported lazily.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr

import torch

EXTRA_HINT = "compressed-tensors is not installed; install the extra: pip install 'ckpt-tools[quant]'"
FP8_MAX = 448.0
FP4_MAX = 6.0
ACT_AMAX = 8.0  # stand-in activation range for static input scales (no calibration data here)


def require_compressed_tensors():
    """The compressed-tensors module, or an ImportError naming the extra that installs it."""
    try:
        import compressed_tensors
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(EXTRA_HINT) from e
    return compressed_tensors


@contextmanager
def _quiet() -> Iterator[None]:
    """compressed-tensors logs through loguru and draws tqdm bars; a fixture builder stays silent."""
    from loguru import logger

    logger.disable("compressed_tensors")
    try:
        with redirect_stderr(io.StringIO()):  # tqdm resolves sys.stderr when a bar starts
            yield
    finally:
        logger.enable("compressed_tensors")


# ---------------------------------------------------------------------------
# compressed-tensors


def ct_scheme(preset: str, group_size: int | None = None):
    """A compressed-tensors preset scheme targeting ``Linear``, optionally with another group size."""
    require_compressed_tensors()
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    return scheme


def ct_group(preset: str, group_size: int | None = None) -> int | None:
    """The input-feature divisor a module needs for this scheme (None: any width)."""
    w = ct_scheme(preset, group_size).weights
    return w.group_size if w.strategy in ("group", "tensor_group") else None


def _module_tree(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, w in weights.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data.copy_(w)
        parent.add_module(leaf, lin)
    return root


def _observed(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale-slot min and max of ``w`` for the strategy, as llm-compressor's min-max observer reduces."""
    s = args.strategy
    if s == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if s == "channel":
        return w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    if s in ("group", "tensor_group"):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(dim=-1), g.amax(dim=-1)
    if s == "block":
        from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

        bh, bw = args.block_structure
        p = maybe_pad_tensor_for_block_quant(w, (bh, bw))
        b = p.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        return b.amin(dim=(1, 3)), b.amax(dim=(1, 3))
    raise ValueError(f"no weight observer for strategy {s!r}")


def _calibrate(module: torch.nn.Module) -> None:
    """Fill the qparams apply_quantization_config registered, from the weight (and a stand-in activation range)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = module.quantization_scheme
    w = module.weight.data
    args = scheme.weights
    gscale = None
    if args.strategy == "tensor_group":
        gscale = generate_gparam(w.amin(), w.amax())
        module.weight_global_scale.data.copy_(gscale)
    lo, hi = _observed(w, args)
    scale, zp = calculate_qparams(lo, hi, args, global_scale=gscale)
    module.weight_scale.data.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zp)
    act = scheme.input_activations
    if act is not None and not act.dynamic:  # static input scale: a fixed stand-in range
        amax = torch.tensor([ACT_AMAX])
        s, _ = calculate_qparams(-amax, amax, act)
        module.input_scale.data.copy_(s)
    if act is not None and act.strategy == "tensor_group":
        module.input_global_scale.data.copy_(generate_gparam(torch.tensor(-ACT_AMAX), torch.tensor(ACT_AMAX)))


def ct_compress(weights: dict[str, torch.Tensor], scheme, ignore: list[str]) -> tuple[dict[str, torch.Tensor], object]:
    """compressed-tensors' own save path over ``weights``; modules named in ``ignore`` stay as they are.

    Returns the compressed state dict of every module and the ``ModelCompressor`` whose
    ``update_config`` writes ``quantization_config`` (its ignore list is the library's own:
    every Linear left unquantized, by exact name).
    """
    require_compressed_tensors()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    with _quiet():
        model = _module_tree(weights)
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
        for _, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _calibrate(module)
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        compressor.remove_decompression_hook(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, compressor


# ---------------------------------------------------------------------------
# ModelOpt


def modelopt_nvfp4(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors: U8 ``weight`` [out, in/2], F8_E4M3 ``weight_scale`` [out, in/16],
    0-d F32 ``weight_scale_2`` and ``input_scale``."""
    tensors, _ = ct_compress(weights, ct_scheme("NVFP4"), [])
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        module, _, param = key.rpartition(".")
        if param == "weight_packed":
            out[f"{module}.weight"] = t
        elif param == "weight_global_scale":
            out[f"{module}.weight_scale_2"] = (1 / t).reshape(())
        elif param == "input_global_scale":
            out[f"{module}.input_scale"] = (1 / t).reshape(())
        else:
            out[key] = t
    return out


def modelopt_fp8(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt FP8 per-tensor: F8_E4M3 ``weight``, 0-d F32 ``weight_scale = amax / 448`` and ``input_scale``.

    The rounding is compressed-tensors' ``quantize`` with that scale.
    """
    require_compressed_tensors()
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        scale = (w.float().abs().amax() / FP8_MAX).clamp(min=2.0**-126).reshape(1)
        out[f"{name}.weight"] = quantize(x=w.float(), scale=scale, zero_point=None, args=args,
                                         dtype=torch.float8_e4m3fn)
        out[f"{name}.weight_scale"] = scale.reshape(())
        out[f"{name}.input_scale"] = torch.tensor(ACT_AMAX / FP8_MAX, dtype=torch.float32)
    return out


# ---------------------------------------------------------------------------
# DeepSeek-style block FP8 and the FP8 + FP4 release layout


def _pow2_scales(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """UE8M0 scales: the power of two at or above ``amax / qmax`` (DeepGEMM's ceil rounding), floored at 2**-126."""
    x = (amax.float() / qmax).clamp(min=2.0**-126)
    return torch.exp2(torch.ceil(torch.log2(x)))


def fp8_block_ue8m0(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 weight, F32 power-of-two scale grid [ceil(out/br), ceil(in/bc)]); partial edge tiles."""
    rows, cols = w.shape
    br, bc = block
    gr, gc = math.ceil(rows / br), math.ceil(cols / bc)
    pad = torch.zeros(gr * br, gc * bc, dtype=torch.float32)
    pad[:rows, :cols] = w.float()
    amax = pad.abs().unflatten(0, (gr, br)).unflatten(-1, (gc, bc)).amax(dim=(1, 3))
    scale = _pow2_scales(amax, FP8_MAX)
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # exact division: powers of two
    return q, scale


def fp4_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP4 e2m1 in I8 [out, in/2] (low nibble first) with F8_E8M0 ``.scale`` [out, in/32], via the MXFP4 compressor."""
    tensors, _ = ct_compress(weights, ct_scheme("MXFP4A16"), [])
    out: dict[str, torch.Tensor] = {}
    for name in weights:
        out[f"{name}.weight"] = tensors[f"{name}.weight_packed"].view(torch.int8)
        out[f"{name}.scale"] = tensors[f"{name}.weight_scale"].view(torch.float8_e8m0fnu)
    return out
