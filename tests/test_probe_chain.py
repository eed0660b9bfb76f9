"""`ckpt probe --depth K`: depth k > 1 is chained as the serving engines chain an MTP draft.

``chain_logits`` computes every chain of a sequence in one forward per depth, under an attention
mask. Here it is held to a hand-written engine loop: for a chain starting at t, the first MTP
layer writes depth-1 entries for the verified prefix into a KV cache, then drafts one token per
step with that cache, feeding on the hidden state the engine feeds (SGLang: after the MTP's final
norm; vLLM: before it) and reusing the first MTP layer however many the model has.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools.ops.probe import probe as probe_ops  # noqa: E402

DEPTH = 3


@pytest.fixture(scope="module")
def loaded():
    d, _ = probe_model.build(CACHE)
    config = probe_ops.verifier_config(str(d))
    v = probe_ops.load_verifier(str(d), config, "cpu", "fp32")
    main, mtp = v.main, v.reference  # transformers' MtpModel: its modules by name (the engine is checked against it)
    x = probe_model.sample(1, 14, torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, hidden = probe_ops.teacher_forward(main, x)
    return main, mtp, x, hidden


def engine_chain(mtp, seq: torch.Tensor, hidden: torch.Tensor, t: int, depth: int, pre_norm: bool) -> list:
    """The logits an engine drafts for the chain that starts after the verified token seq[t + 1]."""
    from transformers.cache_utils import DynamicCache

    layer = mtp.layers[0]  # the engines draft every step with the first MTP layer
    cache = DynamicCache()

    def step(prev, ids, pos):  # the MTP layer by hand; the block's output before the final norm
        e = mtp.embed_tokens(ids)
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(prev)], dim=-1))
        pe = mtp.rotary_emb(e, position_ids=pos)
        return layer.mtp_block(x, attention_mask=None, position_embeddings=pe, position_ids=pos, cache=cache)

    # the verified prefix: depth-1 entries for positions 1..t+1 (causal: no mask, sdpa's is_causal)
    out = step(hidden[:, : t + 1], seq[:, 1 : t + 2], torch.arange(1, t + 2).unsqueeze(0))[:, -1:]
    drafts = []
    for k in range(2, depth + 2):
        normed = layer.post_norm(out)
        drafts.append(mtp._project_to_logits(normed)[0, 0])
        if t + k >= seq.shape[1]:
            break
        # the next step: one token (teacher-forced: the verifier's), attending the whole cache
        out = step(out if pre_norm else normed, seq[:, t + k : t + k + 1], torch.tensor([[t + k]]))
    return drafts[:depth]


@pytest.mark.parametrize("chain", probe_ops.CHAINS)
def test_chain_logits_equal_the_engine_loop(loaded, chain):
    _, mtp, x, hidden = loaded
    with torch.no_grad():
        got = probe_ops.chain_logits(mtp, x, hidden, DEPTH, chain)
        assert [g.shape[0] for g in got] == [x.shape[1] - k for k in range(1, DEPTH + 1)]
        for t in range(x.shape[1] - 1):
            want = engine_chain(mtp, x, hidden, t, DEPTH, pre_norm=chain == "vllm")
            for k, w in enumerate(want, 1):
                torch.testing.assert_close(got[k - 1][t], w.float(), atol=2e-5, rtol=1e-5, msg=f"chain {t} depth {k}")


def test_the_two_engines_agree_at_depth_1_and_differ_beyond(loaded):
    _, mtp, x, hidden = loaded
    with torch.no_grad():
        sglang = probe_ops.chain_logits(mtp, x, hidden, DEPTH, "sglang")
        vllm = probe_ops.chain_logits(mtp, x, hidden, DEPTH, "vllm")
    torch.testing.assert_close(sglang[0], vllm[0])
    assert (sglang[1] - vllm[1]).abs().max() > 1e-2  # the chained state is not the same tensor


def test_depth_2_sees_the_verified_prefix_at_depth_1_not_its_own_depth(loaded):
    """The mask matters: depth-2 entries attending each other causally (a plain second pass) differ."""
    _, mtp, x, hidden = loaded
    with torch.no_grad():
        got = probe_ops.chain_logits(mtp, x, hidden, 2, "sglang")
        h1 = mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, x.shape[1]).unsqueeze(0), None, input_ids=x[:, 1:])
        n = x.shape[1] - 2
        plain = mtp.forward_layer(0, h1[:, :n], torch.arange(2, 2 + n).unsqueeze(0), None, input_ids=x[:, 2:])
    assert (mtp._project_to_logits(plain)[0] - got[1]).abs().max() > 1e-2


def test_a_model_with_two_mtp_layers_still_drafts_every_depth_with_the_first(loaded):
    from transformers.modeling_layers import MtpModel

    main, mtp, x, hidden = loaded
    two = MtpModel(main, 2)
    two.layers[0].load_state_dict(mtp.layers[0].state_dict())
    two.tie_with_main_model(main)
    two.eval()
    with torch.no_grad():
        assert any((p.float() - q.float()).abs().max() > 0 for p, q in
                   zip(two.layers[1].parameters(), two.layers[0].parameters(), strict=True))
        for chain in probe_ops.CHAINS:
            for a, b in zip(probe_ops.chain_logits(two, x, hidden, DEPTH, chain),
                            probe_ops.chain_logits(mtp, x, hidden, DEPTH, chain), strict=True):
                torch.testing.assert_close(a, b)


def test_chain_is_an_option_of_the_command(tmp_path):
    d, _ = probe_model.build(CACHE)
    prompts = probe_model.write_prompts(tmp_path, 2, 6, seed=3)
    base = ["probe", d, "--prompts", prompts, "--max-new-tokens", 8, "--depth", 2, "--json"]
    sglang, vllm = (json.loads(ckpt(*base, "--chain", c).stdout) for c in ("sglang", "vllm"))
    assert (sglang["chain"], vllm["chain"]) == ("sglang", "vllm")
    [s], [v] = sglang["drafts"], vllm["drafts"]
    assert s["agreement"][0] == v["agreement"][0] and s["kl"][0] == v["kl"][0]  # depth 1: no chaining yet
    assert s["kl"][1] != v["kl"][1]
    assert "--chain" in ckpt("probe", d, "--chain", "trtllm", code=2).output
