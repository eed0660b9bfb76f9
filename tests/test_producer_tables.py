"""Table facts the real producers' corpus exposed (issue 24), checked on the committed checkpoints that
transformers 5.24 save_pretrained wrote (fixtures/producers/transformers-<family>/), not on checkpoints
generated from our own tables."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import run_ckpt as ckpt

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
QWEN3_NEXT = CORPUS / "transformers-qwen3_next"
STEP = CORPUS / "transformers-step3p7"


def _keys(path: Path) -> set[str]:
    out: set[str] = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            out |= set(f.keys())
    return out


def _copy_with_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# -- qwen3_next: layer_types (what transformers writes) before full_attention_interval (the release) ------


def test_qwen3_next_reads_layer_types_transformers_writes(tmp_path):
    cfg = json.loads((QWEN3_NEXT / "config.json").read_text())
    assert "full_attention_interval" not in cfg and cfg["layer_types"][2] == "full_attention"
    js = json.loads(ckpt("inspect", QWEN3_NEXT, "--json").stdout)
    assert js["family"] == "qwen3_next"
    out = ckpt("validate", QWEN3_NEXT).stdout
    assert out.startswith("valid:"), out
    ckpt("extract", QWEN3_NEXT, "-o", tmp_path / "draft")
    stored = {k for k in _keys(QWEN3_NEXT) if k.startswith("mtp.")}
    assert stored and stored == _keys(tmp_path / "draft") - {"lm_head.weight", "model.embed_tokens.weight"} or \
        stored <= _keys(tmp_path / "draft")


def test_qwen3_next_full_attention_interval_still_read_without_layer_types(tmp_path):
    # the release config.json carries full_attention_interval (every 4th layer full); this checkpoint's
    # layer 2 is full attention, so interval 3 describes it and interval 4 (the default) does not
    def interval(n):
        def edit(cfg):
            del cfg["layer_types"]
            if n is not None:
                cfg["full_attention_interval"] = n
        return edit

    ok = _copy_with_config(QWEN3_NEXT, tmp_path / "i3", interval(3))
    assert ckpt("validate", ok).stdout.startswith("valid:")
    bad = _copy_with_config(QWEN3_NEXT, tmp_path / "i4", interval(None))
    r = ckpt("validate", bad, code=1)
    assert "trunk-missing" in r.output and "model.layers.2.linear_attn" in r.output


def test_qwen3_next_layer_types_wins_over_interval(tmp_path):
    def edit(cfg):
        cfg["full_attention_interval"] = 4  # would make layer 2 linear attention
    p = _copy_with_config(QWEN3_NEXT, tmp_path / "both", edit)
    assert ckpt("validate", p).stdout.startswith("valid:")


# -- step3p5: per-depth lists with one entry per declared depth ------------------------------------------


def test_step3p7_per_depth_lists_with_exactly_one_entry_per_depth_resolve(tmp_path):
    text = json.loads((STEP / "config.json").read_text())["text_config"]
    assert len(text["mtp_layer_types"]) == text["num_nextn_predict_layers"] == 2
    for verb in ("inspect", "validate"):
        r = ckpt(verb, STEP, code=None)
        assert "config-field" not in r.output and "list index out of range" not in r.output, r.output


def test_step3p7_list_shorter_than_a_declared_depth_is_a_config_field_error(tmp_path):
    def edit(cfg):
        cfg["text_config"]["mtp_layer_types"] = ["full_attention"]  # two depths declared
    p = _copy_with_config(STEP, tmp_path / "short", edit)
    for verb, code in (("validate", 1), ("inspect", 3)):
        r = ckpt(verb, p, code=code)
        assert "config-field" in r.output and "mtp_layer_types" in r.output and "depth 1" in r.output, r.output
    r = ckpt("extract", p, "-o", tmp_path / "x", code=3)
    assert "mtp_layer_types" in r.output


def test_step3p7_mtp_past_the_declared_count_still_found(tmp_path):
    # one depth declared, lists for one depth: depth 1's tensors (model.layers.3.*) lie past the count,
    # and the probe for them must not need list entries the config does not have
    def edit(cfg):
        t = cfg["text_config"]
        t["num_nextn_predict_layers"] = 1
        t["mtp_layer_types"] = t["mtp_layer_types"][:1]
        t["mtp_mlp_layer_types"] = t["mtp_mlp_layer_types"][:1]
    p = _copy_with_config(STEP, tmp_path / "one", edit)
    from ckpt_tools.io.checkpoint import Checkpoint
    from ckpt_tools.model.mtp import open_mtp

    view = open_mtp(Checkpoint.open(p))
    assert view.count == 1
    assert {k for k in view.beyond} == {k for k in _keys(p) if k.startswith("model.layers.3.")}


@pytest.mark.parametrize("key", ["shared_head.norm.weight", "shared_head.output.weight"])
def test_step3p7_head_names_follow_the_release(key):
    # the release (Step-3.5-Flash) stores model.layers.{45+i}.transformer.shared_head.*, and so does the
    # producer script: the table finds them (validate ok), and a copy without the segment is no such tensor
    keys = _keys(STEP)
    assert f"model.layers.2.transformer.{key}" in keys and f"model.layers.2.{key}" not in keys
    assert ckpt("validate", STEP).stdout.startswith("valid:")
