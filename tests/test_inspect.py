"""`ckpt inspect` on every family's fixture, its numbers recomputed independently in the test.

The oracle reads the shard headers with ``safetensors.safe_open`` and picks the MTP
tensors with prefix rules written here (not through ckpt_tools.model.mtp or the tables), and,
for every family, as the keys a fixture has beyond the same fixture built without MTP.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.errors import EXIT_INPUT, EXIT_USAGE
from ckpt_tools.model.expert_layouts import scale_key
from ckpt_tools.model.tables.loader import all_tables, get_table
from ckpt_tools.ops.inspect import inspect_checkpoint

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
            "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
            "F64": 8, "I64": 8, "U64": 8, "C64": 8}


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def appended_layers(cfg: dict):
    """DeepSeek-style: MTP layer i is model.layers.{num_hidden_layers + i}."""
    n = _text(cfg)["num_hidden_layers"]
    k = _text(cfg).get("num_nextn_predict_layers", 0)
    pat = re.compile(r"^model\.layers\.(\d+)\.")

    def is_mtp(key: str) -> bool:
        m = pat.match(key)
        return bool(m) and n <= int(m.group(1)) < n + k

    return is_mtp


def top_level_mtp(cfg: dict):
    """Qwen-Next style: everything under the top-level mtp. namespace."""
    return lambda key: key.startswith("mtp.")


# Families whose on-disk MTP namespace we know from their releases (mtp-layouts.md section 1.1).
PREFIX_RULES = {
    "deepseek_v3": appended_layers,
    "deepseek_v32": appended_layers,
    "glm4_moe": appended_layers,
    "glm4_moe_lite": appended_layers,
    "step3p5": appended_layers,
    "hy_v3": appended_layers,
    "mimo": lambda cfg: lambda key: key.startswith("model.mtp_layers."),
    "qwen3_next": top_level_mtp,
    "qwen3_5": top_level_mtp,
    "qwen3_5_moe": top_level_mtp,
}

FAMILIES = sorted(all_tables())
CASES = [(f, False) for f in FAMILIES] + [(f, True) for f in FAMILIES if all_tables()[f].quantization is not None]


def read_all(d: Path) -> dict[str, dict]:
    """key -> {dtype, shape, params, bytes, shard}, straight from every shard's header."""
    out: dict[str, dict] = {}
    for p in sorted(d.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = f.get_slice(k)
                shape = sl.get_shape()
                numel = 1
                for s in shape:
                    numel *= s
                dtype = sl.get_dtype()
                assert k not in out
                out[k] = {"dtype": dtype, "shape": shape, "params": numel, "bytes": numel * ITEMSIZE[dtype],
                          "shard": p.name}
    return out


def totals(entries) -> dict:
    entries = list(entries)
    return {"tensors": len(entries), "params": sum(e["params"] for e in entries),
            "bytes": sum(e["bytes"] for e in entries), "shards": len({e["shard"] for e in entries})}


@pytest.mark.parametrize(("family", "fp8"), CASES, ids=[f"{f}{'-fp8' if q else ''}" for f, q in CASES])
def test_inspect_numbers_match_an_independent_count(make_fixture, family, fp8):
    d = make_fixture(family, fp8=fp8)
    trunk = make_fixture(family, fp8=fp8, drop_mtp=True)
    cfg = json.loads((d / "config.json").read_text())
    tensors = read_all(d)
    mtp_keys = set(tensors) - set(read_all(trunk))  # what the fixture wrote for MTP, whatever the family
    rule = PREFIX_RULES.get(family)
    if rule is not None:
        assert {k for k in tensors if rule(cfg)(k)} == mtp_keys

    report = inspect_checkpoint(d)
    j = report.to_json()
    assert j["family"] == family and j["table_source"] == "detected"
    assert j["totals"]["checkpoint"] == totals(tensors.values())
    expected = totals(tensors[k] for k in mtp_keys)
    assert j["totals"]["mtp"] == expected
    assert {t["key"] for t in j["tensors"]} == mtp_keys
    for t in j["tensors"]:
        e = tensors[t["key"]]
        assert (t["dtype"], t["shape"], t["params"], t["bytes"], t["shard"]) == (
            e["dtype"], e["shape"], e["params"], e["bytes"], e["shard"])
    # the groupings partition the MTP set exactly
    for part in ("roles",):
        assert sum(r["bytes"] for r in j[part].values()) == expected["bytes"]
        assert sorted(k for r in j[part].values() for k in r["keys"]) == sorted(mtp_keys)
    assert sum(layer["bytes"] for layer in j["layers"]) == expected["bytes"]
    shards = {}
    for k in mtp_keys:
        shards.setdefault(tensors[k]["shard"], []).append(tensors[k]["bytes"])
    assert {s["name"]: (s["mtp_tensors"], s["mtp_bytes"]) for s in j["shards"]} == {
        n: (len(b), sum(b)) for n, b in shards.items()}
    by_dtype: dict[str, int] = {}
    for k in mtp_keys:
        by_dtype[tensors[k]["dtype"]] = by_dtype.get(tensors[k]["dtype"], 0) + tensors[k]["bytes"]
    assert {dt: v["bytes"] for dt, v in j["dtypes"]["mtp"].items()} == by_dtype
    fp8_weights = {k for k in mtp_keys if tensors[k]["dtype"] in ("F8_E4M3", "F8_E5M2")}
    assert j["fp8"]["weights"] == len(fp8_weights)
    # the family's scale suffix (weight_scale_inv; DeepSeek-V4's release names them `.scale`)
    q = get_table(family).quantization
    suffix = q.scale_suffix if q else "weight_scale_inv"
    assert j["fp8"]["scales"] == sum(1 for k in mtp_keys if k.endswith("." + suffix) or k.endswith("_scale_inv"))
    if not fp8:
        assert not fp8_weights
    for k in fp8_weights:  # each FP8 weight brings its block-scale companion into the MTP set
        assert scale_key(k, suffix) in mtp_keys
    assert sum(g["bytes"] for g in j["experts"]) == j["roles"].get("experts", {"bytes": 0})["bytes"]
    assert j["status"]["complete"] and not j["status"]["extra"] and not j["status"]["beyond"]
    assert j["mtp_layers"] == len(j["layers"]) - (1 if j["layers"] and j["layers"][-1]["depth"] is None else 0)

    # the CLI prints the same JSON, and a human view with the exact byte counts
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", str(d), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(json.dumps(j))
    human = runner.invoke(app, ["inspect", str(d)], env={"COLUMNS": "200"})
    assert human.exit_code == 0, human.output
    assert family in human.output and f"{expected['bytes']:,}" in human.output
    assert "Traceback" not in human.output


def test_inspect_deepseek_roles_and_experts(make_fixture):
    """Spot values for DeepSeek-V3 FP8, worked out by hand from its fixture config."""
    d = make_fixture("deepseek_v3", fp8=True)
    j = inspect_checkpoint(d).to_json()
    H, V, E, I = 64, 256, 4, 32  # noqa: E741 - the usual names
    assert j["mtp_layers"] == 1 and j["count_field"] == "num_nextn_predict_layers"
    roles = j["roles"]
    assert roles["embed_norm"]["keys"] == ["model.layers.3.enorm.weight"]
    assert roles["hidden_norm"]["keys"] == ["model.layers.3.hnorm.weight"]
    assert roles["fusion"]["bytes"] == H * 2 * H * 2  # BF16 eh_proj [H, 2H]
    assert roles["embed"]["bytes"] == roles["head"]["bytes"] == V * H * 2
    assert roles["experts"]["tensors"] == 3 * E and roles["experts"]["bytes"] == 3 * E * I * H  # FP8: 1 byte
    (g,) = j["experts"]
    assert (g["prefix"], g["count"], g["hidden"], g["inter"], g["layout"]) == (
        "model.layers.3.mlp.experts", E, H, I, "per-expert")
    # every FP8 weight's companion is listed under fp8_scales
    scales = set(roles["fp8_scales"]["keys"])
    assert {t["scale"] for t in j["tensors"] if "scale" in t} == scales
    assert j["quantization"]["quant_method"] == "fp8"


def test_inspect_trunk_only_checkpoint(make_fixture):
    d = make_fixture("deepseek_v3", drop_mtp=True)
    j = inspect_checkpoint(d).to_json()
    assert j["mtp_layers"] == 0 and j["totals"]["mtp"]["tensors"] == 0 and j["totals"]["mtp"]["bytes"] == 0
    assert j["totals"]["checkpoint"]["tensors"] > 0 and j["status"]["complete"]


def test_inspect_with_arch_override_and_unknown_family(make_fixture, tmp_path):
    d = make_fixture("deepseek_v3")
    j = inspect_checkpoint(d, arch="deepseek_v3").to_json()
    assert j["table_source"] == "arch"
    runner = CliRunner()
    bad = runner.invoke(app, ["inspect", str(d), "--arch", "no_such_family"])
    assert bad.exit_code == EXIT_USAGE and "unknown-family" in bad.output and "deepseek_v3" in bad.output
    assert "Traceback" not in bad.output
    cfg = json.loads((d / "config.json").read_text())
    copy = tmp_path / "unknown"
    copy.mkdir()
    for p in d.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    cfg.update(architectures=["FooForCausalLM"], model_type="foo")
    (copy / "config.json").write_text(json.dumps(cfg))
    res = runner.invoke(app, ["inspect", str(copy)])
    assert res.exit_code == EXIT_INPUT and "unknown-family" in res.output and "deepseek_v3" in res.output
    assert "Traceback" not in res.output
    assert runner.invoke(app, ["inspect", str(copy), "--arch", "deepseek_v3", "--json"]).exit_code == 0
