"""speculators' MTP logits as an oracle (tests/consumer_logits.py): the harness runs on our
`extract --format speculators` drafts of Qwen3-Next and Qwen3.5-MoE fixtures, and its rows follow
the documented alignment: depth-d row t reads hidden[t] and input_ids[t+d] only, so the first
token and the last hidden state never matter, the last token only moves the last depth-1 row, and
two runs are bit-identical. One subprocess for both families (speculators' import dominates).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import run_ckpt as ckpt
from consumer_logits import MtpInput, speculators_mtp_outputs

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3_next", "qwen3_5_moe"]
LENGTH = 12


def test_speculators_mtp_logits_follow_the_alignment(make_fixture, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the drafts name their verifier relative to here
    jobs, sizes = [], {}
    for family in FAMILIES:
        shutil.copytree(make_fixture(family), tmp_path / family)
        ckpt("extract", family, "-o", f"{family}-draft", "--format", "speculators")
        draft = tmp_path / f"{family}-draft"
        tc = json.loads((draft / "config.json").read_text())["transformer_layer_config"]
        vocab = sizes[family] = tc["vocab_size"]
        gen = torch.Generator().manual_seed(len(jobs))
        ids = torch.randint(0, vocab, (1, LENGTH), generator=gen)
        hidden = torch.randn(1, LENGTH, tc["hidden_size"], generator=gen)
        last = ids.clone()
        last[0, -1] = (last[0, -1] + 1) % vocab
        unused = ids.clone()  # input_ids[0] and hidden[L-1]: read by no row at any depth
        unused[0, 0] = (unused[0, 0] + 1) % vocab
        unused_hidden = hidden.clone()
        unused_hidden[0, -1] += 3.0
        jobs += [MtpInput(draft, ids, hidden), MtpInput(draft, ids, hidden), MtpInput(draft, last, hidden),
                 MtpInput(draft, unused, unused_hidden)]
    results = speculators_mtp_outputs(jobs)

    for i, family in enumerate(FAMILIES):
        base, again, last, unused = results[4 * i: 4 * i + 4]
        assert base["meta"]["model_type"].startswith(family), base["meta"]
        steps = base["meta"]["num_speculative_steps"]
        for d in range(1, steps + 1):
            logits = base[f"logits_depth{d}"]
            assert logits.dtype == torch.float32 and logits.shape == (LENGTH - d, sizes[family])
            assert torch.isfinite(logits).all()
            assert torch.equal(logits, again[f"logits_depth{d}"])  # deterministic
            # changing the first token and the last hidden state changes no row at any depth
            assert torch.allclose(unused[f"logits_depth{d}"], logits, rtol=0, atol=1e-5), family
        assert torch.equal(base["logits"], base["logits_depth1"])
        depth1 = base["logits"]
        assert (depth1[1:] - depth1[:-1]).abs().max() > 1e-3  # rows are positions, not copies
        moved = (last["logits"] - depth1).abs().amax(dim=-1)
        assert moved[-1] > 1e-3 and moved[:-1].max() <= 1e-5, (family, moved)
