"""Quantized fixtures hold what real tools write, and the real consumers read them back.

Every compressed-tensors fixture is decompressed by compressed-tensors itself (transformers'
load path: ``apply_quantization_config`` + ``ModelCompressor`` on the module tree, and the
model-free ``CompressedTensorsDequantizer`` where it applies) to the BF16 source within the
format's error; ModelOpt NVFP4 goes through compressed-tensors' own ``ModelOptNvfp4Converter``;
FP4 codes are decoded with compressed-tensors' unpack functions. Keys, dtypes and shapes of
the MTP layer equal the hand-written lists in fixtures/golden/quant/. The failure modes are
checked with the consumers' own matchers (``match_name``, ``fnmatch``).
"""

from __future__ import annotations

import fnmatch
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools.testing import FixtureOptions, make_checkpoint
from ckpt_tools.testing.quantized import SCHEMES, QuantOptions, make_quantized_checkpoint

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors comes with the test extra")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (  # noqa: E402
    CompressedTensorsDequantizer,
)
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "quant"
# every input width a multiple of 128, for the group-128 schemes
WIDE = {"hidden_size": 128, "q_lora_rank": 128, "kv_lora_rank": 128, "v_head_dim": 32, "intermediate_size": 128,
        "moe_intermediate_size": 128}
# relative L2 error of a dequantized tensor, by element format (3 mantissa bits, 8 / 4 bit ints, e2m1)
BOUND = {"fp8": 0.05, "int8": 0.02, "int4": 0.15, "fp4": 0.2}
CT_CASES = {  # scheme -> (format written, element format, config overrides)
    "ct-fp8-tensor": ("float-quantized", "fp8", {}),
    "ct-fp8-channel": ("float-quantized", "fp8", {}),
    "ct-fp8-block": ("float-quantized", "fp8", {}),
    "ct-w4a16": ("pack-quantized", "int4", WIDE),
    "ct-w4a16-g32": ("pack-quantized", "int4", {}),
    "ct-w4a16-asym": ("pack-quantized", "int4", WIDE),
    "ct-w4a16-asym-g32": ("pack-quantized", "int4", {}),
    "ct-w8a16": ("pack-quantized", "int8", WIDE),
    "ct-w8a8": ("int-quantized", "int8", {}),
    "ct-nvfp4": ("nvfp4-pack-quantized", "fp4", {}),
    "ct-nvfp4a16": ("nvfp4-pack-quantized", "fp4", {}),
    "ct-mxfp4": ("mxfp4-pack-quantized", "fp4", {}),
}
MTP3 = "model.layers.3."  # the DeepSeek-V3 fixture's MTP layer


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(family, scheme, config=None, **QuantOptions)`` -> (quantized fixture, its BF16 source); cached."""
    cache: dict = {}

    def make(family: str, scheme: str, config: dict | None = None, **kw):
        key = (family, scheme, json.dumps(config or {}, sort_keys=True), tuple(sorted(kw.items())))
        if key not in cache:
            opts = FixtureOptions(config_overrides=config or {})
            out = make_quantized_checkpoint(family, tmp_path_factory.mktemp("q"), QuantOptions(scheme, **kw), opts)
            src = make_checkpoint(family, tmp_path_factory.mktemp("src"), FixtureOptions(
                config_overrides=config or {}, expert_layout="per-expert"))
            cache[key] = (out, src)
        return cache[key]

    return make


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """key -> (dtype, shape) as the safetensors headers say."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        for k, v in json.loads(raw[8:8 + n]).items():
            if k != "__metadata__":
                out[k] = (v["dtype"], v["shape"])
    return out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _linear_names(src: dict[str, torch.Tensor]) -> list[str]:
    """The source's Linear modules: 2-D ``.weight`` tensors that are not embeddings."""
    return [k[:-7] for k, v in src.items() if k.endswith(".weight") and v.dim() == 2 and "embed" not in k]


