"""Tiny quantized checkpoints built with compressed-tensors' own compressors (tests only).

``ct_quantize(state, preset, ignore)`` quantizes every 2-D ``*.weight`` of a bf16 state dict that
is not ignored (compressed-tensors ``match_name``), with scales from the library's own
``calculate_qparams`` / ``generate_gparam``, and compresses it with the library's compressor for
the preset's format; ``ct_config`` is the library's ``QuantizationConfig`` as config.json holds it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt_tools.arrays import decode_floats, numpy_storage_dtype


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``path``."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - safe_open has no iteration
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    v = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(v), b.contiguous().view(v))


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


def group_absmax(weights: dict[str, torch.Tensor], module: str, fused: dict[str, list[str]]) -> float | None:
    """max |w| over the engines' fused group ``module`` is a shard of (a family table's fused_modules), when
    ``weights`` (keyed ``module.weight``) hold every shard."""
    parent, _, leaf = module.rpartition(".")
    for shards in fused.values():
        keys = [f"{parent}.{s}.weight" for s in shards]
        if leaf in shards and all(k in weights for k in keys):
            return max(float(weights[k].abs().max()) for k in keys)
    return None


def ct_compress_fused(weights: dict[str, torch.Tensor], quantization_config: dict,
                      fused: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compression of each weight (module -> weight, in the model dtype) with the
    config's group: scales from the library's ``calculate_qparams`` / ``generate_gparam`` over a min-max
    observation (llm-compressor's observer), and llm-compressor's fused rule: the shards of a fused layer
    (``fused``) take the smallest of their global scales. Returns ``module.suffix`` -> tensor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from ckpt_tools.testing.quantizers import _observed

    qc = QuantizationConfig.model_validate(quantization_config)
    scheme = next(iter(qc.config_groups.values()))
    comp = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    args = scheme.weights
    gscale = {m: generate_gparam(w.amin(), w.amax()) for m, w in weights.items()} \
        if args.strategy == "tensor_group" else {}
    own = dict(gscale)
    for m in gscale:
        parent, _, leaf = m.rpartition(".")
        for shards in fused.values():
            group = [f"{parent}.{s}" for s in shards]
            if leaf in shards and all(g in own for g in group):
                gscale[m] = torch.min(torch.cat([own[g] for g in group])).reshape(1)
    out: dict[str, torch.Tensor] = {}
    for m, w in weights.items():
        scale, _ = calculate_qparams(*_observed(w, args), args, global_scale=gscale.get(m))
        sd = {"weight": w, "weight_scale": scale, **({"weight_global_scale": gscale[m]} if m in gscale else {})}
        out.update({f"{m}.{k}": v for k, v in comp.compress(sd, scheme).items()})
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


# -- the DeepSeek-V4 release layout, from a bf16 fixture (no library writes it; the format is simple) --

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _e8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Biased power-of-two exponents with 2**(e-127) * top >= amax (UE8M0 scales)."""
    e = torch.ceil(torch.log2(torch.clamp(amax.float(), min=1e-30) / top)).to(torch.int32) + 127
    return torch.clamp(e, 1, 254).to(torch.uint8)


