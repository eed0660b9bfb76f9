"""FP8 verifiers: extract --dequant bf16 -> stitch is byte-identical when nothing changed, and
changes exactly the perturbed weights and their scales otherwise (issue 8)."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.io.checkpoint import Checkpoint

from conftest import run_ckpt as ckpt
from conftest import tree_hash

# dims that are not multiples of 128 on purpose: partial edge tiles everywhere
FP8_DIMS = {"hidden_size": 160, "moe_intermediate_size": 136, "q_lora_rank": 136, "kv_lora_rank": 24}


def test_untouched_dequantized_draft_stitches_back_byte_identical(make_fixture, tmp_path):
    verifier = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_DIMS)
    before = tree_hash(verifier)
    draft, out = tmp_path / "draft", tmp_path / "out"
    ckpt("extract", verifier, "-o", draft, "--dequant", "bf16")
    ckpt("stitch", draft, verifier, "-o", out)
    for f in verifier.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert tree_hash(verifier) == before


def test_perturbed_dequantized_draft_requantizes_exactly_those(make_fixture, tmp_path):
    from quant_helpers import fp8_dequant as dequantize
    from quant_helpers import quantize

    verifier = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_DIMS)
    draft, out = tmp_path / "draft", tmp_path / "out"
    ckpt("extract", verifier, "-o", draft, "--dequant", "bf16")
    f = draft / "model.safetensors"
    tensors = load_file(str(f))
    targets = ["model.layers.3.self_attn.q_b_proj.weight", "model.layers.3.mlp.experts.1.down_proj.weight"]
    rng = np.random.default_rng(0)
    for k in targets:
        noise = torch.from_numpy(rng.standard_normal(tuple(tensors[k].shape)).astype(np.float32)) * 0.01
        tensors[k] = (tensors[k].float() + noise).to(torch.bfloat16)
    save_file(tensors, str(f), metadata={"format": "pt"})
    ckpt("stitch", draft, verifier, "-o", out)
    diff = json.loads(ckpt("diff", verifier, out, "--json", code=1).output)
    changed = {t["key"] for t in diff["tensors"]}
    assert changed <= {k for t in targets for k in (t, t.replace(".weight", ".weight_scale_inv"))}
    assert set(targets) <= changed
    c = Checkpoint.open(out)
    for k in targets:
        assert c.tensors[k].dtype == "F8_E4M3"
        q, s = quantize(tensors[k].float(), (128, 128))  # the reference quantization of the new values
        assert c.tensors[k].read() == bytearray(q.view(torch.uint8).numpy().tobytes())
        assert torch.equal(c.tensors[k.replace(".weight", ".weight_scale_inv")].torch(), s)
        back = dequantize(c.tensors[k].torch(), s)
        assert (back - tensors[k].float()).abs().max() <= tensors[k].float().abs().max() * 2 ** -4


def test_one_ulp_in_one_element_replaces_exactly_that_weight(make_fixture, tmp_path):
    """Stitch's identity check compares values: one bf16 ulp in the last edge tile of one expert is a
    change (re-quantized), every other FP8 weight keeps the verifier's bytes."""
    verifier = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_DIMS)
    draft, out = tmp_path / "draft", tmp_path / "out"
    ckpt("extract", verifier, "-o", draft, "--dequant", "bf16")
    f = draft / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.3.mlp.experts.1.up_proj.weight"
    tensors[key].view(torch.int16)[-1, -1] ^= 1
    save_file(tensors, str(f), metadata={"format": "pt"})
    rep = json.loads(ckpt("stitch", draft, verifier, "-o", out, "--json").output)
    changed = {t["key"]: t["status"] for t in rep["tensors"] if t["status"] != "unchanged"}
    assert changed == {key: "replaced", key + "_scale_inv": "replaced"}
    v, c = Checkpoint.open(verifier), Checkpoint.open(out)
    assert all(c.tensors[k].read() == ref.read() for k, ref in v.tensors.items() if k not in changed)