def _ct_load(tensors: dict[str, torch.Tensor], qc: QuantizationConfig, src: dict[str, torch.Tensor]):
    """transformers' compressed-tensors load path: build the Linears, apply the config, compress (for the
    compressed parameter shapes; the meta-device shortcut leaves asymmetric zero points unpacked), assign
    the checkpoint's tensors, decompress. -> module -> weight."""
    from ckpt_tools.testing.quantizers import _module_tree

    names = _linear_names(src)
    model = _module_tree({n: torch.zeros_like(src[n + ".weight"]) for n in names})
    apply_quantization_config(model, qc)
    for pname, p in model.named_parameters():  # placeholders: the checkpoint's values replace them
        if pname.endswith("_zero_point"):
            p.data.zero_()
        elif pname.endswith("scale"):
            p.data.fill_(1)
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(model)
    state = model.state_dict()
    assert not [k for k in state if k not in tensors], "parameters the config declares are missing from the files"
    # engines load a 0-d per-tensor scale (ModelOpt writes them so) into a [1] parameter
    model.load_state_dict({k: tensors[k].reshape(state[k].shape) if tensors[k].dim() == 0 else tensors[k]
                           for k in state}, assign=True)
    compressor.decompress_model(model)
    return {n: model.get_submodule(n).weight.detach() for n in names}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ---------------------------------------------------------------------------
# compressed-tensors


@pytest.mark.parametrize("scheme", sorted(CT_CASES))
def test_ct_fixture_decompresses_with_the_library(build, scheme):
    fmt, elem, config = CT_CASES[scheme]
    out, src_dir = build("deepseek_v3", scheme, config)
    tensors, src = _tensors(out), _tensors(src_dir)
    raw = _config(out)["quantization_config"]
    qc = QuantizationConfig.model_validate(raw)
    assert (raw["quant_method"], qc.format, qc.quantization_status) == ("compressed-tensors", fmt, "compressed")
    quantized = sorted({k.rpartition(".")[0] for k in tensors if k.endswith(("weight_scale", "weight_packed"))})
    assert quantized and f"{MTP3}eh_proj" in quantized and f"{MTP3}mlp.experts.3.down_proj" in quantized
    assert {n + ".weight" for n in quantized}.isdisjoint(tensors) or fmt in ("float-quantized", "int-quantized")
    # the library writes the unquantized Linears into ignore by name
    assert {"lm_head", f"{MTP3}mlp.gate", f"{MTP3}shared_head.head"} <= set(qc.ignore)
    assert not [n for n in quantized if any(match_name(n, ign) for ign in qc.ignore)]

    weights = _ct_load(tensors, qc, src)
    for name, w in weights.items():
        if name in quantized:
            assert _rel(w, src[name + ".weight"]) < BOUND[elem], name
        else:  # untouched modules keep their bytes
            assert torch.equal(tensors[name + ".weight"], src[name + ".weight"]), name
    for k, v in tensors.items():
        if k in src and k.rpartition(".")[0] not in quantized:
            assert torch.equal(v, src[k]), k
    if fmt.endswith("pack-quantized"):  # the model-free dequantizer agrees bit for bit
        flat = CompressedTensorsDequantizer(out).process(dict(tensors))
        for name in quantized:
            assert torch.equal(flat[name + ".weight"], weights[name].to(torch.bfloat16)), name


def test_ct_model_free_dequantizer_takes_every_unignored_weight_as_quantized(build):
    """A consumer fact the quant tables rely on: for formats whose compressed tensor is ``weight``,
    compressed-tensors' name-only matcher cannot tell a BF16 embedding from an FP8 Linear."""
    out, _ = build("deepseek_v3", "ct-fp8-channel")
    with pytest.raises(KeyError, match="embed_tokens.weight_scale"):
        CompressedTensorsDequantizer(out).process(_tensors(out))


@pytest.mark.parametrize("golden", sorted(p.name for p in GOLDEN.glob("*.txt")))
def test_mtp_keys_dtypes_shapes_equal_the_golden_list(build, golden):
    lines = (GOLDEN / golden).read_text().splitlines()
    meta = json.loads(next(line for line in lines if line.startswith("# fixture:")).split(":", 1)[1])
    want = {}
    for line in lines:
        if line and not line.startswith("#"):
            key, dtype, shape = line.split("\t")
            want[key] = (dtype, json.loads(shape))
    out, _ = build(meta["family"], **meta["quant"])
    got = {k: v for k, v in _header(out).items() if k.startswith(tuple(meta["prefixes"]))}
    assert got == want


# ---------------------------------------------------------------------------
# ModelOpt


