"""`ckpt diff` covers config.json and the side files, not only tensors (issue 24 item 5), and never refuses a
checkpoint it can read (deliverable 4).

The graft case diffs graft's real output against its input (a compressed-tensors trunk whose quantizer
dropped MTP and zeroed the count): the ignore entries graft added and the MTP count it restored are
reported, in the human output and in --json, and make exit 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpt_tools.ops.diff.json_diff import describe, json_diff
from ckpt_tools.testing import FixtureOptions, make_checkpoint

from conftest import run_ckpt


def _diff_json(a: Path, b: Path, code: int = 1, *extra: str) -> dict:
    return json.loads(run_ckpt("diff", a, b, "--json", *extra, code=code).output)


def _text(a: Path, b: Path, code: int = 1) -> str:
    return " ".join(run_ckpt("diff", a, b, code=code).output.split())


def test_diff_reports_the_config_changes_graft_made(tmp_path):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors comes with the test extra")
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    family = "deepseek_v3"
    src = make_checkpoint(family, tmp_path / "src", FixtureOptions(expert_layout="per-expert"))
    target = make_quantized_checkpoint(family, tmp_path / "target",
                                       QuantOptions("ct-fp8-block", mtp="dropped", mtp_count="zero"))
    out = tmp_path / "out"
    run_ckpt("graft", src, target, "-o", out)
    before = json.loads((target / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    added = [e for e in after["quantization_config"]["ignore"] if e not in before["quantization_config"]["ignore"]]
    assert added and before["num_nextn_predict_layers"] == 0 and after["num_nextn_predict_layers"] == 1

    rep = _diff_json(target, out)
    assert not rep["identical"]
    changes = {c["path"]: c for c in rep["config"]["changes"]}
    assert rep["config"]["status"] == "changed"
    assert changes["num_nextn_predict_layers"] == {"path": "num_nextn_predict_layers", "change": "changed",
                                                   "a": 0, "b": 1}
    ignore = changes["quantization_config.ignore"]
    assert (ignore["change"], ignore["added"], ignore["removed"]) == ("entries", added, [])
    assert {t["status"] for t in rep["tensors"]} == {"added"}  # the MTP tensors; the trunk is byte-identical
    own = {f["name"]: f for f in rep["files"] if f.get("counted") is False}
    assert own["ckpt_manifest.json"]["status"] == "added" and "graft-report.json" in own

    text = _text(target, out)
    assert f"quantization_config.ignore[+{len(added)} entries]" in text, text
    assert "num_nextn_predict_layers: 0 -> 1" in text
    assert "not compared: ckpt_manifest.json" in text
    back = _diff_json(out, target)  # the other way round: the entries are removed, the count drops
    changes = {c["path"]: c for c in back["config"]["changes"]}
    assert changes["quantization_config.ignore"]["removed"] == added
    assert (changes["num_nextn_predict_layers"]["a"], changes["num_nextn_predict_layers"]["b"]) == (1, 0)


@pytest.fixture
def pair(make_fixture, tmp_path) -> tuple[Path, Path]:
    a = make_fixture("deepseek_v3")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    return a, b


def test_side_files_added_removed_and_changed(pair):
    a, b = pair
    side = sorted(p.name for p in a.iterdir() if p.suffix != ".safetensors" and p.name not in
                  ("config.json", "model.safetensors.index.json"))
    assert "generation_config.json" in side and len(side) >= 2, side
    gen = json.loads((b / "generation_config.json").read_text())
    gen["temperature"] = 0.25
    (b / "generation_config.json").write_text(json.dumps(gen))
    (b / "chat_template.jinja").write_text("{{ messages }}")
    gone = next(n for n in side if n != "generation_config.json")
    (b / gone).unlink()

    rep = _diff_json(a, b)
    files = {f["name"]: f for f in rep["files"]}
    assert files["chat_template.jinja"]["status"] == "added" and files[gone]["status"] == "removed"
    g = files["generation_config.json"]
    assert g["status"] == "changed" and g["sha256_a"] != g["sha256_b"]
    was = json.loads((a / "generation_config.json").read_text()).get("temperature")
    want = {"change": "added", "b": 0.25} if was is None else {"change": "changed", "a": was, "b": 0.25}
    assert g["changes"] == [{"path": "temperature", **want}]
    assert rep["tensors"] == [] and rep["config"]["status"] == "unchanged"
    text = _text(a, b)
    assert "added chat_template.jinja" in text and f"removed {gone}" in text
    assert "changed generation_config.json" in text and "temperature" in text


def test_a_config_change_alone_makes_exit_1_and_whitespace_does_not(pair):
    a, b = pair
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(cfg, indent=7, sort_keys=True))  # same JSON, written otherwise
    assert _diff_json(a, b, code=0)["identical"]
    cfg["rope_theta"] = 1.5
    cfg.pop("num_nextn_predict_layers")
    (b / "config.json").write_text(json.dumps(cfg))
    rep = _diff_json(a, b)
    paths = {c["path"]: c["change"] for c in rep["config"]["changes"]}
    assert paths["num_nextn_predict_layers"] == "removed" and paths["rope_theta"] in ("changed", "added")
    assert "num_nextn_predict_layers: removed (was 1)" in _text(a, b)


def test_our_own_records_are_listed_not_counted(make_fixture, tmp_path):
    """The same output, its copy's manifest recording another command line (as another run's does): listed as
    changed, not counted, so the outputs are identical."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_ckpt("extract", make_fixture("deepseek_v3"), "-o", one)
    shutil.copytree(one, two)
    manifest = json.loads((two / "ckpt_manifest.json").read_text())
    manifest["command"] = "ckpt extract SOMEWHERE-ELSE -o two"
    (two / "ckpt_manifest.json").write_text(json.dumps(manifest))
    rep = _diff_json(one, two, 0)
    assert rep["identical"]
    rep = _diff_json(one, two, 0, "--all")
    entry = [f for f in rep["files"] if f["name"] == "ckpt_manifest.json"][0]
    assert (entry["status"], entry["counted"]) == ("changed", False)
    assert "not compared: ckpt_manifest.json (changed;" in _text(one, two, 0)


