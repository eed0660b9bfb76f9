"""speculators' MTP logits as an oracle (tests/consumer_logits.py), on our `extract --format
speculators` drafts of Qwen3-Next and Qwen3.5-MoE fixtures:
- its rows follow the documented alignment: depth-d row t reads hidden[t] and input_ids[t+d] only,
  so the first token and the last hidden state never matter, the last token moves only the last
  depth-1 row, and two runs are bit-identical;
- depth 1 equals an independent computation here (plain torch around the verifier's own decoder
  layer class from this environment's transformers, the draft's weights loaded into it), on the
  verifier's real hidden states: float32 rounding apart.
One subprocess for both families (speculators' import dominates its cost).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import run_ckpt as ckpt
from consumer_logits import MtpInput, speculators_mtp_outputs

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3_next", "qwen3_5_moe"]
LENGTH = 12
JOBS = ("base", "again", "last", "unused", "real")


def plain_depth1(verifier: Path, draft: Path, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[L-1, vocab]: final_norm(layer(input_proj(cat(token_norm(embed(ids[t+1])), hidden_norm(hidden[t]))))) @ head.

    The layer is a copy of the verifier's last full-attention decoder layer with the draft's
    weights; its position embeddings and mask are those the verifier builds for L-1 tokens.
    """
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    decoder = model.get_decoder()
    idx = max(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    seen: dict = {}
    hook = decoder.layers[idx].register_forward_pre_hook(lambda _m, _a, kw: seen.update(kw), with_kwargs=True)
    length = ids.shape[1]
    with torch.no_grad():
        model(input_ids=ids[:, : length - 1])
    hook.remove()
    with safe_open(str(draft / "model.safetensors"), "pt") as fh:
        w = {k.removeprefix("mtp_layers.0."): fh.get_tensor(k).float() for k in fh.keys()}

    def norm(name: str) -> torch.nn.Module:
        n = copy.deepcopy(decoder.norm)  # the family's RMSNorm convention
        n.load_state_dict({"weight": w.pop(f"{name}.weight")})
        return n

    hidden_norm, token_norm, final_norm = norm("hidden_layernorm"), norm("token_layernorm"), norm("final_layernorm")
    proj = w.pop("input_proj.weight")
    layer = copy.deepcopy(decoder.layers[idx])
    layer.load_state_dict(w, strict=True)
    with torch.no_grad():
        x = torch.cat([token_norm(model.get_input_embeddings()(ids[:, 1:])), hidden_norm(hidden[:, : length - 1])], -1)
        out = layer(torch.nn.functional.linear(x, proj), position_embeddings=seen["position_embeddings"],
                    attention_mask=seen["attention_mask"], position_ids=seen["position_ids"])
        out = out[0] if isinstance(out, tuple) else out
        return model.get_output_embeddings()(final_norm(out))[0]


@pytest.fixture(scope="module")
def runs(make_fixture, tmp_path_factory) -> dict:
    """Per family: the inputs of each job, speculators' outputs for them, the plain computation."""
    work = tmp_path_factory.mktemp("spec-logits")
    jobs, out = [], {}
    for family in FAMILIES:
        shutil.copytree(make_fixture(family), work / family)
        draft = work / f"{family}-draft"
        ckpt("extract", work / family, "-o", draft, "--format", "speculators")
        vocab = json.loads((draft / "config.json").read_text())["transformer_layer_config"]["vocab_size"]
        model = AutoModelForCausalLM.from_pretrained(work / family, dtype=torch.float32).eval()
        ids = torch.randint(0, vocab, (1, LENGTH), generator=torch.Generator().manual_seed(len(jobs)))
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
        last, unused = ids.clone(), ids.clone()
        last[0, -1] = (last[0, -1] + 1) % vocab
        unused[0, 0] = (unused[0, 0] + 1) % vocab  # with hidden[L-1]: read by no row at any depth
        unused_noise = noise.clone()
        unused_noise[0, -1] += 3.0
        inputs = {"base": (noise, ids), "again": (noise, ids), "last": (noise, last), "unused": (unused_noise, unused),
                  "real": (hidden, ids)}
        jobs += [MtpInput(draft, i, h, verifier=work / family) for h, i in (inputs[j] for j in JOBS)]
        out[family] = {"vocab": vocab, "plain": plain_depth1(work / family, draft, ids, hidden)}
    results = speculators_mtp_outputs(jobs)
    for i, family in enumerate(FAMILIES):
        out[family].update(zip(JOBS, results[len(JOBS) * i: len(JOBS) * (i + 1)]))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_speculators_mtp_logits_follow_the_alignment(family, runs):
    r = runs[family]
    base = r["base"]
    assert base["meta"]["model_type"].startswith(family), base["meta"]
    for d in range(1, base["meta"]["num_speculative_steps"] + 1):
        logits = base[f"logits_depth{d}"]
        assert logits.dtype == torch.float32 and logits.shape == (LENGTH - d, r["vocab"])
        assert torch.isfinite(logits).all()
        assert torch.equal(logits, r["again"][f"logits_depth{d}"])  # deterministic
        assert torch.allclose(r["unused"][f"logits_depth{d}"], logits, rtol=0, atol=1e-6)
    assert torch.equal(base["logits"], base["logits_depth1"])
    depth1 = base["logits"]
    assert (depth1[1:] - depth1[:-1]).abs().max() > 1e-3  # rows are positions, not copies
    moved = (r["last"]["logits"] - depth1).abs().amax(dim=-1)
    assert moved[-1] > 1e-3 and moved[:-1].max() <= 1e-6, moved


@pytest.mark.parametrize("family", FAMILIES)
def test_speculators_depth1_equals_plain_torch(family, runs):
    ours, theirs = runs[family]["plain"], runs[family]["real"]["logits"]
    assert ours.shape == theirs.shape == (LENGTH - 1, runs[family]["vocab"])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    assert (ours - ours.mean()).abs().max() > 1e-2  # the comparison is not between constants
