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


def test_probe_measures_the_trained_layer_its_swapped_fusion_and_its_speculators_round_trip(trained, tmp_path):
    """One probe run (one test: under pytest-xdist a fixture shared by several tests would run once per worker):
    the verifier's own MTP; its speculators draft; the native and the speculators draft, each with the fusion
    halves exchanged."""
    from safetensors import safe_open

    prompts = probe_model.write_prompts(tmp_path, PROMPTS, 6, seed=7)
    native, spec = tmp_path / "native", tmp_path / "speculators"
    ckpt("extract", trained, "-o", native)
    ckpt("extract", trained, "-o", spec, "--format", "speculators")
    assert json.loads((spec / "config.json").read_text())["speculators_model_type"] == "mtp"
    with safe_open(str(spec / "model.safetensors"), "pt") as f:  # its own names and fused experts: a real conversion
        assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.mlp.experts.gate_up_proj"} <= set(f.keys())
    swapped = probe_model.edited(native, tmp_path / "native-swapped", probe_model_mtp.swap_fusion_halves)
    spec_swapped = probe_model.edited(spec, tmp_path / "speculators-swapped", probe_model_mtp.swap_fusion_halves)
    drafts = {"speculators": spec, "swapped": swapped, "speculators-swapped": spec_swapped}
    args = ["probe", trained, "--prompts", prompts, "--max-new-tokens", NEW_TOKENS, "--depth", 1, "--json"]
    for d in drafts.values():
        args += ["--draft", d]
    report = json.loads(ckpt(*args).stdout)
    assert [d["name"] for d in report["drafts"]] == ["verifier", *map(str, drafts.values())]
    m = dict(zip(["verifier", *drafts], report["drafts"], strict=True))
    for name, e in m.items():
        print(f"{name}: agreement {e['agreement']}, kl {e['kl']}, positions {e['positions']}")

    # the engine measures alone: transformers' MtpModel builds no Qwen3-Next MTP, generate has no drafter for it
    v = m["verifier"]
    assert report["engine"]["mtp"] == "ckpt-tools table engine"
    assert set(report["reference"]) == {"skipped"} and "MtpModel" in report["reference"]["skipped"]
    assert v["greedy_equal"] is None
    assert v["positions"] == PROMPTS * NEW_TOKENS
    # the trained layer agrees
    assert v["agreement"][0] >= 0.8, v
    assert 0 <= v["kl"][0] < 0.5, v
    # exchanged fusion halves drop agreement, in either draft format alike
    for name in ("swapped", "speculators-swapped"):
        s = m[name]
        assert v["agreement"][0] - s["agreement"][0] >= 0.3, (name, v, s)
        assert s["kl"][0] > v["kl"][0], (name, v, s)
    assert _numbers(m["speculators-swapped"]) == _numbers(m["swapped"])
    # the round trip through speculators' format measures exactly like the verifier's own MTP
    assert _numbers(m["speculators"]) == _numbers(v)
