"""`ckpt probe` on a tiny TRAINED Qwen3-Next verifier (tests/probe_model_mtp.py): a `mtp.*` family, which
transformers' MtpModel does not build, measured by probe's table-driven engine alone.

Its MTP layer was trained through that engine, so agreement means something: high for the layer as
trained; far lower for a draft whose fusion (``mtp.fc``) halves are exchanged; and identical for the
same layer after a round trip through speculators' draft format (`extract --format speculators`, then
mapped back onto the verifier by `probe --draft`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
import probe_model_mtp  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

PROMPTS, NEW_TOKENS = 4, 16


@pytest.fixture(scope="module")
def trained() -> Path:
    d, seconds = probe_model_mtp.build(CACHE)
    print(f"trained tiny Qwen3-Next verifier: {d} (training {seconds:.1f} s; 0: cached)")
    return d


@pytest.fixture(scope="module")
def measured(trained, tmp_path_factory) -> dict:
    """One probe run: the verifier's own MTP; its speculators draft; the native draft and the speculators draft,
    each with the fusion halves exchanged."""
    root = tmp_path_factory.mktemp("qwen3-next-drafts")
    prompts = probe_model.write_prompts(root, PROMPTS, 6, seed=7)
    native, spec = root / "native", root / "speculators"
    ckpt("extract", trained, "-o", native)
    ckpt("extract", trained, "-o", spec, "--format", "speculators")
    swapped = probe_model.edited(native, root / "native-swapped", probe_model_mtp.swap_fusion_halves)
    spec_swapped = probe_model.edited(spec, root / "speculators-swapped", probe_model_mtp.swap_fusion_halves)
    drafts = {"speculators": spec, "swapped": swapped, "speculators-swapped": spec_swapped}
    args = ["probe", trained, "--prompts", prompts, "--max-new-tokens", NEW_TOKENS, "--depth", 1, "--json"]
    for d in drafts.values():
        args += ["--draft", d]
    out = json.loads(ckpt(*args).stdout)
    assert [d["name"] for d in out["drafts"]] == ["verifier", *map(str, drafts.values())]
    entries = dict(zip(["verifier", *drafts], out["drafts"], strict=True))
    for name, e in entries.items():
        print(f"{name}: agreement {e['agreement']}, kl {e['kl']}, positions {e['positions']}")
    return {"report": out, **entries}


def _numbers(entry: dict) -> tuple:
    return entry["agreement"], entry["kl"], entry["positions"], entry["greedy_equal"]


def test_the_checkpoint_has_the_release_layout(trained):
    """mtp.* in a shard of its own, the trunk in several others; the MTP count where the table reads it."""
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["mtp_num_hidden_layers"] == 1
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    shards: dict[str, set[str]] = {}
    for key, shard in json.loads((trained / "model.safetensors.index.json").read_text())["weight_map"].items():
        shards.setdefault(shard, set()).add(key)
    mtp = {s for s, keys in shards.items() if any(k.startswith("mtp.") for k in keys)}
    assert mtp == {probe_model_mtp.MTP_SHARD}
    assert all(k.startswith("mtp.") for k in shards[probe_model_mtp.MTP_SHARD])
    assert len(shards) - 1 >= 2
    keys = shards[probe_model_mtp.MTP_SHARD]
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.mlp.experts.3.down_proj.weight"} <= keys


def test_the_engine_measures_alone_and_the_trained_layer_agrees(measured):
    report, v = measured["report"], measured["verifier"]
    assert report["engine"] == "ckpt-tools table engine"
    assert set(report["reference"]) == {"skipped"} and "MtpModel" in report["reference"]["skipped"]
    assert v["greedy_equal"] is None  # transformers' generate has no MTP drafter for this family
    assert v["positions"] == PROMPTS * NEW_TOKENS
    assert v["agreement"][0] >= 0.8, v
    assert 0 <= v["kl"][0] < 0.5, v


def test_exchanged_fusion_halves_drop_agreement(measured):
    v = measured["verifier"]
    for name in ("swapped", "speculators-swapped"):
        s = measured[name]
        assert v["agreement"][0] - s["agreement"][0] >= 0.3, (name, v, s)
        assert s["kl"][0] > v["kl"][0], (name, v, s)
    assert _numbers(measured["speculators-swapped"]) == _numbers(measured["swapped"])


def test_a_speculators_draft_measures_like_the_verifiers_own_mtp(measured):
    assert _numbers(measured["speculators"]) == _numbers(measured["verifier"])
