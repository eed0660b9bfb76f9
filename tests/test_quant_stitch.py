"""`ckpt stitch` into a verifier whose MTP a quantization scheme table stores (compressed-tensors NVFP4 /
FP8, ModelOpt NVFP4): the draft's float weights go in unquantized in place of the packed tensors, the
trunk stays byte for byte, and the quantization config is repaired so that the consumers' own matchers
(compressed-tensors ``match_name``, ModelOpt's fnmatch over ``exclude_modules``) skip every MTP module
that is now stored in BF16. A quantized draft is refused with the way out named."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.tables.loader import get_table
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

from conftest import run_ckpt
from quant_helpers import ct_compress_fused, group_absmax

pytest.importorskip("compressed_tensors", reason="compressed-tensors comes with the test extra")
from compressed_tensors.utils.match import match_name  # noqa: E402

COPIES = ("embed_tokens", "shared_head")
CASES = {  # family -> (MTP prefix, its modules' prefix in the draft/verifier)
    "deepseek_v3": "model.layers.3.",
    "qwen3_5_moe": "mtp.",
}


def _mtp_linears(ckpt: Checkpoint, prefix: str) -> set[str]:
    """MTP Linear modules stored as float 2-D weights (per-layer embed / head copies are the trunk's: kept)."""
    return {k.removesuffix(".weight") for k, r in ckpt.tensors.items()
            if k.startswith(prefix) and k.endswith(".weight") and len(r.shape) == 2
            and not any(c in k for c in COPIES)}


def _finetune(draft: Path) -> None:
    """Move every float MTP weight a little, as a finetune would (cosine stays ~1)."""
    from safetensors.torch import load_file, save_file

    for f in draft.glob("*.safetensors"):
        t = load_file(f)
        g = torch.Generator().manual_seed(0)
        out = {k: (v + 0.01 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype)
               if v.is_floating_point() and v.dim() == 2 else v for k, v in t.items()}
        save_file(out, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict = {}

    def build(family: str, scheme: str) -> tuple[Path, Path, Path]:
        if (family, scheme) not in cache:
            root = tmp_path_factory.mktemp(f"{family}-{scheme}")
            verifier = make_quantized_checkpoint(family, root / "v", QuantOptions(scheme=scheme))
            bf16 = root / "bf16"
            run_ckpt("extract", verifier, "-o", bf16, "--dequant", "bf16")
            draft = root / "draft"
            run_ckpt("extract", verifier, "-o", draft, "--dequant", "bf16")
            _finetune(draft)
            cache[family, scheme] = (verifier, bf16, draft)
        return cache[family, scheme]

    return build


def _stored(v: Checkpoint, modules: set[str]) -> set[str]:
    """Modules quantized in the verifier: packed, or FP8 codes beside their scales."""
    return {m for m in modules
            if f"{m}.weight" not in v.tensors or v.tensors[f"{m}.weight"].dtype not in ("BF16", "F16", "F32")}


@pytest.mark.parametrize(("family", "scheme"), [(f, s) for f in sorted(CASES) for s in ("ct-nvfp4", "ct-fp8-channel")]
                         + [("deepseek_v3", "ct-fp8-block"), ("deepseek_v3", "ct-fp8-tensor")])
def test_stitch_encodes_the_mtp_in_the_verifiers_compressed_tensors_storage(built, tmp_path, family, scheme):
    """A finetuned draft into an NVFP4 / FP8-channel verifier: each changed MTP weight is written as the verifier
    stores it, byte for byte what compressed-tensors' own compressor writes for the draft's values; activation
    scales, the trunk and the config stay the verifier's; compressed-tensors decompresses it to those values."""
    verifier, _, draft = built(family, scheme)
    prefix, out = CASES[family], tmp_path / "out"
    run_ckpt("stitch", draft, verifier, "-o", out)
    v, d, c = Checkpoint.open(verifier), Checkpoint.open(draft), Checkpoint.open(out)
    stored = _stored(v, _mtp_linears(d, prefix))
    assert stored, "the fixture's MTP must be stored quantized"
    qc = json.loads((verifier / "config.json").read_text())["quantization_config"]
    want = ct_compress_fused({m: d.tensors[f"{m}.weight"].torch() for m in stored}, qc,
                             get_table(family).fused_modules)
    for m in stored:
        mine = sorted(k for k in c.tensors if k.startswith(m + "."))
        assert mine == sorted(k for k in v.tensors if k.startswith(m + ".")), m  # the verifier's storage
        for k in mine:
            if k.rpartition(".")[2].startswith("input_"):  # calibrated on activations: the verifier's
                assert c.tensors[k].read() == v.tensors[k].read(), k
            else:
                assert c.tensors[k].read() == want[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes(), k
        wkey = next(k for k in mine if k.endswith((".weight", ".weight_packed")))
        assert c.tensors[wkey].read() != v.tensors[wkey].read(), m  # the finetune changed it
    for k, ref in v.tensors.items():  # the trunk (and the verifier's unquantized MTP norms) unchanged
        if not k.startswith(prefix):
            assert c.tensors[k].read() == ref.read(), k
    assert (out / "config.json").read_bytes() == (verifier / "config.json").read_bytes()
    assert run_ckpt("validate", out).exit_code == 0
    rep = json.loads((out / "stitch-report.json").read_text())
    assert "quant_config" not in rep
    actions = {t["key"]: t for t in rep["tensors"]}
    assert {actions[k]["status"] for m in stored for k in c.tensors if k.startswith(m + ".weight")} == {"replaced"}
    _ct_decompresses(out, stored)


def _ct_decompresses(out: Path, modules: set[str]) -> None:
    """compressed-tensors reads the written tensors back (its compressor's decompress) to our decoded values."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from ckpt_tools.model.quant import detect_scheme, module_storage
    from ckpt_tools.model.quant.dequant import dequant_module
    from ckpt_tools.numeric.transforms import recipe_bytes

    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    sch = next(iter(qc.config_groups.values()))
    comp = BaseCompressor.get_value_from_registry(sch.format or qc.format)
    c = Checkpoint.open(out)

    qs = detect_scheme(c)
    for m in sorted(modules)[:4]:
        sd = {k[len(m) + 1:]: c.tensors[k].torch() for k in c.tensors if k.startswith(m + ".")}
        theirs = comp.decompress(sd, sch)["weight"].to(torch.bfloat16)
        st = module_storage(c, qs, m)
        t = dequant_module(c, st, f"{m}.weight", "BF16")
        ours = torch.frombuffer(bytearray(b"".join(recipe_bytes(t.recipe, t.nbytes))), dtype=torch.bfloat16)
        assert torch.equal(theirs.reshape(-1), ours), m


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-fp8-channel"])
def test_keep_bf16_writes_the_mtp_unquantized_and_excludes_it(built, tmp_path, scheme):
    """--keep-bf16: the draft's float weights go in unquantized in place of the packed tensors, and the config's
    ignore list (compressed-tensors' own match_name) skips every such module, not the trunk's."""
    family = "deepseek_v3"
    verifier, _, draft = built(family, scheme)
    prefix, out = CASES[family], tmp_path / "out"
    res = run_ckpt("stitch", draft, verifier, "-o", out, "--keep-bf16")
    assert "quantization config:" in res.output and "added" in res.output
    v, d, c = Checkpoint.open(verifier), Checkpoint.open(draft), Checkpoint.open(out)
    modules = _mtp_linears(d, prefix)
    stored = _stored(v, modules)
    for m in modules:  # every MTP weight is the draft's, byte for byte
        assert c.tensors[f"{m}.weight"].read() == d.tensors[f"{m}.weight"].read(), m
    for m in stored:  # and nothing of the packing is left (packed codes, scales, global scales, input scales)
        assert [k for k in c.tensors if k.startswith(m + ".")] == [f"{m}.weight"], m
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert not [m for m in stored if not any(match_name(m, i) for i in ignore)]  # the consumer's matcher
    trunk_quantized = {k.rsplit(".", 1)[0] for k in v.tensors if not k.startswith(prefix) and "weight_" in k}
    assert trunk_quantized and not [m for m in trunk_quantized if any(match_name(m, i) for i in ignore)]
    assert run_ckpt("validate", out).exit_code == 0


def test_keep_bf16_into_a_modelopt_nvfp4_verifier_repairs_its_side_file(built, tmp_path):
    verifier, _, draft = built("qwen3_5_moe", "modelopt-nvfp4")
    out = tmp_path / "out"
    run_ckpt("stitch", draft, verifier, "-o", out, "--keep-bf16")
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert exclude == json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    v = Checkpoint.open(verifier)
    stored = {m for m in _mtp_linears(Checkpoint.open(draft), "mtp.") if f"{m}.weight_scale_2" in v.tensors}
    assert "mtp.fc" in stored
    assert not [m for m in stored if not any(fnmatch.fnmatch(m, p) for p in exclude)]  # ModelOpt's matcher
    assert run_ckpt("validate", out).exit_code == 0


def test_stitch_encodes_the_mtp_in_the_verifiers_modelopt_nvfp4_storage(built, tmp_path):
    """ModelOpt NVFP4: a changed MTP weight is written as weight / weight_scale / weight_scale_2 by the encoder the
    table names, the side file and config unchanged, and its decoded values are the draft's within NVFP4's step."""
    from ckpt_tools.model.quant import detect_scheme, module_storage
    from ckpt_tools.model.quant.codec import CODECS
    from ckpt_tools.model.quant.dequant import dequant_module
    from ckpt_tools.model.quant.encode_core import EncodeArgs
    from ckpt_tools.numeric.transforms import recipe_bytes

    verifier, _, draft = built("qwen3_5_moe", "modelopt-nvfp4")
    out = tmp_path / "out"
    run_ckpt("stitch", draft, verifier, "-o", out)
    v, d, c = Checkpoint.open(verifier), Checkpoint.open(draft), Checkpoint.open(out)
    stored = {m for m in _mtp_linears(d, "mtp.") if f"{m}.weight_scale_2" in v.tensors}
    assert "mtp.fc" in stored
    for name in ("config.json", "hf_quant_config.json"):
        assert (out / name).read_bytes() == (verifier / name).read_bytes()
    qs = detect_scheme(c)
    weights = {f"{m}.weight": d.tensors[f"{m}.weight"].torch() for m in stored}
    for m in sorted(stored):
        w = weights[f"{m}.weight"]
        group = group_absmax(weights, m, get_table("qwen3_5_moe").fused_modules)  # gate/up share one weight_scale_2
        want = CODECS["modelopt-nvfp4"].encode(w, EncodeArgs({"group_size": 16}, {}, "BF16", group))
        for suffix, t in want.items():
            assert c.tensors[f"{m}.{suffix}"].read() == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        t = dequant_module(c, module_storage(c, qs, m), f"{m}.weight", "F32")
        back = torch.frombuffer(bytearray(b"".join(recipe_bytes(t.recipe, t.nbytes))), dtype=torch.float32)
        err = (back.reshape(w.shape) - w.float()).abs().max() / w.float().abs().max()
        assert err < 0.25, (m, float(err))  # e2m1 steps are at most a quarter of the group's range
    assert run_ckpt("validate", out).exit_code == 0


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-fp8-channel", "modelopt-nvfp4"])
def test_the_verifiers_own_values_stitch_back_byte_identical(built, tmp_path, scheme):
    """A draft holding the verifier's MTP dequantized (extract --dequant bf16): every weight compares equal to
    the stored one, so the verifier's own tensors are kept and every output file is the verifier's, byte for byte."""
    family = "qwen3_5_moe" if scheme.startswith("modelopt") else "deepseek_v3"
    verifier, bf16, _ = built(family, scheme)
    out = tmp_path / "out"
    res = run_ckpt("stitch", bf16, verifier, "-o", out, "--json")
    rep = json.loads(res.output)
    stored = [t for t in rep["tensors"] if "FP" in (t["dtype_a"] or "") and t["dtype_a"] == t["dtype_b"]]
    assert stored and {t["status"] for t in rep["tensors"]} == {"unchanged"}, rep["totals"]
    assert not rep["rewritten_shards"]
    for f in sorted(verifier.glob("*.safetensors")) + [verifier / "config.json"]:
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_quantized_draft_is_refused_with_the_way_out(built, tmp_path):
    verifier, _, _ = built("deepseek_v3", "ct-nvfp4")
    native = tmp_path / "native"
    run_ckpt("extract", verifier, "-o", native)  # keeps the packed tensors
    res = run_ckpt("stitch", native, verifier, "-o", tmp_path / "out", code=3)
    assert "draft-mismatch" in res.output and "extract --dequant bf16" in res.output
    assert not (tmp_path / "out").exists()


def test_stitch_into_a_ue8m0_verifier_keeps_power_of_two_scales(tmp_path):
    """A finetuned draft re-quantized into a DeepSeek-V3.1-style verifier (scale_fmt ue8m0): its new block
    scales are powers of two like the verifier's; unchanged weights keep the verifier's bytes."""
    verifier = make_quantized_checkpoint("deepseek_v3", tmp_path / "v", QuantOptions(scheme="fp8-block-ue8m0"))
    draft = tmp_path / "draft"
    run_ckpt("extract", verifier, "-o", draft, "--dequant", "bf16")
    _finetune(draft)
    out = tmp_path / "out"
    run_ckpt("stitch", draft, verifier, "-o", out)
    c, v = Checkpoint.open(out), Checkpoint.open(verifier)
    scales = [k for k in c.tensors if k.startswith("model.layers.3.") and k.endswith("_scale_inv")]
    weights = [k.removesuffix("_scale_inv") for k in scales]
    assert weights and all(c.tensors[k].read() != v.tensors[k].read() for k in weights)  # re-quantized
    for k in scales:
        assert bool((torch.frexp(c.tensors[k].torch())[0] == 0.5).all()), k
    assert run_ckpt("validate", out).exit_code == 0


def test_one_changed_shard_of_a_fused_layer_reencodes_its_partner(built, tmp_path):
    """gate_proj changed, up_proj not: vLLM loads them as one gate_up_proj with one global scale, so the partner
    is encoded again and both carry the shared scale, byte for byte compressed-tensors' (llm-compressor's fused
    rule) compression of the draft's values."""
    from safetensors.torch import load_file, save_file

    verifier, bf16, _ = built("deepseek_v3", "ct-nvfp4")
    draft = tmp_path / "draft"
    draft.mkdir()
    for f in bf16.iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    gate = next(k for k in Checkpoint.open(draft).tensors if k.startswith(CASES["deepseek_v3"])
                and k.endswith("mlp.shared_experts.gate_proj.weight"))
    up = gate.replace("gate_proj", "up_proj")
    for f in draft.glob("*.safetensors"):
        t = load_file(f)
        if gate in t:
            t[gate] = (t[gate].float() * 1.5).to(t[gate].dtype)  # a new absmax: a new global scale for the pair
            save_file(t, f, metadata={"format": "pt"})
    out = tmp_path / "out"
    rep = json.loads(run_ckpt("stitch", draft, verifier, "-o", out, "--json", "--accept-divergent").output)
    actions = {t["key"]: t["status"] for t in rep["tensors"]}
    g, u = gate.removesuffix(".weight"), up.removesuffix(".weight")
    assert actions[f"{g}.weight_packed"] == actions[f"{u}.weight_packed"] == "replaced"
    c, d = Checkpoint.open(out), Checkpoint.open(draft)
    assert c.tensors[f"{g}.weight_global_scale"].read() == c.tensors[f"{u}.weight_global_scale"].read()
    qc = json.loads((verifier / "config.json").read_text())["quantization_config"]
    want = ct_compress_fused({m: d.tensors[f"{m}.weight"].torch() for m in (g, u)}, qc,
                             get_table("deepseek_v3").fused_modules)
    for k, t in want.items():
        if not k.rpartition(".")[2].startswith("input_"):
            assert c.tensors[k].read() == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), k
    others = [k for k, s in actions.items() if s != "unchanged" and not k.startswith((g + ".", u + "."))]
    assert not others, others  # nothing else was touched
