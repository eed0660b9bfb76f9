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
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

from conftest import run_ckpt

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


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-fp8-channel"])
def test_stitch_into_a_compressed_tensors_verifier(built, tmp_path, family, scheme):
    verifier, _, draft = built(family, scheme)
    prefix, out = CASES[family], tmp_path / "out"
    res = run_ckpt("stitch", draft, verifier, "-o", out)
    assert "quantization config:" in res.output and "added" in res.output
    v, d, c = Checkpoint.open(verifier), Checkpoint.open(draft), Checkpoint.open(out)
    modules = _mtp_linears(d, prefix)
    stored = {m for m in modules  # quantized in the verifier: packed, or FP8 codes beside their scales
              if f"{m}.weight" not in v.tensors or v.tensors[f"{m}.weight"].dtype not in ("BF16", "F16", "F32")}
    assert stored, "the fixture's MTP must be stored quantized"
    for m in modules:  # every MTP weight is the draft's, byte for byte
        assert c.tensors[f"{m}.weight"].read() == d.tensors[f"{m}.weight"].read(), m
    for m in stored:  # and nothing of the packing is left (packed codes, scales, global scales, input scales)
        assert [k for k in c.tensors if k.startswith(m + ".")] == [f"{m}.weight"], m
    for k, ref in v.tensors.items():  # the trunk (and the verifier's unquantized MTP norms) unchanged
        if not k.startswith(prefix):
            assert c.tensors[k].read() == ref.read(), k
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert not [m for m in stored if not any(match_name(m, i) for i in ignore)]  # the consumer's matcher
    trunk_quantized = {k.rsplit(".", 1)[0] for k in v.tensors if not k.startswith(prefix) and "weight_" in k}
    assert trunk_quantized and not [m for m in trunk_quantized if any(match_name(m, i) for i in ignore)]
    assert run_ckpt("validate", out).exit_code == 0
    rep = json.loads((out / "stitch-report.json").read_text())
    assert rep["quant_config"]["changes"][0]["field"] == "ignore"


def test_stitch_into_a_modelopt_nvfp4_verifier_repairs_its_side_file(built, tmp_path):
    verifier, _, draft = built("qwen3_5_moe", "modelopt-nvfp4")
    out = tmp_path / "out"
    run_ckpt("stitch", draft, verifier, "-o", out)
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert exclude == json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    v = Checkpoint.open(verifier)
    stored = {m for m in _mtp_linears(Checkpoint.open(draft), "mtp.") if f"{m}.weight_scale_2" in v.tensors}
    assert "mtp.fc" in stored
    assert not [m for m in stored if not any(fnmatch.fnmatch(m, p) for p in exclude)]  # ModelOpt's matcher
    assert run_ckpt("validate", out).exit_code == 0


def test_the_verifiers_own_values_stitch_back_unchanged(built, tmp_path):
    """A draft holding the verifier's MTP dequantized: every weight compares equal to the stored one."""
    verifier, bf16, _ = built("deepseek_v3", "ct-nvfp4")
    res = run_ckpt("stitch", bf16, verifier, "-o", tmp_path / "out", "--json")
    diffs = {t["key"]: t for t in json.loads(res.output)["tensors"]}
    eh = diffs["model.layers.3.eh_proj.weight"]
    assert eh["status"] == "dtype-changed" and eh["max_abs"] == 0 and "NVFP4" in eh["dtype_a"]


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