# -- deliverable 4: diff never refuses a readable checkpoint --------------------------------------------------


def test_diff_compares_a_side_without_mtp(make_fixture):
    a, b = make_fixture("deepseek_v3"), make_fixture("deepseek_v3", drop_mtp=True)
    rep = _diff_json(a, b)
    assert {t["status"] for t in rep["tensors"]} == {"removed"}
    assert all(t["key"].startswith("model.layers.3.") for t in rep["tensors"])
    assert {"path": "num_nextn_predict_layers", "change": "changed", "a": 1, "b": 0} in rep["config"]["changes"]


def test_diff_compares_a_side_of_unknown_family(pair):
    a, b = pair
    cfg = json.loads((b / "config.json").read_text())
    cfg.update(model_type="no_such_family", architectures=["NoSuchForCausalLM"])
    (b / "config.json").write_text(json.dumps(cfg))
    rep = _diff_json(a, b)
    assert rep["tensors"] == [] and {c["path"] for c in rep["config"]["changes"]} == {"model_type", "architectures"}
    assert run_ckpt("validate", b, code=None).exit_code != 0  # the table cannot be told: validate says so


# -- the JSON diff itself --------------------------------------------------------------------------------------


def test_json_diff_paths_and_lines():
    a = {"n": 1, "q": {"ignore": ["x", "y"], "g": [{"t": 1}]}, "arch": ["A", "B"], "flag": True, "dot.key": 1}
    b = {"n": 0, "q": {"ignore": ["x", "y", "z1", "z2"], "g": [{"t": 2}]}, "arch": ["B", "A"], "flag": 1,
         "dot.key": 1, "new": {"k": 1}}
    got = json_diff(a, b)
    assert got == [
        {"path": "n", "change": "changed", "a": 1, "b": 0},
        {"path": "q.ignore", "change": "entries", "added": ["z1", "z2"], "removed": []},
        {"path": "q.g[0].t", "change": "changed", "a": 1, "b": 2},
        {"path": "arch", "change": "reordered"},
        {"path": "flag", "change": "changed", "a": True, "b": 1},  # true is not 1 in a config
        {"path": "new", "change": "added", "b": {"k": 1}},
    ]
    assert [describe(d) for d in got][:2] == ["n: 1 -> 0", 'q.ignore[+2 entries]: +"z1", +"z2"']
    assert json_diff({"a.b": 1}, {"a.b": 2})[0]["path"] == '["a.b"]'
    assert json_diff(a, json.loads(json.dumps(a))) == []