def test_diff_dequant_compares_fp8_weights_by_value(make_fixture, tmp_path):
    """`ckpt diff --dequant` decodes FP8 weights in runs of elements that cut rows and edge tiles: the same
    values extract's band dequantizer writes as F32 (max |a - b| 0), and a perturbed weight stands out."""
    verifier = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_DIMS)
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft, "--dequant", "f32")
    v = Checkpoint.open(verifier)
    fp8 = {k for k in Checkpoint.open(draft).tensors if v.tensors[k].dtype == "F8_E4M3"}
    rep = json.loads(ckpt("diff", verifier, draft, "--dequant", "--json", code=1).output)
    by_key = {t["key"]: t for t in rep["tensors"]}
    assert fp8 and all(by_key[k]["max_abs"] == 0.0 and by_key[k]["cosine"] == 1.0 for k in fp8)
    f = draft / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"  # 160 columns: two edge tiles per row
    tensors[key][-1, -1] += 0.5
    save_file(tensors, str(f), metadata={"format": "pt"})
    rep = json.loads(ckpt("diff", verifier, draft, "--dequant", "--json", code=1).output)
    moved = {t["key"]: t["max_abs"] for t in rep["tensors"] if t["key"] in fp8 and t["max_abs"] != 0.0}
    assert set(moved) == {key} and abs(moved[key] - 0.5) < 1e-6
    plain = json.loads(ckpt("diff", verifier, draft, "--json", code=1).output)  # FP8 bytes have no values
    assert [t.get("max_abs") for t in plain["tensors"] if t["key"] == key] == [None]


def test_decisions_say_what_is_written_and_why(make_fixture, tmp_path):
    from ckpt_tools.api import stitch

    verifier = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_DIMS)
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft, "--dequant", "bf16")
    key = "model.layers.3.self_attn.q_b_proj.weight"
    f = draft / "model.safetensors"
    tensors = load_file(str(f))
    tensors[key] = (tensors[key].float() * 1.01).to(torch.bfloat16)
    save_file(tensors, str(f), metadata={"format": "pt"})
    by_key = {d.key: d for d in stitch(draft, verifier, tmp_path / "o", dry_run=True).details.decisions}
    assert by_key[key].action == by_key[key + "_scale_inv"].action == "requantize"
    assert by_key[key].stats.status == "replaced" and key in by_key[key + "_scale_inv"].reason
    others = {d.action for k, d in by_key.items() if k not in (key, key + "_scale_inv")}
    assert others == {"identical"}
    assert "the verifier's FP8 block [128, 128] decoded: its bytes are kept" in \
        by_key["model.layers.3.mlp.experts.0.up_proj.weight"].reason
    kept = {d.key: d for d in stitch(draft, verifier, tmp_path / "o", dry_run=True, keep_bf16=True).details.decisions}
    removed = {k for k, d in kept.items() if d.action == "remove"}
    assert removed and all(k.endswith("_scale_inv") and kept[k[: -len("_scale_inv")]].action == "replace"
                           for k in removed)
    assert "written as BF16 where the verifier stores FP8 block [128, 128], as the request asks (--keep-bf16" in \
        kept[key.replace("q_b", "kv_b")].reason


def test_keep_bf16_writes_unquantized_mtp_and_says_so_in_the_config(make_fixture, tmp_path):
    verifier = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_DIMS)
    draft, out = tmp_path / "draft", tmp_path / "out"
    ckpt("extract", verifier, "-o", draft, "--dequant", "bf16")
    ckpt("stitch", draft, verifier, "-o", out, "--keep-bf16")
    c, v, d = Checkpoint.open(out), Checkpoint.open(verifier), Checkpoint.open(draft)
    mtp = [k for k in c.tensors if k.startswith("model.layers.3.")]
    assert mtp and not [k for k in mtp if k.endswith("weight_scale_inv")]  # scales of MTP weights removed
    for k in mtp:
        if k in d.tensors:  # every MTP weight holds the draft's bf16 values, unquantized
            assert c.tensors[k].dtype == d.tensors[k].dtype and c.tensors[k].read() == d.tensors[k].read(), k
    for k, ref in v.tensors.items():  # the trunk stays FP8, byte for byte
        if not k.startswith("model.layers.3."):
            assert c.tensors[k].read() == ref.read(), k
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    from transformers.quantizers.quantizers_utils import should_convert_module  # the consumer's matcher

    # every module stitch turned from FP8 into bf16 (the verifier's own bf16 modules keep their declaration)
    modules = {k.removesuffix(".weight") for k in mtp if k.endswith(".weight") and v.tensors[k].dtype == "F8_E4M3"}
    assert modules and not [m for m in modules if should_convert_module(m, q["modules_to_not_convert"])]
    trunk = {k.removesuffix(".weight") for k in c.tensors if k.endswith("_proj.weight") and k not in mtp}
    assert all(should_convert_module(m, q["modules_to_not_convert"]) for m in trunk)  # the trunk stays FP8
    assert ckpt("validate", out).exit_code == 0


def test_fixture_script_writes_a_checkpoint(tmp_path):
    from ckpt_tools.testing.__main__ import main

    assert main(["qwen3_next", str(tmp_path / "q"), "--shards", "2", "--config", '{"hidden_size": 32}']) == 0
    c = Checkpoint.open(tmp_path / "q")
    assert len(c.shard_names) == 2 and c.config.get("hidden_size") == 32
    assert main(["no_such_family", str(tmp_path / "x")]) == 3