def test_modelopt_nvfp4_is_what_compressed_tensors_converts(build):
    out, src_dir = build("deepseek_v3", "modelopt-nvfp4")
    tensors, src = _tensors(out), _tensors(src_dir)
    hf = json.loads((out / "hf_quant_config.json").read_text())
    qcfg = _config(out)["quantization_config"]
    assert hf["quantization"]["quant_algo"] == "NVFP4" and hf["quantization"]["group_size"] == 16
    assert (qcfg["quant_method"], qcfg["quant_algo"], qcfg["ignore"]) == (
        "modelopt", "NVFP4", hf["quantization"]["exclude_modules"])
    w = f"{MTP3}self_attn.o_proj"
    assert [(k, str(tensors[k].dtype), list(tensors[k].shape)) for k in sorted(tensors) if k.startswith(w + ".")] == [
        (w + ".input_scale", "torch.float32", []), (w + ".weight", "torch.uint8", [64, 16]),
        (w + ".weight_scale", "torch.float8_e4m3fn", [64, 2]), (w + ".weight_scale_2", "torch.float32", [])]

    conv = ModelOptNvfp4Converter(ignore=hf["quantization"]["exclude_modules"], targets=["Linear"])
    converted = conv.validate(dict(tensors))
    qc = conv.update_config(None)
    weights = _ct_load(converted, qc, src)
    quantized = {k[: -len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2")}
    assert f"{MTP3}eh_proj" in quantized
    for name in quantized:
        assert _rel(weights[name], src[name + ".weight"]) < BOUND["fp4"], name


def test_modelopt_fp8_per_tensor(build):
    out, src_dir = build("qwen3_5_moe", "modelopt-fp8")
    tensors, src = _tensors(out), _tensors(src_dir)
    quantized = sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))
    assert "mtp.fc" in quantized and "mtp.layers.0.self_attn.q_proj" in quantized
    for name in quantized:
        q, s = tensors[name + ".weight"], tensors[name + ".weight_scale"]
        assert (q.dtype, s.dtype, s.dim(), tensors[name + ".input_scale"].dim()) == (torch.float8_e4m3fn,
                                                                                     torch.float32, 0, 0)
        assert _rel(q.float() * s, src[name + ".weight"]) < BOUND["fp8"], name
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"


