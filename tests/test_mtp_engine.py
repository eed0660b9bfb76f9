"""probe's table-driven MTP engine (ops/probe/mtp_engine.py) held to other real implementations (issue 25 items 1, 2):

- transformers' own ``MtpModel`` on the tiny trained DeepSeek-V3 and GLM-4-MoE verifiers (probe_model.py):
  the same logits at depths 1..3, for both chains (SGLang feeds the post-norm state on, vLLM the pre-norm
  one), within float32 rounding;
- speculators 0.9.0's ``MTPDraftModel`` (its own venv, tests/consumer_logits.py) on the real producers'
  Qwen3-Next, Qwen3.5 and Qwen3.5-MoE checkpoints (fixtures/producers/transformers-*, transformers'
  save_pretrained with the MTP layers appended) and the drafts speculators' converter made from them
  (fixtures/producers/speculators-*): the same weights, the same input ids and the verifier's hidden
  states, the same depth-1 logits within float32 rounding. speculators runs its MTP layer at positions
  0..L-2 where the engines (and ours) run it at 1..L-1: RoPE depends on position differences only, so
  the logits agree all the same. One speculators subprocess for all three.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools.ops.probe import probe as probe_ops  # noqa: E402

from consumer_logits import MtpInput, speculators_mtp_outputs  # noqa: E402

pytestmark = pytest.mark.slow

DEPTH = 3
ROUNDING = 1e-5  # float32: both engines compute the same operations, in a possibly different order
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
SPECULATORS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
LENGTH = 12


def _load(path: Path):
    config = probe_ops.verifier_config(str(path))
    return probe_ops.load_verifier(str(path), config, "cpu", "fp32")


# -- the engine against transformers' MtpModel ------------------------------------------------------------------


@pytest.fixture(scope="module", params=probe_model.MTP_MODEL_FAMILIES)
def trained(request):
    d, _ = probe_model.build(CACHE, request.param)
    loaded = _load(d)
    assert loaded.reference is not None, loaded.reference_note
    seq = probe_model.sample(1, 14, torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, hidden = probe_ops.teacher_forward(loaded.main, seq)
    return request.param, loaded, seq, hidden


@pytest.mark.parametrize("chain", probe_ops.CHAINS)
def test_engine_equals_transformers_mtp_model(trained, chain):
    family, loaded, seq, hidden = trained
    assert type(loaded.mtp).__module__ == "ckpt_tools.ops.probe.mtp_engine" and loaded.mtp is not loaded.reference
    with torch.no_grad():
        ours = probe_ops.chain_logits(loaded.mtp, seq, hidden, DEPTH, chain)
        theirs = probe_ops.chain_logits(loaded.reference, seq, hidden, DEPTH, chain)
    assert len(ours) == len(theirs) == DEPTH
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        assert a.shape == b.shape == (seq.shape[1] - k, probe_model.VOCAB)
        diff = float((a - b).abs().max())
        print(f"{family} {chain} depth {k}: engine vs MtpModel max abs diff {diff:.3g}")
        assert diff <= ROUNDING, (family, chain, k, diff)
        assert float((b - b.mean()).abs().max()) > 1e-2  # not a comparison of constants
    # the chains differ past depth 1 (else the comparison would not tell them apart)
    if chain == "vllm":
        with torch.no_grad():
            other = probe_ops.chain_logits(loaded.reference, seq, hidden, 2, "sglang")[1]
        assert float((other - theirs[1]).abs().max()) > 1e-4


# -- the engine against speculators' MTPDraftModel --------------------------------------------------------------


def _catalogue(name: str) -> dict:
    return json.loads((CORPUS / f"{name}.json").read_text())


def _files_digest(folder: Path) -> str:
    """The digest the corpus script (fixtures/producers/scripts/speculators_convert.py, digest()) recorded of the
    verifier it converted: one sha256 over each file's name and sha256."""
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


@pytest.fixture(scope="module")
def speculators_runs() -> dict:
    """Per family: the engine's depth-1 logits on the verifier's own MTP, and speculators' on its converted draft."""
    jobs, ours = [], {}
    for family in SPECULATORS:
        draft, verifier = f"speculators-{family}", f"transformers-{family}"
        entry = _catalogue(draft)
        assert entry["source"] == verifier and entry["family"] == family, entry
        recorded = re.search(r"Verifier files sha256 digest ([0-9a-f]{64})", entry["notes"])
        assert recorded and recorded.group(1) == _files_digest(CORPUS / verifier), draft  # made from these bytes
        loaded = _load(CORPUS / verifier)
        vocab = loaded.main.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (1, LENGTH), generator=torch.Generator().manual_seed(len(jobs)))
        with torch.no_grad():
            _, hidden = probe_ops.teacher_forward(loaded.main, ids)
            ours[family] = probe_ops.chain_logits(loaded.mtp, ids, hidden, 1, "sglang")[0]
        jobs.append(MtpInput(CORPUS / draft, ids, hidden.float(), verifier=CORPUS / verifier))
        del loaded
    results = speculators_mtp_outputs(jobs)
    return {f: (ours[f], r) for f, r in zip(SPECULATORS, results, strict=True)}


@pytest.mark.parametrize("family", SPECULATORS)
def test_engine_depth1_equals_speculators(family, speculators_runs):
    ours, res = speculators_runs[family]
    theirs = res["logits_depth1"]
    assert res["meta"]["model_type"].startswith(family), res["meta"]
    assert ours.shape == theirs.shape == (LENGTH - 1, ours.shape[-1])
    diff = float((ours - theirs).abs().max())
    print(f"{family}: engine vs speculators MTPDraftModel depth-1 max abs diff {diff:.3g}")
    torch.testing.assert_close(ours, theirs, rtol=ROUNDING, atol=ROUNDING)
    assert float((theirs - theirs.mean()).abs().max()) > 1e-2  # not a comparison of constants
