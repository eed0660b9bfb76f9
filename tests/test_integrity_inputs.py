"""Issue 14, inputs: inconsistent checkpoints are refused by one consistency gate before anything is written.

Every case builds its own inconsistent input from a pristine fixture (a copy), then checks the
refusal: exit code, the rule and the file or key in the one-line message, no traceback (run_ckpt),
and no output directory left behind. ``--allow-invalid RULE`` lets a user through, and the output
then validates (or carries exactly what was allowed, recorded in its manifest).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ckpt_tools.errors import InputError, TableError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.consistency import RULES
from ckpt_tools.model.gate import check, require_consistent
from ckpt_tools.ops.check.validate import validate

from conftest import run_ckpt, tree_hash

INDEX = "model.safetensors.index.json"


def copy_of(make_fixture, tmp_path: Path, name: str = "v", family: str = "deepseek_v3", **kw) -> Path:
    d = tmp_path / name
    shutil.copytree(make_fixture(family, **kw), d)
    return d


def edit_json(p: Path, fn) -> None:
    data = json.loads(p.read_text())
    data = fn(data) or data
    p.write_text(json.dumps(data))


def shard_of(d: Path, key: str) -> str:
    return json.loads((d / INDEX).read_text())["weight_map"][key]


def message(result) -> str:
    return " ".join((result.output + (result.stderr if result.stderr_bytes is not None else "")).split())


def refused(*args, rule: str, code: int = 3, out: Path | None = None, names: tuple[str, ...] = ()) -> str:
    """Run a command that must be refused: exit code, [rule], the names given, no output directory."""
    r = run_ckpt(*args, code=code)
    msg = message(r)
    assert f"[{rule}]" in msg, msg
    for name in names:
        assert name in msg, (name, msg)
    if out is not None:
        assert not out.exists() or not any(out.iterdir()), f"refusal left files in {out}"
    return msg


@pytest.fixture(scope="module")
def draft(tmp_path_factory, make_fixture) -> Path:
    """A native draft extracted from the pristine DeepSeek-V3 fixture (stitched into broken verifiers below)."""
    out = tmp_path_factory.mktemp("draft") / "d"
    run_ckpt("extract", make_fixture("deepseek_v3"), "-o", out)
    return out


# -- index vs files (seen 5, 15) ---------------------------------------------------------------


def test_shard_left_out_of_the_index_is_refused_by_every_verb(make_fixture, draft, tmp_path):
    v = copy_of(make_fixture, tmp_path)
    left = shard_of(v, "lm_head.weight")
    edit_json(v / INDEX, lambda ix: {**ix, "weight_map": {k: s for k, s in ix["weight_map"].items() if s != left}})
    before = tree_hash(v)
    rep = validate(v)
    assert "unindexed-shard" in rep.rules() and "trunk-missing" in rep.rules()
    hit = next(p for p in rep.problems if p.rule == "unindexed-shard")
    assert hit.path.endswith(left) and "lm_head.weight" in hit.message
    out = tmp_path / "o"
    msg = refused("stitch", draft, v, "-o", out, rule="unindexed-shard", out=out, names=(left, "lm_head.weight"))
    assert "ckpt validate" in msg and "--allow-invalid unindexed-shard" in msg and "trunk-missing" in msg
    refused("extract", v, "-o", out, "--drop-mtp", rule="unindexed-shard", out=out, names=(left,))
    # diff is read-only: it reports the left-out shard as a problem (exit 1, never "identical"), not a refusal
    msg = message(run_ckpt("diff", make_fixture("deepseek_v3"), v, code=1))
    assert "problem (b):" in msg and "[unindexed-shard]" in msg and left in msg, msg
    shown_by_inspect(v, "unindexed-shard", (left, "lm_head.weight"))
    assert tree_hash(v) == before


def shown_by_inspect(path, rule: str, names: tuple[str, ...] = ()) -> None:
    """inspect, the diagnostic, reads what the other verbs refuse: exit 0, the problem among its findings."""
    found = [f for f in json.loads(run_ckpt("inspect", path, "--json").stdout)["findings"] if f["rule"] == rule]
    assert found, f"no {rule} finding"
    text = " ".join(run_ckpt("inspect", path).stdout.split())
    assert rule in text and all(n in text for n in names), text


def test_empty_weight_map_is_refused_and_writes_nothing(make_fixture, draft, tmp_path):
    v = copy_of(make_fixture, tmp_path)
    edit_json(v / INDEX, lambda ix: {**ix, "weight_map": {}})
    assert "index-empty" in validate(v).rules()
    out = tmp_path / "o"
    refused("stitch", draft, v, "-o", out, rule="index-empty", out=out, names=(INDEX,))  # was add mode, exit 0
    refused("extract", v, "-o", out, "--drop-mtp", rule="index-empty", out=out)
    refused("fuse-experts", v, "-o", out, rule="index-empty", out=out)


def test_key_in_a_shard_but_not_in_the_index(make_fixture, draft, tmp_path):
    """Seen 15: such keys were dropped from rewritten shards without a word."""
    v = copy_of(make_fixture, tmp_path)
    name = shard_of(v, "model.layers.3.eh_proj.weight")  # a shard stitch rewrites
    tensors = load_file(v / name)
    tensors["model.rotary_emb.inv_freq"] = tensors["model.layers.3.enorm.weight"].float()  # not a table tensor
    save_file(tensors, v / name, metadata={"format": "pt"})
    out = tmp_path / "o"
    refused("stitch", draft, v, "-o", out, rule="unindexed-key", out=out, names=("model.rotary_emb.inv_freq", name))
    refused("extract", v, "-o", out, "--drop-mtp", rule="unindexed-key", out=out)
    # allowed: the output is what loaders see (the key is not carried), it validates, and says what it let in
    r = run_ckpt("stitch", draft, v, "-o", out, "--allow-invalid", "unindexed-key", "--json")
    assert "allowed by --allow-invalid (unindexed-key)" in message(r)
    assert validate(out).ok
    assert "model.rotary_emb.inv_freq" not in Checkpoint.open(out).tensors
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    assert [p["rule"] for p in manifest["allowed_invalid"]] == ["unindexed-key"]


def test_stale_duplicate_beside_the_index_can_be_allowed(make_fixture, tmp_path):
    v = copy_of(make_fixture, tmp_path)
    key = "model.layers.3.enorm.weight"
    save_file({key: load_file(v / shard_of(v, key))[key]}, v / "old-mtp.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o"
    refused("extract", v, "-o", out, rule="duplicate-tensor", out=out, names=("old-mtp.safetensors", key))
    run_ckpt("extract", v, "-o", out, "--allow-invalid", "duplicate-tensor")
    assert validate(out).ok and not (out / "old-mtp.safetensors").exists()


# -- config vs tensors (seen 2) -----------------------------------------------------------------


def test_verifier_config_zero_with_mtp_present(make_fixture, draft, tmp_path):
    """Seen 2: stitch picked add mode and wrote model-mtp.safetensors beside the stale MTP tensors."""
    v = copy_of(make_fixture, tmp_path)
    edit_json(v / "config.json", lambda c: {**c, "num_nextn_predict_layers": 0})
    out = tmp_path / "o"
    for mode in ("auto", "add"):
        msg = refused("stitch", draft, v, "-o", out, "--mode", mode, rule="mtp-beyond", out=out,
                      names=("num_nextn_predict_layers", "--allow-invalid mtp-beyond", "model.layers.3."))
        assert "drop-mtp" in msg
    # even let through, add mode never leaves the old tensors beside new ones
    refused("stitch", draft, v, "-o", out, "--allow-invalid", "mtp-beyond", rule="mtp-exists", out=out,
            names=("--mode replace",))
    # --drop-mtp repairs it by construction: every MTP-namespace tensor goes
    run_ckpt("extract", v, "-o", out, "--drop-mtp")
    assert validate(out).ok


def test_declared_mtp_without_weights_needs_mode_add(make_fixture, draft, tmp_path):
    v = copy_of(make_fixture, tmp_path, drop_mtp=True)
    edit_json(v / "config.json", lambda c: {**c, "num_nextn_predict_layers": 1})
    out = tmp_path / "o"
    refused("stitch", draft, v, "-o", out, rule="mtp-missing", out=out,
            names=("--mode add", "--allow-invalid mtp-missing", "model.layers.3.enorm.weight"))
    run_ckpt("stitch", draft, v, "-o", out, "--mode", "add")
    assert validate(out).ok
    allowed = tmp_path / "o2"
    run_ckpt("stitch", draft, v, "-o", allowed, "--allow-invalid", "mtp-missing")
    assert run_ckpt("diff", out, allowed).exit_code == 0  # the same stitch, asked for explicitly


def test_mode_add_on_a_verifier_with_mtp_is_refused(make_fixture, draft, tmp_path):
    out = tmp_path / "o"
    refused("stitch", draft, make_fixture("deepseek_v3"), "-o", out, "--mode", "add", rule="mtp-exists", out=out)


# -- a complete trunk ---------------------------------------------------------------------------


def test_missing_and_misshaped_trunk_tensors(make_fixture, tmp_path):
    v = copy_of(make_fixture, tmp_path)
    gone, odd = "model.layers.1.self_attn.o_proj.weight", "model.layers.2.input_layernorm.weight"
    for key, fn in ((gone, None), (odd, lambda t: t[:-1].clone())):
        name = shard_of(v, key)
        tensors = load_file(v / name)
        if fn is None:
            del tensors[key]
        else:
            tensors[key] = fn(tensors[key])
        save_file(tensors, v / name, metadata={"format": "pt"})
    edit_json(v / INDEX, lambda ix: ix["weight_map"].pop(gone) and None)
    rules = {p.rule: p for p in validate(v).problems}
    assert rules["trunk-missing"].key == gone and rules["trunk-misshaped"].key == odd
    out = tmp_path / "o"
    refused("extract", v, "-o", out, rule="trunk-missing", out=out, names=(gone, "trunk-misshaped"))
    refused("fuse-experts", v, "-o", out, rule="trunk-missing", out=out)
    refused("init-draft", v, "-o", out, "--from-layer", "2", rule="trunk-missing", out=out)


def test_drafts_have_no_trunk_and_pass(draft):
    problems, _ = check(Checkpoint.open(draft))
    assert problems == []


# -- config typing (seen 16, 11) -----------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "expect"), [
    ("architectures", 7, "'architectures' is a number"),
    ("model_type", [], "'model_type' is a list"),
    ("text_config", "x", "'text_config' is a string"),
    ("quantization_config", "fp8", "'quantization_config' is a string"),
    ("hidden_size", "64", "'hidden_size' = \"64\""),
    ("tie_word_embeddings", "false", "expected true or false"),
    ("n_routed_experts", -1, "expected a non-negative integer"),
    ("num_hidden_layers", 10**9, "from 0 to 2048"),
    ("num_hidden_layers", 1e9, "not the float 1000000000.0"),
])
def test_config_field_of_the_wrong_type_is_exit_3(make_fixture, tmp_path, field, value, expect):
    v = copy_of(make_fixture, tmp_path)
    edit_json(v / "config.json", lambda c: {**c, field: value})
    out = tmp_path / "o"
    for verb in (("inspect", v), ("extract", v, "-o", out), ("init-draft", v, "-o", out)):
        refused(*verb, rule="config-field", out=out, names=("config.json", expect))
    assert "config-field" in validate(v).rules()


def test_string_dimension_never_reaches_an_expression(make_fixture, tmp_path):
    """Seen 16: "64" * a huge vocabulary allocated gigabytes; the value is refused before evaluation."""
    v = copy_of(make_fixture, tmp_path)
    edit_json(v / "config.json", lambda c: {**c, "hidden_size": "64", "vocab_size": 10**12})
    start = time.monotonic()
    refused("extract", v, "-o", tmp_path / "o", rule="config-field", names=("hidden_size",))
    assert time.monotonic() - start < 5


def test_config_that_is_not_an_object(make_fixture, tmp_path):
    v = copy_of(make_fixture, tmp_path)
    (v / "config.json").write_text("[1, 2]")
    refused("inspect", v, rule="config-json", names=("config.json", "JSON object"))


def test_table_defaults_are_checked_against_their_type(tmp_path, monkeypatch):
    from ckpt_tools.model.tables.loader import load_table, mappings_dir

    text = (mappings_dir() / "architectures" / "deepseek_v3.yaml").read_text()
    bad = tmp_path / "deepseek_v3.yaml"
    bad.write_text(text.replace("first_dense: {keys: [first_k_dense_replace], default: 0}",
                                "first_dense: {keys: [first_k_dense_replace], default: 0, type: str}"))
    with pytest.raises(TableError, match=r"config\.first_dense\.default"):
        load_table(bad)


# -- the escape hatch ------------------------------------------------------------------------------


def test_unknown_allow_invalid_rule_is_a_usage_error(make_fixture, tmp_path):
    r = run_ckpt("extract", make_fixture("deepseek_v3"), "-o", tmp_path / "o", "--allow-invalid", "everything", code=2)
    msg = message(r)
    assert "everything" in msg and all(rule in msg for rule in RULES)
    assert not (tmp_path / "o").exists()


def test_library_gate_names_first_problem_and_counts_the_rest(make_fixture, tmp_path):
    v = copy_of(make_fixture, tmp_path)
    edit_json(v / "config.json", lambda c: {**c, "num_nextn_predict_layers": 0})
    with pytest.raises(InputError) as e:
        require_consistent(Checkpoint.open(v))
    assert e.value.rule == "mtp-beyond" and "31 more problem(s): mtp-beyond x31" in str(e.value)
    gate = require_consistent(Checkpoint.open(v), allow={"mtp-beyond"})
    assert len(gate.allowed) == 32 and gate.view.count == 0


def test_hub_source_with_a_shard_left_out(hub, make_fixture, tmp_path):
    v = copy_of(make_fixture, tmp_path)
    left = shard_of(v, "lm_head.weight")
    edit_json(v / INDEX, lambda ix: {**ix, "weight_map": {k: s for k, s in ix["weight_map"].items() if s != left}})
    hub.state.add_repo("org/left-out", v)
    shown_by_inspect("hf://org/left-out", "unindexed-shard", (left, "lm_head.weight"))


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from hubserver import serve_hub

    yield from serve_hub(monkeypatch, tmp_path)
