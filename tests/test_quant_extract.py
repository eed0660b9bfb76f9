"""`ckpt extract --dequant bf16|fp32` from every quantization scheme: the MTP modules come out equal to the
reference decompression, bit for bit; unquantized tensors byte for byte; without --dequant a native draft
keeps the stored tensors as they are."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import run_ckpt

pytest.importorskip("compressed_tensors")
from quant_helpers import ct, deepseek_v4_release, scheme_for, write_quantized  # noqa: E402

IGNORE = ["lm_head", "re:.*mlp\\.gate$"]
MTP = "model.layers.3."  # the deepseek_v3 fixture's MTP layer


def _out(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - safe_open has no iteration
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    v = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(v), b.contiguous().view(v))


@pytest.mark.parametrize(("preset", "weights"), [("NVFP4", {}), ("W4A16_ASYM", {"group_size": 32}),
                                                 ("FP8_BLOCK", {"block_structure": [32, 32]}), ("MXFP4", {})])
def test_extract_dequant_equals_compressed_tensors_decompression(make_fixture, tmp_path, preset, weights):
    lib = ct()
    sch = scheme_for(preset, weights or None)
    src = write_quantized(make_fixture("deepseek_v3"), tmp_path / "q", sch, list(IGNORE))
    state = load_file(src / "model.safetensors")
    comp = lib["BaseCompressor"].get_value_from_registry(sch.format)
    run_ckpt("extract", src, "-o", tmp_path / "bf16", "--dequant", "bf16")
    out = _out(tmp_path / "bf16")
    modules = sorted({k.rpartition(".")[0] for k in state if k.startswith(MTP) and k.endswith(".weight_scale")})
    assert len(modules) >= 10
    for m in modules:
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == m}
        theirs = comp.decompress(local, sch)["weight"].to(torch.bfloat16)
        assert same_bits(out.pop(f"{m}.weight"), theirs), m
    for k, v in out.items():  # everything else: the source's bytes
        assert same_bits(v, state[k]), k
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in cfg
    run_ckpt("validate", tmp_path / "bf16")

    run_ckpt("extract", src, "-o", tmp_path / "native")  # no --dequant: the stored tensors as they are
    native = _out(tmp_path / "native")
    assert set(native) == {k for k in state if k.startswith(MTP)}
    assert all(same_bits(v, state[k]) for k, v in native.items())


def test_extract_dequant_fp32_is_the_exact_product(make_fixture, tmp_path):
    sch = scheme_for("NVFP4")
    src = write_quantized(make_fixture("deepseek_v3"), tmp_path / "q", sch, list(IGNORE))
    run_ckpt("extract", src, "-o", tmp_path / "f32", "--dequant", "fp32")
    run_ckpt("extract", src, "-o", tmp_path / "bf16", "--dequant", "bf16")
    f32, bf16 = _out(tmp_path / "f32"), _out(tmp_path / "bf16")
    m = f"{MTP}self_attn.o_proj.weight"
    assert f32[m].dtype == torch.float32 and same_bits(f32[m].to(torch.bfloat16), bf16[m])


def test_extract_dequant_from_modelopt_nvfp4_drops_its_side_file(make_fixture, tmp_path):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from test_quant_api import _modelopt

    ct_dir = write_quantized(make_fixture("deepseek_v3"), tmp_path / "ct", scheme_for("NVFP4"), list(IGNORE))
    (tmp_path / "mo").mkdir()
    src = _modelopt(tmp_path / "mo", ct_dir, mixed=False)
    # the modelopt fixture excludes model.layers.3.mlp*, which holds NVFP4 modules (rule mtp-quant-config)
    run_ckpt("extract", src, "-o", tmp_path / "out", "--dequant", "bf16", "--allow-invalid", "mtp-quant-config")
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    out, state = _out(tmp_path / "out"), load_file(src / "model.safetensors")
    m = f"{MTP}self_attn.o_proj"
    packed, scale, ws2 = state[f"{m}.weight"], state[f"{m}.weight_scale"], state[f"{m}.weight_scale_2"]
    rows, cols = packed.shape[0], packed.shape[1] * 2
    codes = unpack_fp4_from_uint8(packed, rows, cols, dtype=torch.float32)
    want = (codes.view(rows, -1, 16) * (scale.float() * ws2).unsqueeze(-1)).view(rows, cols).to(torch.bfloat16)
    assert same_bits(out[f"{m}.weight"], want)


def test_deepseek_v4_release_validates_and_dequantizes(make_fixture, tmp_path):
    from test_quant_decode import _decode_parts  # noqa: F401 - the float64 reference lives in its test

    src = deepseek_v4_release(make_fixture("deepseek_v4"), tmp_path / "v4")
    run_ckpt("validate", src)
    state = load_file(src / "model.safetensors")
    assert state["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    run_ckpt("extract", src, "-o", tmp_path / "out", "--dequant", "bf16")
    out = _out(tmp_path / "out")
    from quant_helpers import fp8_dequant

    # FP8 with UE8M0 block scales: the block-FP8 arithmetic
    w, s = state["mtp.0.attn.wq_a.weight"], state["mtp.0.attn.wq_a.scale"]
    assert same_bits(out["mtp.0.attn.wq_a.weight"], fp8_dequant(w, s, (128, 128), dtype=torch.bfloat16))
    # FP4 experts: the format in float64 (codes low nibble first; 2**(e - 127) per 32)
    import numpy as np

    packed, scale = state["mtp.0.ffn.experts.1.w2.weight"], state["mtp.0.ffn.experts.1.w2.scale"]
    u = packed.view(torch.uint8).numpy().astype(np.int64)
    codes = np.stack([u & 15, u >> 4], axis=-1).reshape(u.shape[0], -1)
    e, mant = (codes >> 1) & 3, codes & 1
    mag = np.where(e == 0, mant * 0.5, 2.0 ** (e - 1.0) * (1 + mant / 2.0)) * np.where(codes & 8, -1.0, 1.0)
    ref = mag * np.repeat(2.0 ** (scale.view(torch.uint8).numpy().astype(np.float64) - 127), 32, axis=1)
    assert same_bits(out["mtp.0.ffn.experts.1.w2.weight"], torch.from_numpy(ref).to(torch.bfloat16))
    assert not any(k.endswith(".scale") for k in out)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
