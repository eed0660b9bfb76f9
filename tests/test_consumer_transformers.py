"""A real consumer: transformers 5.x loads the MTP layer of a DeepSeek-V3 checkpoint we stitched.

The verifier is a tiny DeepSeek-V3 built by transformers itself with 61 decoder layers (so
the MTP layer sits at the real release's index, model.layers.61), its MTP layer written in
the released per-expert layout, with the per-layer embed / head copies the release ships or
without them (as SGLang's NextN export leaves it). extract -> perturb -> stitch, then
`MtpModel.from_pretrained` must load exactly the perturbed weights, take the embedding and head
from the main model, and `generate(use_mtp=True)` must produce the same greedy tokens as plain
greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.io.config import ConfigView
from ckpt_tools.model.tables.loader import get_table
from ckpt_tools.model.tables.resolve import resolve
from ckpt_tools.testing.fixtures import spec_values

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")


def tiny_config():
    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=61,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=3, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=128, num_nextn_predict_layers=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


@pytest.fixture(scope="module", params=["copies", "nocopies"])
def verifier(tmp_path_factory, request) -> Path:
    """transformers writes the trunk; the MTP layer (layer 61) is added in the released layout."""
    d = tmp_path_factory.mktemp(f"dsv3-61-{request.param}")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(tiny_config())
    model.save_pretrained(d, max_shard_size="400KB")
    cfg = json.loads((d / "config.json").read_text())
    res = resolve(get_table("deepseek_v3"), ConfigView(cfg))
    assert res.layers[0].prefix == "model.layers.61."
    state = model.state_dict()
    mtp = {}
    for spec in res.mtp_specs():
        if spec.copy_of and request.param == "nocopies":
            continue  # optional: transformers' MtpModel and the engines take the trunk's
        if spec.copy_of:  # per-layer copies of the embedding and head, as DeepSeek-V3 ships them
            source = "model.embed_tokens.weight" if spec.role == "embed" else "lm_head.weight"
            mtp[spec.key] = state[source].clone()
        else:
            values = torch.from_numpy(spec_values(spec, 7, zero_centred=False))
            mtp[spec.key] = values.to(torch.float32 if spec.dtype == "F32" else torch.bfloat16)
    save_file(mtp, str(d / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in mtp.values())
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    ckpt("validate", d)
    return d


COPIES = ["model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight"]
PERTURB = [
    "model.layers.61.eh_proj.weight",
    "model.layers.61.enorm.weight",
    "model.layers.61.self_attn.kv_b_proj.weight",
    "model.layers.61.mlp.experts.2.up_proj.weight",
    "model.layers.61.mlp.experts.0.down_proj.weight",
    "model.layers.61.shared_head.norm.weight",
]


@pytest.mark.slow
def test_mtp_model_loads_perturbed_weights_and_generates(verifier, tmp_path):
    draft, out = tmp_path / "draft", tmp_path / "stitched"
    has_copies = all(k in json.loads((verifier / "model.safetensors.index.json").read_text())["weight_map"]
                     for k in COPIES)
    # without per-layer copies, --with-embed carries the trunk's embedding (stitch leaves it alone)
    ckpt("extract", verifier, "-o", draft, *([] if has_copies else ["--with-embed"]))
    f = draft / "model.safetensors"
    tensors = load_file(str(f))
    rng = np.random.default_rng(0)
    for k in PERTURB:
        noise = torch.from_numpy(rng.standard_normal(tuple(tensors[k].shape)).astype(np.float32)) * 0.05
        tensors[k] = (tensors[k].float() + noise).to(tensors[k].dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})
    ckpt("stitch", draft, verifier, "-o", out)
    report = json.loads((out / "stitch-report.json").read_text())
    assert sorted(t["key"] for t in report["tensors"] if t["status"] == "replaced") == sorted(PERTURB)
    assert (report["kept_copies"], report["absent_copies"]) == ((COPIES, []) if has_copies else ([], COPIES))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert all((k in index) == has_copies for k in COPIES)  # kept when shipped, never invented

    main = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel.from_pretrained(main)
    assert mtp.shared_head is main.lm_head and mtp.embed_tokens is main.get_input_embeddings()
    layer = mtp.layers[0]
    p = {k: v.float() for k, v in tensors.items()}
    exact = {
        "eh_proj.weight": p["model.layers.61.eh_proj.weight"],
        "enorm.weight": p["model.layers.61.enorm.weight"],
        "hnorm.weight": p["model.layers.61.hnorm.weight"],
        "post_norm.weight": p["model.layers.61.shared_head.norm.weight"],
        "mtp_block.self_attn.kv_b_proj.weight": p["model.layers.61.self_attn.kv_b_proj.weight"],
        "mtp_block.mlp.gate.weight": p["model.layers.61.mlp.gate.weight"],
        "mtp_block.mlp.shared_experts.up_proj.weight": p["model.layers.61.mlp.shared_experts.up_proj.weight"],
    }
    params = dict(layer.named_parameters())
    for name, expected in exact.items():
        assert torch.equal(params[name].float(), expected), name
    gate_up = params["mtp_block.mlp.experts.gate_up_proj"].float()
    down = params["mtp_block.mlp.experts.down_proj"].float()
    for e in range(gate_up.shape[0]):
        g = p[f"model.layers.61.mlp.experts.{e}.gate_proj.weight"]
        u = p[f"model.layers.61.mlp.experts.{e}.up_proj.weight"]
        assert torch.equal(gate_up[e], torch.cat([g, u])), e
        assert torch.equal(down[e], p[f"model.layers.61.mlp.experts.{e}.down_proj.weight"]), e
    bias = dict(layer.named_buffers()).get("mtp_block.mlp.gate.e_score_correction_bias")
    if bias is None:
        bias = params["mtp_block.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias.float(), p["model.layers.61.mlp.gate.e_score_correction_bias"])

    ids = torch.tensor([[1, 5, 9, 17, 33, 2 + 60]])
    plain = main.generate(ids, max_new_tokens=8, do_sample=False)
    with_mtp = main.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True)
    assert torch.equal(plain, with_mtp)
