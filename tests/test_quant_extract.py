"""`ckpt extract --dequant bf16|fp32` from every quantization scheme: the MTP modules come out equal to the
reference decompression, bit for bit; unquantized tensors byte for byte; without --dequant a native draft
keeps the stored tensors as they are."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_ckpt

pytest.importorskip("compressed_tensors")
from quant_helpers import ct, deepseek_v4_release, same_bits, scheme_for, write_quantized  # noqa: E402
from quant_helpers import tensors_of as _out  # noqa: E402

IGNORE = ["lm_head", "re:.*mlp\\.gate$"]
MTP = "model.layers.3."  # the deepseek_v3 fixture's MTP layer


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


# -- the draft's config describes the draft (issue 24, item 2) --------------------------------------------


def _unquantized_per_consumers(path):
    """transformers' AutoConfig and compressed-tensors' own config lookup (vLLM's cascade: quantization_config,
    text_config.quantization_config, compression_config) both see no quantization."""
    from compressed_tensors.utils.safetensors_load import find_config_path, get_quantization_config
    from transformers import AutoConfig

    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg and "quantization_config" not in cfg.get("text_config", {})
    assert getattr(AutoConfig.from_pretrained(path), "quantization_config", None) is None
    assert get_quantization_config(find_config_path(str(path))) is None
    assert not (path / "hf_quant_config.json").exists()


def _quantized_per_consumers(path) -> None:
    from compressed_tensors.utils.safetensors_load import find_config_path, get_quantization_config
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).quantization_config["quant_method"] == "compressed-tensors"
    assert get_quantization_config(find_config_path(str(path)))["quantization_status"] == "compressed"


@pytest.mark.parametrize("dequant", [["--dequant", "bf16"], []], ids=["dequant", "as-stored"])
def test_draft_of_a_bf16_mtp_behind_exclusions_has_no_quantization_config(make_fixture, tmp_path, dequant):
    """llm-compressor's usual output: trunk quantized, MTP excluded and stored BF16. Nothing in the draft is
    quantized, with or without --dequant, so its config must not declare compressed-tensors."""
    src = write_quantized(make_fixture("deepseek_v3"), tmp_path / "q", scheme_for("FP8_BLOCK",
                          {"block_structure": [32, 32]}), [*IGNORE, "re:model\\.layers\\.3\\..*"])
    _quantized_per_consumers(src)
    run_ckpt("extract", src, "-o", tmp_path / "out", *dequant)
    _unquantized_per_consumers(tmp_path / "out")
    state, out = load_file(src / "model.safetensors"), _out(tmp_path / "out")
    assert out and all(same_bits(v, state[k]) for k, v in out.items())  # nothing to decode: the bytes
    run_ckpt("validate", tmp_path / "out")


def test_dequant_keeps_float_tensors_the_source_stores_in_float_and_says_which(make_fixture, tmp_path):
    """--dequant decodes what is quantized; the F32 router bias stays F32 (transformers keeps it F32 strictly,
    vLLM builds it F32), is reported, and --dtype bf16 keeps it too (the table pins it: issue 40)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel

    assert "e_score_correction_bias" in DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict
    src = write_quantized(make_fixture("deepseek_v3"), tmp_path / "q", scheme_for("NVFP4"), list(IGNORE))
    bias = f"{MTP}mlp.gate.e_score_correction_bias"
    assert load_file(src / "model.safetensors")[bias].dtype == torch.float32
    report = json.loads(run_ckpt("extract", src, "-o", tmp_path / "bf16", "--dequant", "bf16", "--json").output)
    assert report["kept_dtype"] == {bias: "F32"}
    _unquantized_per_consumers(tmp_path / "bf16")
    out = _out(tmp_path / "bf16")
    assert out[bias].dtype == torch.float32
    assert {str(v.dtype) for k, v in out.items() if k != bias} == {"torch.bfloat16"}
    manifest = json.loads((tmp_path / "bf16" / "ckpt_manifest.json").read_text())
    assert manifest["kept_dtype"] == {bias: "F32"}
    text = run_ckpt("extract", src, "-o", tmp_path / "bf16b", "--dequant", "bf16").output
    assert "kept as stored" in text and bias in text

    report = json.loads(run_ckpt("extract", src, "-o", tmp_path / "all", "--dequant", "bf16", "--dtype", "bf16",
                                 "--json").output)
    assert report["kept_dtype"] == {bias: "F32"}
    out = _out(tmp_path / "all")
    assert out[bias].dtype == torch.float32
    assert {str(v.dtype) for k, v in out.items() if k != bias} == {"torch.bfloat16"}


def test_dequant_help_names_every_scheme_table():
    """The --dequant help names a scheme for every table under mappings/quantization/ (each has a decoder)."""
    from ckpt_tools.api.options import DEQUANT_HELP
    from ckpt_tools.model.quant import all_schemes

    words = {"ct-fp8": "compressed-tensors FP8", "ct-int8": "INT8", "ct-pack": "INT4", "ct-nvfp4": "NVFP4",
             "ct-mxfp4": "MXFP4", "modelopt-fp8": "ModelOpt FP8", "modelopt-nvfp4": "NVFP4", "fp8-block":
             "weight_scale_inv", "deepseek-v4": "DeepSeek-V4", "quark-mxfp4": "Quark MXFP4"}
    schemes = all_schemes()
    assert set(schemes) == set(words)
    assert all(f.decoder is not None for s in schemes.values() for f in s.storage)
    assert all(w in DEQUANT_HELP for w in words.values())
    assert "FP8 block weights" not in DEQUANT_HELP
