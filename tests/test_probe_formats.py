"""`ckpt probe` across draft formats, on the tiny trained DeepSeek-V3-layout verifier (tests/probe_model.py).

A draft that went through another format (and back through stitch) must measure exactly like the
verifier's own MTP, on both tiny models; a draft whose gate/up halves a trainer swapped must show a
larger KL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)


@pytest.fixture(scope="module")
def trained() -> Path:
    d, _ = probe_model.build(CACHE)
    return d


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return probe_model.write_prompts(tmp_path_factory.mktemp("prompts"), 3, 6, seed=11)


def probe_json(verifier, prompts, *drafts) -> dict:
    args = ["probe", verifier, "--prompts", prompts, "--max-new-tokens", 12, "--depth", 1, "--json"]
    for d in drafts:
        args += ["--draft", d]
    return json.loads(ckpt(*args).stdout)


def _numbers(entry: dict) -> tuple:
    return entry["agreement"], entry["kl"], entry["positions"], entry["greedy_equal"]


@pytest.fixture(scope="module")
def drafts(trained, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for fmt in ("native", "sglang-nextn"):
        out[fmt] = root / fmt
        ckpt("extract", trained, "-o", out[fmt], "--format", fmt)
    return out


@pytest.mark.parametrize("family", list(probe_model.FAMILIES))
def test_speculators_cannot_express_either_probe_family(family, tmp_path):
    """speculators 0.9.0 builds MTP layers only for Qwen3-Next / Qwen3.5, which transformers' MtpModel does not load:
    no family probe supports round-trips through it, and extract says so."""
    d, _ = probe_model.build(CACHE, family)
    r = ckpt("extract", d, "-o", tmp_path / "spec", "--format", "speculators", code=3)
    assert "format-unsupported" in r.output and probe_model.table_family(family) in r.output
    assert not (tmp_path / "spec" / "model.safetensors").exists()


def test_one_draft_in_two_formats_measures_identically_to_the_verifier(trained, prompts, drafts):
    out = probe_json(trained, prompts, drafts["native"], drafts["sglang-nextn"])
    v, native, nextn = out["drafts"]
    assert [d["name"] for d in out["drafts"]] == ["verifier", str(drafts["native"]), str(drafts["sglang-nextn"])]
    assert v["agreement"][0] >= 0.8 and v["greedy_equal"] is True
    assert v["positions"] == 3 * 12
    assert _numbers(native) == _numbers(v)
    assert _numbers(nextn) == _numbers(v)


def test_sglang_nextn_draft_stitched_back_measures_identically(trained, prompts, drafts, tmp_path):
    stitched = tmp_path / "stitched"
    ckpt("stitch", drafts["sglang-nextn"], trained, "-o", stitched)
    [base] = probe_json(trained, prompts)["drafts"]
    [again] = probe_json(stitched, prompts)["drafts"]
    assert _numbers(again) == _numbers(base)


def swap_gate_up(tensors: dict) -> int:
    """Exchange gate_proj and up_proj of every routed expert and of the shared expert; the count swapped."""
    n = 0
    for g in [k for k in tensors if k.endswith("gate_proj.weight") and (".experts." in k or "shared_experts" in k)]:
        u = g.replace("gate_proj", "up_proj")
        tensors[g], tensors[u] = tensors[u], tensors[g]
        n += 1
    return n


def test_swapped_gate_up_halves_show_a_larger_kl(trained, prompts, drafts, tmp_path):
    counts = []
    swapped = probe_model.edited(drafts["native"], tmp_path / "gate-up", lambda t: counts.append(swap_gate_up(t)))
    assert counts == [probe_model.tiny_config().n_routed_experts + 1]
    v, s = probe_json(trained, prompts, swapped)["drafts"]
    print(f"gate/up swapped: {s}; baseline: {v}")
    assert s["kl"][0] > v["kl"][0] + 0.3, (v, s)
    assert s["greedy_equal"] is True  # verification keeps greedy output whatever the draft


def test_a_trained_glm4_moe_verifier_agrees_and_its_drafts_measure_identically(prompts, tmp_path):
    """GLM-4-MoE: depth-1 agreement and the greedy loop; native and SGLang NextN drafts mapped in memory, and
    each stitched back into the verifier, measure exactly like its own MTP."""
    glm, _ = probe_model.build(CACHE, "glm4_moe")
    assert json.loads((glm / "config.json").read_text())["model_type"] == "glm4_moe"
    drafts = {}
    for fmt in ("native", "sglang-nextn"):
        drafts[fmt] = tmp_path / fmt
        ckpt("extract", glm, "-o", drafts[fmt], "--format", fmt)
    swapped = probe_model.edited(drafts["native"], tmp_path / "eh-swapped", probe_model.swap_eh_proj_halves)
    out = probe_json(glm, prompts, drafts["native"], drafts["sglang-nextn"], swapped)
    print(f"glm4_moe: {[(d['agreement'], d['kl']) for d in out['drafts']]}")
    v, native, nextn, s = out["drafts"]
    assert v["agreement"][0] >= 0.8, v
    assert v["greedy_equal"] is True and v["positions"] == 3 * 12
    assert _numbers(native) == _numbers(v) and _numbers(nextn) == _numbers(v)
    assert v["agreement"][0] - s["agreement"][0] >= 0.3 and s["greedy_equal"] is True
    for fmt, d in drafts.items():
        stitched = tmp_path / f"stitched-{fmt}"
        ckpt("stitch", d, glm, "-o", stitched)
        [again] = probe_json(stitched, prompts)["drafts"]
        assert _numbers(again) == _numbers(v), fmt
