"""`ckpt inspect --discover`: drafting a table from names alone, measured against the real tables.

For every family's fixture, discovery runs with the tables out of reach; the draft it prints is
loaded with ``load_table``, resolved against the fixture's config, and its MTP keys (with shapes
and depths) are compared with what the family's own table finds in the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from ckpt_tools.errors import InputError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.tables.loader import all_tables, load_table
from ckpt_tools.model.tables.resolve import resolve
from ckpt_tools.ops.inspect import discover as discover_mod
from ckpt_tools.ops.inspect.discover import discover, write_draft

from conftest import run_ckpt as ckpt

MTP_FAMILIES = sorted(f for f, t in all_tables().items() if t.kind == "mtp")
MIN_COVERAGE = 0.95


@pytest.fixture
def no_tables(monkeypatch):
    """Discovery must not consult any table: every way to reach one fails."""

    def refuse(*a, **k):
        raise AssertionError("discovery consulted an architecture table")

    import ckpt_tools.model.tables.loader as loader

    for name in ("all_tables", "get_table", "detect_table"):
        monkeypatch.setattr(loader, name, refuse)
        if hasattr(discover_mod, name):
            monkeypatch.setattr(discover_mod, name, refuse)


def _truth(path: Path) -> dict[str, tuple[int | None, tuple[int, ...]]]:
    view = open_mtp(Checkpoint.open(path))
    assert view.complete() and not view.extra
    return {s.key: (s.depth, tuple(s.shape)) for s in view.present if s.role != "scale"}


def _draft(path: Path, tmp_path: Path, name: str):
    found = discover(Checkpoint.open(path))
    table_path = write_draft(found, tmp_path / f"{name}.yaml")
    return found, load_table(table_path)


def _measure(table, path: Path, truth: dict) -> tuple[float, list[str], list[str], list[str]]:
    """(coverage, keys grouped into the wrong depth or with the wrong shape, keys missed, keys invented)."""
    res = resolve(table, Checkpoint.open(path).config)
    got = {s.key: (s.depth, tuple(s.shape)) for s in res.mtp_specs()}
    hits = set(truth) & set(got)
    wrong = sorted(k for k in hits if got[k] != truth[k])
    return len(hits) / len(truth), wrong, sorted(set(truth) - set(got)), sorted(set(got) - set(truth))


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_discovery_recovers_the_mtp_tensors_of_every_family(family, make_fixture, tmp_path, request):
    path = make_fixture(family)
    truth = _truth(path)  # with the tables, before they are withheld
    request.getfixturevalue("no_tables")
    found, table = _draft(path, tmp_path, f"{family}_draft")
    coverage, wrong, missed, invented = _measure(table, path, truth)
    assert coverage >= MIN_COVERAGE, (coverage, missed[:10])
    assert wrong == [], "keys grouped into the wrong depth (or with the wrong shape)"
    assert len(invented) <= (1 - MIN_COVERAGE) * len(truth), invented[:10]
    assert set(found.keys) >= set(truth) - set(missed)


@pytest.mark.parametrize(("family", "options"), [
    ("qwen3_5_moe", {"config_overrides": {"mtp_num_hidden_layers": 2}}),
    ("nemotron_h", {"config_overrides": {"num_nextn_predict_layers": 2}}),
    ("deepseek_v3", {"config_overrides": {"num_nextn_predict_layers": 2}}),
    ("glm4_moe", {"with_optional": False}),
    ("deepseek_v4", {"expert_layout": "fused"}),
    ("qwen3_next", {"expert_layout": "fused-transposed"}),
    ("qwen3_next", {"expert_layout": "stacked-transposed"}),
    ("deepseek_v3", {"expert_layout": "stacked"}),
    ("nemotron_h", {"expert_layout": "stacked-transposed"}),  # non-gated: up and down only
])
def test_discovery_groups_depths_sub_layers_and_expert_layouts(family, options, make_fixture, tmp_path):
    path = make_fixture(family, **options)
    found, table = _draft(path, tmp_path, "probe")
    coverage, wrong, missed, invented = _measure(table, path, _truth(path))
    assert (coverage, wrong, missed, invented) == (1.0, [], [], [])
    depths = {d for d in found.depth_of.values() if d is not None}
    assert len(depths) == resolve(table, Checkpoint.open(path).config).mtp_count
    if "expert_layout" in options:  # the stored layout is recognised as an expert group, not as loose tensors
        groups = [item.experts for items in table.parts.values() for item in items if item.experts is not None]
        assert groups and {g.layout for g in groups} == {options["expert_layout"]}


def test_nemotron_sub_layers_become_sub_blocks_with_glue_on_first_and_last(make_fixture, tmp_path):
    found, table = _draft(make_fixture("nemotron_h"), tmp_path, "probe")
    assert found.sub_blocks == 2
    assert table.mtp.prefix == "mtp.layers.{i * 2}."
    assert [b.prefix for b in table.mtp.blocks] == ["/mtp.layers.{i * 2}.", "/mtp.layers.{i * 2 + 1}."]
    assert table.mtp.glue["final_norm"].key == "/mtp.layers.{i * 2 + 1}.final_layernorm.weight"
    assert {table.mtp.glue[r].key for r in ("embed_norm", "hidden_norm", "fusion")} == {
        "enorm.weight", "hnorm.weight", "eh_proj.weight"}
    (experts,) = [it.experts for items in table.parts.values() for it in items if it.experts]
    assert (experts.prefix, experts.gated, experts.layout) == ("mixer.experts", False, "per-expert")


@pytest.mark.parametrize(("family", "roles"), [
    ("deepseek_v3", {"embed_norm": "enorm.weight", "hidden_norm": "hnorm.weight", "fusion": "eh_proj.weight",
                     "final_norm": "shared_head.norm.weight", "embed": "embed_tokens.weight",
                     "head": "shared_head.head.weight"}),
    ("qwen3_next", {"embed_norm": "/mtp.pre_fc_norm_embedding.weight", "hidden_norm": "/mtp.pre_fc_norm_hidden.weight",
                    "fusion": "/mtp.fc.weight", "final_norm": "/mtp.norm.weight"}),
    ("mimo", {"embed_norm": "token_layernorm.weight", "hidden_norm": "hidden_layernorm.weight",
              "fusion": "input_proj.weight", "final_norm": "final_layernorm.weight"}),
    ("deepseek_v4", {"embed_norm": "enorm.weight", "hidden_norm": "hnorm.weight", "fusion_embed": "e_proj.weight",
                     "fusion_hidden": "h_proj.weight", "final_norm": "norm.weight", "embed": "emb.tok_emb.weight",
                     "head": "head.weight"}),
    ("inkling", {"embed_norm": "embed_norm.weight", "hidden_norm": "hidden_norm.weight", "fusion": "input_proj.weight",
                 "final_norm": "/model.mtp.chain_norm.weight"}),
])
def test_glue_names_become_roles(family, roles, make_fixture, tmp_path):
    _, table = _draft(make_fixture(family), tmp_path, "probe")
    assert {r: t.key for r, t in table.mtp.glue.items()} == roles


def test_norm_convention_is_read_from_a_norm_tensor(make_fixture, tmp_path):
    assert _draft(make_fixture("qwen3_next"), tmp_path, "a")[1].norm == "zero_centred"
    assert _draft(make_fixture("deepseek_v3"), tmp_path, "b")[1].norm == "plain"


def test_fp8_scales_make_a_quantization_block(make_fixture, tmp_path):
    path = make_fixture("deepseek_v3", fp8=True)
    found, table = _draft(path, tmp_path, "probe")
    assert any(k.endswith("weight_scale_inv") for k in found.keys)
    assert table.quantization == "fp8-block"  # the scheme table whose block format the scales are in
    view = open_mtp(Checkpoint.open(path), table)
    assert view.complete() and not view.extra and not view.beyond
    assert set(view.keys()) == set(open_mtp(Checkpoint.open(path)).keys())


# --------------------------------------------------------------------------- the command


def _unknown_family(make_fixture, tmp_path: Path) -> Path:
    """A copy of a fixture whose config names an architecture no table knows."""
    src = tmp_path / "unknown"
    shutil.copytree(make_fixture("glm4_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["ZetaMoeForCausalLM"], model_type="zeta_moe")
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_unknown_family_then_discover_then_use_the_draft(make_fixture, tmp_path, monkeypatch):
    src = _unknown_family(make_fixture, tmp_path)
    r = ckpt("inspect", src, code=3)
    assert "--discover" in r.output + (r.stderr if r.stderr_bytes is not None else "")
    printed = ckpt("inspect", src, "--discover").stdout
    assert yaml.safe_load(printed)["family"] == "zeta_moe_discovered"
    tables = tmp_path / "tables"
    ckpt("inspect", src, "--discover", "--write", tables / "zeta_moe.yaml")
    table = load_table(tables / "zeta_moe.yaml")
    assert table.family == "zeta_moe" and table.detect.model_types == ["zeta_moe"]
    monkeypatch.setenv("CKPT_TABLES", str(tables))
    report = json.loads(ckpt("inspect", src, "--json").stdout)
    assert report["family"] == "zeta_moe" and report["status"]["complete"]
    assert report["mtp_layers"] == 1 and report["status"]["extra"] == []
    out = tmp_path / "draft"
    ckpt("extract", src, "-o", out)
    ckpt("validate", out)


def test_discover_json_and_usage_errors(make_fixture, tmp_path):
    path = make_fixture("mimo")
    data = json.loads(ckpt("inspect", path, "--discover", "--json").stdout)
    assert data["mtp_tensors"] == 16 and data["depths"] == [0] and data["mtp_count_key"] == "num_nextn_predict_layers"
    assert yaml.safe_load(data["yaml"])["mtp"]["prefix"] == "model.mtp_layers.{i}."
    ckpt("inspect", path, "--discover", "--write", tmp_path / "table.txt", code=2)
    ckpt("inspect", path, "--discover", "--write", tmp_path / "bad-name.yaml", code=2)


def test_no_mtp_tensors_is_an_input_error(make_fixture, tmp_path):
    trunk = make_fixture("deepseek_v3", drop_mtp=True)
    with pytest.raises(InputError) as ei:
        discover(Checkpoint.open(trunk))
    assert ei.value.rule == "no-mtp"
    ckpt("inspect", trunk, "--discover", code=3)