def test_modelopt_mixed_precision_lists_every_quantized_module(build):
    out, _ = build("qwen3_5_moe", "modelopt-mixed", mtp="bf16", mtp_exclude="pattern")
    tensors = _tensors(out)
    layers = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    nvfp4 = {k[: -len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2")}
    fp8 = {k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")} - nvfp4
    stored = {**dict.fromkeys(fp8, "FP8"), **dict.fromkeys(nvfp4, "NVFP4")}
    assert nvfp4 and fp8 and all(".experts." in n for n in nvfp4)
    assert {n: v["quant_algo"] for n, v in layers.items()} == stored
    assert not [n for n in layers if n.startswith("mtp.")]  # BF16 MTP: nothing declared for it
    qcfg = _config(out)["quantization_config"]
    assert qcfg["quantized_layers"] == layers and qcfg["quant_algo"] == "MIXED_PRECISION"
    targets = sorted(t for g in qcfg["config_groups"].values() for t in g["targets"])
    assert targets == sorted(layers)


# ---------------------------------------------------------------------------
# DeepSeek block FP8 with UE8M0 scales, and the V4 release layout


def _block_dequant(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """DeepSeek's weight_dequant: each tile times its scale, edge tiles cropped."""
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def test_fp8_block_ue8m0_scales_are_powers_of_two(build):
    out, src_dir = build("deepseek_v3", "fp8-block-ue8m0")
    tensors, src = _tensors(out), _tensors(src_dir)
    assert _config(out)["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128]}
    scales = [k for k in tensors if k.endswith(".weight_scale_inv")]
    assert f"{MTP3}self_attn.q_a_proj.weight_scale_inv" in scales and f"{MTP3}eh_proj.weight" in tensors
    assert tensors[f"{MTP3}eh_proj.weight"].dtype == torch.bfloat16  # BF16 in DeepSeek's releases (table flag)
    for k in scales:
        s, w = tensors[k], k[: -len("_scale_inv")]
        assert s.dtype == torch.float32 and torch.equal(torch.exp2(torch.log2(s).round()), s), k
        assert _rel(_block_dequant(tensors[w], s), src[w]) < BOUND["fp8"], w


def test_fp8_fp4_release_layout(build):
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    out, src_dir = build("deepseek_v4", "fp8-ue8m0-fp4-experts")
    tensors, src = _tensors(out), _tensors(src_dir)
    assert _config(out)["expert_dtype"] == "fp4" and _config(out)["quantization_config"]["scale_fmt"] == "ue8m0"
    e = "mtp.0.ffn.experts.1.w2"
    assert (tensors[e + ".weight"].dtype, list(tensors[e + ".weight"].shape)) == (torch.int8, [64, 16])
    assert (tensors[e + ".scale"].dtype, list(tensors[e + ".scale"].shape)) == (torch.float8_e8m0fnu, [64, 1])
    for k in ("mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.wo_a", "layers.1.attn.indexer.wq_b"):
        assert (tensors[k + ".weight"].dtype, tensors[k + ".scale"].dtype) == (torch.float8_e4m3fn,
                                                                               torch.float8_e8m0fnu), k
    for k in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight",
              "mtp.0.ffn.gate.weight", "head.weight"):
        assert tensors[k].dtype == torch.bfloat16, k
    for k, s in tensors.items():
        if not k.endswith(".scale"):
            continue
        w = k[: -len(".scale")] + ".weight"
        q = tensors[w]
        if q.dtype == torch.int8:  # FP4: compressed-tensors' unpack, per-32 exponents
            m, n = q.shape
            vals = unpack_fp4_from_uint8(q.view(torch.uint8), m, n * 2, dtype=torch.float32)
            deq = vals * decompress_mx_scale(s.view(torch.uint8)).float().repeat_interleave(32, 1)
            assert _rel(deq, src[w]) < BOUND["fp4"], w
        else:
            assert _rel(_block_dequant(q, s), src[w]) < BOUND["fp8"], w


# ---------------------------------------------------------------------------
# the failure modes, judged by the consumers' matchers


def _ignored(name: str, ignore: list[str]) -> bool:
    return any(match_name(name, ign) for ign in ignore)


def test_bf16_mtp_exclusions_as_compressed_tensors_matches_them(build):
    mtp_linears = [f"{MTP3}eh_proj", f"{MTP3}self_attn.q_a_proj", f"{MTP3}self_attn.kv_a_proj_with_mqa",
                   f"{MTP3}mlp.experts.0.up_proj"]
    seen = {}
    for style in ("exact", "pattern", "no-fusion", "fused", "partial", "none"):
        out, src_dir = build("deepseek_v3", "ct-fp8-channel", mtp="bf16", mtp_exclude=style)
        tensors, src = _tensors(out), _tensors(src_dir)
        assert all(torch.equal(tensors[k], src[k]) for k in src if k.startswith(MTP3)), style  # stored BF16
        ignore = QuantizationConfig.model_validate(_config(out)["quantization_config"]).ignore
        seen[style] = [_ignored(n, ignore) for n in mtp_linears]
    assert seen["exact"] == seen["pattern"] == [True] * 4
    assert seen["no-fusion"] == [False, True, True, True]  # (b) eh_proj left to be quantized
    assert seen["fused"] == [True, False, False, False]  # (c) fused_qkv_a_proj / experts: not the checkpoint's names
    assert seen["partial"] == [True, True, False, False]  # (c) one shard of a fused group only
    assert seen["none"] == [False] * 4
    out, _ = build("deepseek_v3", "ct-fp8-channel", mtp="bf16", mtp_exclude="fused")
    ignore = _config(out)["quantization_config"]["ignore"]
    assert {f"{MTP3}self_attn.fused_qkv_a_proj", f"{MTP3}mlp.experts", f"{MTP3}mlp.shared_experts.gate_up_proj"} <= set(
        ignore)


def test_modelopt_prefix_exclusion_misses_the_fusion(build):
    """nvidia Qwen3.5 NVFP4: ``mtp.layers.0*`` excludes the MTP block but not ``mtp.fc`` (vLLM #38832)."""
    out, _ = build("qwen3_5_moe", "modelopt-nvfp4", mtp="bf16", mtp_exclude="blocks")
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    tensors = _tensors(out)
    assert "mtp.layers.0*" in exclude and tensors["mtp.fc.weight"].dtype == torch.bfloat16
    assert not any(fnmatch.fnmatch("mtp.fc", p) for p in exclude)
    assert all(fnmatch.fnmatch("mtp.layers.0.self_attn.q_proj", p) for p in ["mtp.layers.0*"])
    out, _ = build("qwen3_5_moe", "modelopt-nvfp4", mtp="bf16", mtp_exclude="pattern")
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert any(fnmatch.fnmatch("mtp.fc", p) for p in exclude)


def test_quantized_mtp_that_the_config_excludes(build):
    out, _ = build("qwen3_5_moe", "ct-nvfp4", mtp_exclude="exact")  # (d)
    tensors, ignore = _tensors(out), _config(out)["quantization_config"]["ignore"]
    assert "mtp.fc.weight_packed" in tensors and _ignored("mtp.fc", ignore)


@pytest.mark.parametrize("count", ["kept", "zero"])
def test_dropped_mtp(build, count):
    out, _ = build("qwen3_5_moe", "ct-nvfp4", mtp="dropped", mtp_count=count)  # (a), and (f) when kept
    assert not [k for k in _header(out) if k.startswith("mtp.")]
    assert _config(out)["text_config"]["mtp_num_hidden_layers"] == (1 if count == "kept" else 0)
    assert not [i for i in _config(out)["quantization_config"]["ignore"] if i.startswith("mtp.")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_header(out))


def test_missing_scale(build):
    out, _ = build("deepseek_v3", "ct-nvfp4", drop_keys=(f"{MTP3}self_attn.o_proj.weight_scale",))  # (e)
    keys = set(_header(out))
    assert f"{MTP3}self_attn.o_proj.weight_packed" in keys and f"{MTP3}self_attn.o_proj.weight_scale" not in keys


def test_every_scheme_is_tested():
    covered = set(CT_CASES) | {"modelopt-nvfp4", "modelopt-fp8", "modelopt-mixed", "fp8-block-ue8m0",
                               "fp8-ue8m0-fp4-experts"}
    assert covered == set(SCHEMES)


def test_cli_and_the_missing_extra(tmp_path, monkeypatch, capsys):
    from ckpt_tools.testing.__main__ import main
    from ckpt_tools.testing.quantizers import EXTRA_HINT, require_compressed_tensors

    assert main(["deepseek_v3", str(tmp_path / "o"), "--quant", "ct-w8a8", "--mtp", "bf16", "--shards", "2"]) == 0
    assert "quantization_config" in _config(tmp_path / "o")
    monkeypatch.setitem(__import__("sys").modules, "compressed_tensors", None)
    with pytest.raises(ImportError, match=r"ckpt-tools\[quant\]"):
        require_compressed_tensors()
    assert main(["deepseek_v3", str(tmp_path / "p"), "--quant", "ct-w8a8"]) == 3
    assert EXTRA_HINT in capsys.readouterr().err


@pytest.mark.parametrize("scheme", sorted(CT_CASES))
def test_extract_dequant_equals_the_librarys_load_path_for_every_ct_scheme(build, scheme, tmp_path):
    """`ckpt extract --dequant bf16` of each compressed-tensors fixture: every MTP module bit for bit equal to
    what transformers' compressed-tensors load path decompresses (``_ct_load``), cast to bf16."""
    from conftest import run_ckpt

    _, _, config = CT_CASES[scheme]
    out, src_dir = build("deepseek_v3", scheme, config)
    tensors, src = _tensors(out), _tensors(src_dir)
    qc = QuantizationConfig.model_validate(_config(out)["quantization_config"])
    weights = _ct_load(tensors, qc, src)
    run_ckpt("extract", out, "-o", tmp_path / "bf16", "--dequant", "bf16")
    ours = _tensors(tmp_path / "bf16")
    quantized = {k.rpartition(".")[0] for k in tensors if k.startswith(MTP3) and k.endswith("weight_scale")}
    assert quantized
    for name in quantized:
        assert ours[name + ".weight"].dtype == torch.bfloat16
        assert torch.equal(ours[name + ".weight"], weights[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("scheme", sorted(s for s in SCHEMES if s not in CT_CASES))
def test_extract_dequant_from_every_other_scheme_is_within_its_format_error(build, scheme, tmp_path):
    """ModelOpt FP8 / NVFP4 / MIXED_PRECISION, DeepSeek block FP8 (UE8M0) and the DeepSeek-V4 release layout:
    `extract --dequant bf16` gives every MTP weight in bf16, close to the bf16 source it was quantized from
    (bit-exact decoding against each reference is tested in test_quant_decode.py)."""
    from conftest import run_ckpt

    family, prefix = ("deepseek_v4", "mtp.") if scheme == "fp8-ue8m0-fp4-experts" else ("deepseek_v3", MTP3)
    out, src_dir = build(family, scheme)
    src = _tensors(src_dir)
    run_ckpt("extract", out, "-o", tmp_path / "bf16", "--dequant", "bf16", "--allow-invalid", "mtp-quant-config")
    ours = _tensors(tmp_path / "bf16")
    mtp = [k for k in src if k.startswith(prefix) and k.endswith(".weight") and k in ours]
    assert len(mtp) > 20
    for k in mtp:
        assert ours[k].dtype == src[k].dtype, k
        assert _rel(ours[k], src[k]) < BOUND["fp4"], k  # the coarsest element format among these schemes