def fp4_e8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (I8 [out, in/2] two e2m1 codes per byte, low nibble first; F8_E8M0 [out, in/32])."""
    out, cols = w.shape
    g = w.float().reshape(out, cols // 32, 32)
    e = _e8m0(g.abs().amax(-1), 6.0)
    x = g / torch.exp2(e.to(torch.float32) - 127).unsqueeze(-1)  # powers of two: exact
    codes = (x.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8).reshape(out, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed.contiguous(), e.view(torch.float8_e8m0fnu)


def fp8_dequant(q: torch.Tensor, scale: torch.Tensor, block=(128, 128), dtype=torch.float32) -> torch.Tensor:
    """Block FP8 by its definition (DeepSeek's ``weight_dequant``): ``float32(q) * scale`` of each element's
    block, one cast to ``dtype``. Plain torch, independent of ckpt_tools' numpy dequantizer (``decode_fp8``),
    which the tests hold to it."""
    br, bc = block
    rows, cols = q.shape[-2:]
    full = scale.float().repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]
    return (q.float() * full).to(dtype)


def fp8_e8m0(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 with UE8M0 scales: (F8_E4M3 [out, in], F8_E8M0 [ceil(out/128), ceil(in/128)])."""
    r, c = w.shape
    p = torch.nn.functional.pad(w.float(), (0, -c % block, 0, -r % block))
    blocks = p.reshape(p.shape[0] // block, block, p.shape[1] // block, block)
    e = _e8m0(blocks.abs().amax(dim=(1, 3)), 448.0)
    s = torch.exp2(e.to(torch.float32) - 127)
    q = (blocks / s[:, None, :, None]).reshape(p.shape)[:r, :c].to(torch.float8_e4m3fn)
    return q.contiguous(), e.view(torch.float8_e8m0fnu)


def deepseek_v4_release(src: Path, dst: Path) -> Path:
    """The bf16 DeepSeek-V4 fixture stored as the release is: FP8 + UE8M0 `.scale` where the table marks
    `quant: true`, routed experts FP4 (I8) + UE8M0 per-32 `.scale`."""
    import re

    from safetensors.torch import load_file, save_file

    from ckpt_tools.io.config import ConfigView
    from ckpt_tools.model.tables.loader import get_table
    from ckpt_tools.model.tables.resolve import resolve, trunk_specs

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    res = resolve(get_table("deepseek_v4"), ConfigView(cfg))
    fp8 = {s.key for s in [*res.mtp_specs(), *trunk_specs(res)[0]] if s.quant}
    expert = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight$")
    state = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(f))
    out = {}
    for k, v in state.items():
        head = k.removesuffix(".weight")
        if expert.match(k):
            out[k], out[f"{head}.scale"] = fp4_e8m0(v)
        elif k in fp8:
            out[k], out[f"{head}.scale"] = fp8_e8m0(v)
        else:
            out[k] = v
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight: last two dims divided by the block, rounded up."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128),
             pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a float tensor (2-D or stacked) held whole to (float8_e4m3fn weight, float32 scale_inv): the
    block codec's scale and code steps (``encode_block.block_scales`` / ``quantize_with``) over the whole tensor at
    once, which the codec's banded recipes must reproduce. Values are taken as float32 first; ``pow2``: scales
    rounded up to powers of two (``scale_fmt: ue8m0``)."""
    from ckpt_tools.errors import InputError
    from ckpt_tools.model.quant.encode_block import block_scales, quantize_with

    if not w.dtype.is_floating_point or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InputError(f"quantize needs a float tensor, got {w.dtype}", rule="fp8-dtype")
    x = w.to(torch.float32, copy=True).contiguous()
    scale = block_scales(x, tuple(block), pow2=pow2)
    return quantize_with(x, scale, tuple(block)), scale.contiguous()


# the block FP8 band kernel over a whole array and a sequential reader: what the tests hold the kernel to


def scale_to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Scale grid values as float32 (exact for every scale dtype) from their storage array."""
    if dtype in ("F32", "BF16", "F16"):
        return decode_floats(np.ascontiguousarray(raw), dtype).astype(np.float32, copy=False).reshape(raw.shape)
    if dtype == "F8_E8M0":  # 2 ** (b - 127); 0xff is NaN
        b = raw.view(np.uint8)
        return np.where(b == 0xFF, np.float32(np.nan), np.ldexp(np.float32(1.0), b.astype(np.int32) - 127))
    from ckpt_tools.errors import PlanError

    raise PlanError(f"scale dtype {dtype} is not one of F32, BF16, F16, F8_E8M0", rule="fp8-scale-dtype")


def dequant_array(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int], fmt: str, out_dtype: str,
                  scale_dtype: str = "F32") -> np.ndarray:
    """A whole [..., rows, cols] FP8 weight (uint8 storage) -> values in ``out_dtype`` storage."""
    from ckpt_tools.model.quant.decode_fp8 import BandDequantizer, bands
    from ckpt_tools.parallel import run_all

    codes = np.ascontiguousarray(codes).view(np.uint8)
    kern = BandDequantizer(fmt, scale_to_f32(np.ascontiguousarray(scale), scale_dtype), codes.shape, block,
                           out_dtype)
    rows, cols = codes.shape[-2:]
    flat = codes.reshape(-1, rows, cols)
    out = np.empty(flat.shape, dtype=numpy_storage_dtype(out_dtype))

    def one(band: tuple[int, int, int]) -> None:
        li, r0, r1 = band
        kern.dequant(flat[li, r0:r1], li, r0, out=out[li, r0:r1])

    run_all(one, bands(flat.shape[0], rows, block[0], kern.step))  # bands on every core, each into its rows
    return out.reshape(codes.shape)


def dequant_stream(read: Callable[[int], Any], shape: tuple[int, ...], fmt: str, scale: np.ndarray,
                   out_dtype: str = "BF16", block: tuple[int, int] = (128, 128)) -> Iterator[np.ndarray]:
    """Dequantize a weight whose bytes come from a sequential reader (``read(n)`` -> the next
    ``n`` bytes, C order), band by band, one worker thread ahead of the consumer.

    ``scale`` is the whole (small) float32 scale grid. Yields fresh storage arrays."""
    from ckpt_tools.errors import InputError
    from ckpt_tools.io.prefetch import prefetched
    from ckpt_tools.model.quant.decode_fp8 import BandDequantizer, bands, whole_stream
    from ckpt_tools.parallel import decode_threads, in_pool, ordered_map

    shape = tuple(shape)
    kern = BandDequantizer(fmt, scale, shape, block, out_dtype)
    rows, cols = shape[-2:]
    lead = math.prod(shape[:-2])
    threads = decode_threads()  # read here: the reading thread below does not see the caller's context

    def raw_bands() -> Iterator[tuple[np.ndarray, int, int]]:
        for li, r0, r1 in bands(lead, rows, block[0], kern.step):
            n = (r1 - r0) * cols
            data = read(n) if n else b""
            if len(data) != n:
                raise InputError(f"short read: {len(data)} of {n} bytes", rule="fp8-stream")
            yield np.frombuffer(data, dtype=np.uint8).reshape(r1 - r0, cols), li, r0

    def one(band: tuple[np.ndarray, int, int]) -> np.ndarray:
        codes, li, r0 = band
        return kern.dequant(codes, li, r0, out=np.empty(codes.shape, dtype=numpy_storage_dtype(out_dtype)))

    if in_pool():  # a tensor decoded whole on a pool thread (stream.lookahead): inline, one read, one array
        return whole_stream(read, (lead, rows, cols), cols, out_dtype, bands(lead, rows, block[0], kern.step),
                            kern.dequant, lambda msg: InputError(msg, rule="fp8-stream"))
    # bands read in order on one thread, decoded on ``threads`` (in order), one step ahead of the consumer
    return prefetched(lambda: ordered_map(one, raw_bands(), threads))
