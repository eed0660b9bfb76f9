"""`ckpt validate`: one deliberately corrupted copy of a fixture per rule, plus every family clean.

Corruptions always touch a copy (the cached fixtures stay pristine). Each case checks the
library report (rule, file, key) and the CLI run in-process: exit code, rule named, no traceback.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.errors import EXIT_FOUND, EXIT_INPUT, EXIT_OK, EXIT_USAGE, InputError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.tables.loader import all_tables, mappings_dir
from ckpt_tools.ops.check.validate import validate

from conftest import tree_hash

INDEX = "model.safetensors.index.json"
runner = CliRunner()

FAMILIES = sorted(all_tables())
CLEAN = [(f, {}) for f in FAMILIES] + [(f, {"fp8": True}) for f in FAMILIES if all_tables()[f].quantization]
CLEAN += [("deepseek_v3", {"expert_layout": "fused"}), ("deepseek_v3", {"mtp_sidecar": "mtp.safetensors"}),
          ("qwen3_next", {"num_shards": 1}), ("deepseek_v3", {"drop_mtp": True})]


def run_cli(d: Path, *extra: str):
    result = runner.invoke(app, ["validate", str(d), *extra], env={"COLUMNS": "250"})
    assert "Traceback" not in result.output
    return result


@pytest.mark.parametrize(("family", "opts"), CLEAN, ids=[f"{f}-{'-'.join(map(str, o.values())) or 'bf16'}"
                                                         for f, o in CLEAN])
def test_every_fixture_is_valid(make_fixture, family, opts):
    d = make_fixture(family, **opts)
    report = validate(d)
    assert report.ok, report.to_json()["problems"]
    assert report.family == family
    result = run_cli(d)
    assert result.exit_code == EXIT_OK, result.output
    assert "valid" in result.output
    j = json.loads(run_cli(d, "--json").stdout)
    assert j["ok"] is True and j["problems"] == [] and j["family"] == family


def test_validate_accepts_an_opened_checkpoint_and_leaves_inputs_untouched(make_fixture):
    d = make_fixture("deepseek_v3", fp8=True)
    before = tree_hash(d)
    assert validate(Checkpoint.open(d)).ok
    assert validate(d, arch="deepseek_v3").ok
    assert tree_hash(d) == before


# -- corruption helpers ------------------------------------------------------------------------


def copy_of(make_fixture, tmp_path: Path, family: str = "deepseek_v3", **kw) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(make_fixture(family, **kw), dst, symlinks=True)
    return dst


def read_raw(p: Path) -> tuple[dict, bytes]:
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(p: Path, header: dict | str | bytes, body: bytes) -> None:
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    raw = header.encode() if isinstance(header, str) else header
    raw += b" " * (-len(raw) % 8)
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edit_header(p: Path, fn) -> None:
    header, body = read_raw(p)
    fn(header)
    write_raw(p, header, body)


def edit_json(p: Path, fn) -> None:
    obj = json.loads(p.read_text())
    fn(obj)
    p.write_text(json.dumps(obj))


def shards(d: Path) -> list[str]:
    return sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))


def shard_of(d: Path, key: str) -> Path:
    return d / json.loads((d / INDEX).read_text())["weight_map"][key]


def first_entry(p: Path) -> str:
    """The key stored first in the data section (begin offset 0)."""
    header, _ = read_raw(p)
    return next(k for k, e in header.items() if k != "__metadata__" and e["data_offsets"][0] == 0)


def edit_tensors(p: Path, fn) -> None:
    tensors = load_file(str(p))
    fn(tensors)
    save_file(tensors, str(p), metadata={"format": "pt"})


def reindex(d: Path) -> None:
    """Rebuild the index from the shards as they now are (so only the intended rule fires)."""
    wmap, total = {}, 0
    for p in sorted(d.glob("*.safetensors")):
        header, _ = read_raw(p)
        for k, e in header.items():
            if k != "__metadata__":
                wmap[k] = p.name
                total += e["data_offsets"][1] - e["data_offsets"][0]
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}))


MTP = "model.layers.3."  # deepseek_v3 fixture: 3 trunk layers, MTP layer 3


# -- one corruption per rule: fn(d) -> (key, file suffix) expected on a problem of that rule -------

CORRUPTIONS: dict[str, tuple] = {}


def corruption(rule: str, **fixture):
    def deco(fn):
        CORRUPTIONS[rule] = (fn, fixture)
        return fn

    return deco


@corruption("header-length")
def _(d):
    p = d / shards(d)[0]
    p.write_bytes(p.read_bytes()[:5])
    return None, p.name


@corruption("header-too-large")
def _(d):
    p = d / shards(d)[0]
    p.write_bytes(struct.pack("<Q", 200_000_000) + p.read_bytes()[8:])
    return None, p.name


@corruption("header-json")
def _(d):
    p = d / shards(d)[0]
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    p.write_bytes(data[:8] + b"{" + b"x" * (n - 1) + data[8 + n :])
    return None, p.name


@corruption("header-not-object")
def _(d):
    p = d / shards(d)[0]
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    p.write_bytes(data[:8] + b"[]" + b" " * (n - 2) + data[8 + n :])
    return None, p.name


@corruption("duplicate-key")
def _(d):
    p = d / shards(d)[0]
    header, body = read_raw(p)
    k = first_entry(p)
    text = json.dumps(header, separators=(",", ":"))
    write_raw(p, "{" + json.dumps(k) + ":" + json.dumps(header[k]) + "," + text[1:], body)
    return None, p.name


@corruption("metadata-not-string")
def _(d):
    p = d / shards(d)[0]
    edit_header(p, lambda h: h.__setitem__("__metadata__", {"format": 1}))
    return None, p.name


@corruption("tensor-entry")
def _(d):
    p = d / shards(d)[0]
    k = first_entry(p)
    edit_header(p, lambda h: h[k].__setitem__("strides", [1]))
    return None, p.name


@corruption("unknown-dtype")
def _(d):
    p = d / shards(d)[0]
    k = first_entry(p)
    edit_header(p, lambda h: h[k].__setitem__("dtype", "Q4_K"))
    return None, p.name


@corruption("bad-shape")
def _(d):
    p = d / shards(d)[0]
    k = first_entry(p)
    edit_header(p, lambda h: h[k].__setitem__("shape", [-1, 64]))
    return None, p.name


@corruption("bad-offsets")
def _(d):
    p = d / shards(d)[0]
    k = first_entry(p)
    edit_header(p, lambda h: h[k].__setitem__("data_offsets", h[k]["data_offsets"][::-1]))
    return None, p.name


@corruption("misaligned")
def _(d):
    p = d / shards(d)[0]
    k = first_entry(p)
    edit_header(p, lambda h: h[k].update(dtype="F4", shape=[3]))
    return None, p.name


@corruption("size-mismatch")
def _(d):
    p = d / shards(d)[0]
    k = first_entry(p)
    edit_header(p, lambda h: h[k].__setitem__("shape", h[k]["shape"] + [2]))
    return None, p.name


@corruption("overlap")
def _(d):
    p = d / shards(d)[0]
    header, body = read_raw(p)
    k = first_entry(p)
    size = header[k]["data_offsets"][1]
    other = next(x for x, e in header.items() if x not in ("__metadata__", k)
                 and e["data_offsets"][1] - e["data_offsets"][0] == size)
    header[other]["data_offsets"] = list(header[k]["data_offsets"])
    write_raw(p, header, body)
    return None, p.name


@corruption("offsets-not-contiguous")
def _(d):
    p = d / shards(d)[0]
    k = first_entry(p)
    edit_header(p, lambda h: h.pop(k))
    return None, p.name


@corruption("past-end")
def _(d):
    p = d / shards(d)[0]
    p.write_bytes(p.read_bytes()[:-1])
    return None, p.name


@corruption("trailing-bytes")
def _(d):
    p = d / shards(d)[0]
    p.write_bytes(p.read_bytes() + b"\0\0\0")
    return None, p.name


@corruption("metadata-format")
def _(d):
    p = d / shards(d)[1]
    edit_header(p, lambda h: h.__setitem__("__metadata__", {"format": "np"}))
    return None, p.name


@corruption("index-json")
def _(d):
    (d / INDEX).write_text('{"weight_map": {')
    return None, INDEX


@corruption("index-metadata")
def _(d):
    edit_json(d / INDEX, lambda ix: ix.pop("metadata"))
    return None, INDEX


@corruption("total-size")
def _(d):
    edit_json(d / INDEX, lambda ix: ix["metadata"].__setitem__("total_size", ix["metadata"]["total_size"] + 1))
    return None, INDEX


@corruption("shard-path")
def _(d):
    name = shards(d)[1]
    shutil.copy(d / name, d.parent / "outside.safetensors")
    edit_json(d / INDEX, lambda ix: ix["weight_map"].update(
        {k: "../outside.safetensors" for k, v in ix["weight_map"].items() if v == name}))
    return None, None


@corruption("missing-shard")
def _(d):
    (d / shards(d)[1]).unlink()
    return None, None


@corruption("index-key-missing")
def _(d):
    edit_json(d / INDEX, lambda ix: ix["weight_map"].__setitem__("model.layers.0.bogus.weight", shards(d)[0]))
    return "model.layers.0.bogus.weight", INDEX


@corruption("unindexed-key")
def _(d):
    edit_json(d / INDEX, lambda ix: ix["weight_map"].pop("model.norm.weight"))
    return "model.norm.weight", shard_of_name(d, "model.norm.weight")


def shard_of_name(d: Path, key: str) -> str:
    for p in sorted(d.glob("*.safetensors")):
        if key in read_raw(p)[0]:
            return p.name
    raise KeyError(key)


@corruption("duplicate-tensor")
def _(d):
    key = "model.norm.weight"
    src = shard_of(d, key)
    other = d / next(s for s in shards(d) if s != src.name)
    t = load_file(str(src))[key]
    edit_tensors(other, lambda ts: ts.__setitem__(key, t.clone()))
    return key, None


@corruption("no-index")
def _(d):
    (d / INDEX).unlink()
    return None, None


@corruption("single-file-shadows-index")
def _(d):
    shutil.copy(d / shards(d)[0], d / "model.safetensors")
    return None, "model.safetensors"


@corruption("config-json")
def _(d):
    (d / "config.json").write_text('{"architectures": [')
    return None, "config.json"


@corruption("no-config")
def _(d):
    (d / "config.json").unlink()
    return None, None


@corruption("unknown-family")
def _(d):
    edit_json(d / "config.json", lambda c: c.update(architectures=["FooForCausalLM"], model_type="foo"))
    return None, None


@corruption("config-field")
def _(d):
    edit_json(d / "config.json", lambda c: c.pop("hidden_size"))
    return None, None


@corruption("mtp-missing")
def _(d):
    key = MTP + "mlp.experts.2.up_proj.weight"  # every expert must be there
    edit_tensors(shard_of(d, key), lambda ts: ts.pop(key))
    reindex(d)
    return key, "config.json"


@corruption("mtp-misshaped")
def _(d):
    key = MTP + "enorm.weight"
    p = shard_of(d, key)
    edit_tensors(p, lambda ts: ts.__setitem__(key, ts[key][:32].clone()))
    reindex(d)
    return key, p.name


@corruption("mtp-beyond")
def _(d):
    edit_json(d / "config.json", lambda c: c.__setitem__("num_nextn_predict_layers", 0))
    return MTP + "eh_proj.weight", None


@corruption("mtp-extra")
def _(d):
    key = MTP + "mlp.experts.7.up_proj.weight"  # the config has 4 experts
    p = shard_of(d, MTP + "enorm.weight")
    edit_tensors(p, lambda ts: ts.__setitem__(key, ts[MTP + "enorm.weight"].clone()))
    reindex(d)
    return key, p.name


@corruption("fp8-scale-missing", fp8=True)
def _(d):
    weight = MTP + "self_attn.o_proj.weight"
    key = MTP + "self_attn.o_proj.weight_scale_inv"
    edit_tensors(shard_of(d, key), lambda ts: ts.pop(key))
    reindex(d)
    return weight, None


@corruption("fp8-scale-shape", fp8=True)
def _(d):
    key = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    p = shard_of(d, key)
    edit_tensors(p, lambda ts: ts.__setitem__(key, ts[key].repeat(2, 1)))
    reindex(d)
    return key, p.name


@corruption("quant-config", fp8=True)
def _(d):
    edit_json(d / "config.json", lambda c: c.pop("quantization_config"))
    return None, "config.json"


@corruption("tied-head")
def _(d):
    edit_json(d / "config.json", lambda c: c.__setitem__("tie_word_embeddings", True))
    return "lm_head.weight", None


@pytest.mark.parametrize("rule", sorted(CORRUPTIONS))
def test_each_rule_on_a_corrupted_copy(make_fixture, tmp_path, rule):
    fn, fixture = CORRUPTIONS[rule]
    pristine = make_fixture("deepseek_v3", **fixture)
    before = tree_hash(pristine)
    d = copy_of(make_fixture, tmp_path, **fixture)
    key, file = fn(d)
    report = validate(d)
    hits = [p for p in report.problems if p.rule == rule]
    assert hits, f"{rule} not reported; got {report.to_json()['problems']}"
    if key is not None:
        assert any(p.key == key for p in hits), [p.to_json() for p in hits]
    if file is not None:
        assert any(p.path and Path(p.path).name == file for p in hits), [p.to_json() for p in hits]
    assert all(p.message for p in report.problems)

    result = run_cli(d)
    assert result.exit_code == EXIT_FOUND, result.output
    assert rule in result.output
    if key is not None:
        assert key in result.output
    j = json.loads(run_cli(d, "--json").stdout)
    assert j["ok"] is False and j["counts"][rule] >= 1
    assert tree_hash(pristine) == before  # the cached fixture was never touched


def test_quant_config_without_fp8_tensors(make_fixture, tmp_path):
    d = copy_of(make_fixture, tmp_path)
    edit_json(d / "config.json", lambda c: c.__setitem__("quantization_config", {"quant_method": "fp8"}))
    assert "quant-config" in validate(d).rules()


def test_metadata_without_format_is_refused_but_no_metadata_is_fine(make_fixture, tmp_path):
    d = copy_of(make_fixture, tmp_path)
    p = d / shards(d)[2]
    edit_header(p, lambda h: h.__setitem__("__metadata__", {"producer": "x"}))
    assert validate(d).rules() == {"metadata-format"}
    edit_header(p, lambda h: h.pop("__metadata__"))
    assert validate(d).ok


def test_stale_copy_beside_the_index_is_a_duplicate(make_fixture, tmp_path):
    d = copy_of(make_fixture, tmp_path)
    key = MTP + "eh_proj.weight"
    t = load_file(str(shard_of(d, key)))[key]
    save_file({key: t}, str(d / "old-mtp.safetensors"), metadata={"format": "pt"})
    report = validate(d)
    assert report.rules() == {"duplicate-tensor"}
    (p,) = report.problems
    assert p.key == key and Path(p.path).name == "old-mtp.safetensors"


def test_shard_links_outside_are_refused(make_fixture, tmp_path):
    d = copy_of(make_fixture, tmp_path)
    name = shards(d)[0]
    (d / name).rename(tmp_path / "elsewhere.safetensors")
    (d / name).symlink_to(tmp_path / "elsewhere.safetensors")
    assert "shard-path" in validate(d).rules()


def test_ambiguous_family(make_fixture, tmp_path, monkeypatch):
    clone = yaml.safe_load((mappings_dir() / "architectures" / "deepseek_v3.yaml").read_text())
    clone["family"] = "deepseek_v3_clone"
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "deepseek_v3_clone.yaml").write_text(yaml.safe_dump(clone))
    monkeypatch.setenv("CKPT_TABLES", str(tables))
    d = make_fixture("deepseek_v3")
    report = validate(d)
    assert report.rules() == {"ambiguous-family"}
    assert "deepseek_v3_clone" in report.problems[0].message
    assert validate(d, arch="deepseek_v3").ok


def test_every_problem_is_reported_at_once(make_fixture, tmp_path):
    d = copy_of(make_fixture, tmp_path, fp8=True)
    names = shards(d)
    p0 = d / names[0]
    p0.write_bytes(p0.read_bytes() + b"\0")  # trailing-bytes in one shard
    edit_header(d / names[1], lambda h: h.__setitem__("__metadata__", {"format": "jax"}))
    edit_json(d / "config.json", lambda c: c.__setitem__("num_nextn_predict_layers", 0))
    key = "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"
    edit_tensors(shard_of(d, key), lambda ts: ts.pop(key))
    report = validate(d)
    assert {"trailing-bytes", "metadata-format", "mtp-beyond", "fp8-scale-missing", "index-key-missing"} <= \
        report.rules()
    assert len([p for p in report.problems if p.rule == "mtp-beyond"]) > 10  # every tensor, not the first


def test_config_checks_report_once_and_format_checks_still_run(make_fixture, tmp_path):
    d = copy_of(make_fixture, tmp_path)
    (d / "config.json").unlink()
    edit_json(d / INDEX, lambda ix: ix["metadata"].__setitem__("total_size", 1))
    report = validate(d)
    assert sorted(p.rule for p in report.problems) == ["no-config", "total-size"]
    edit_json(d / INDEX, lambda ix: ix.pop("metadata"))
    (d / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    report = validate(d)
    assert sorted(p.rule for p in report.problems) == ["index-metadata", "unknown-family"]
    msg = next(p.message for p in report.problems if p.rule == "unknown-family")
    for family in all_tables():
        assert family in msg


@pytest.mark.parametrize("kind", ["missing", "empty", "config-only"])
def test_not_a_checkpoint_exits_3(tmp_path, kind, make_fixture):
    d = tmp_path / "x"
    if kind != "missing":
        d.mkdir()
    if kind == "config-only":
        shutil.copy(make_fixture("deepseek_v3") / "config.json", d / "config.json")
    with pytest.raises(InputError):
        validate(d)
    result = run_cli(d)
    assert result.exit_code == EXIT_INPUT, result.output
    assert "error" in result.output


def test_unknown_arch_option_is_a_usage_error(make_fixture):
    result = run_cli(make_fixture("deepseek_v3"), "--arch", "nope")
    assert result.exit_code == EXIT_USAGE and "deepseek_v3" in result.output


# -- one rule set: validate and the consistency gate (issue 24, item 3) -------------------------------


def _trunk_layers_dropped(src: Path, out: Path) -> Path:
    """``src`` with every decoder layer removed (keys ``[model.][language_model.]layers.I.`` with I below the
    config's num_hidden_layers): embedding, final norm, head and MTP stay. Written by safetensors itself."""
    import re

    config = json.loads((src / "config.json").read_text())
    n = (config.get("text_config") or config)["num_hidden_layers"]
    layer = re.compile(r"(?:model\.(?:language_model\.)?)?layers\.(\d+)\.")
    kept = {}
    for f in sorted(src.glob("*.safetensors")):
        kept.update({k: v for k, v in load_file(f).items() if not ((m := layer.match(k)) and int(m.group(1)) < n)})
    out.mkdir()
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")
    return out


@pytest.mark.parametrize(("family", "mtp_key"), [("deepseek_v3", "model.layers.3.eh_proj.weight"),
                                                 ("qwen3_next", "mtp.fc.weight")])
def test_embed_norm_head_and_mtp_without_any_decoder_layer_is_invalid_for_validate_and_every_verb(
        make_fixture, tmp_path, family, mtp_key):
    """Issue 24 item 3: validate said valid while stitch refused the same checkpoint with trunk-missing."""
    from ckpt_tools.model.gate import check

    from conftest import run_ckpt

    d = _trunk_layers_dropped(make_fixture(family), tmp_path / "v")
    with Checkpoint.open(d) as c:
        keys = set(c.tensors)
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", mtp_key} <= keys
        gate = {scope: {p.rule for p in check(c, scope=scope)[0]} for scope in ("auto", "model")}
    rep = validate(d)
    assert rep.rules() == {"trunk-missing"} == gate["auto"] == gate["model"]
    missing = {p.key for p in rep.problems}
    assert any(".layers.0." in k for k in missing) and not any("embed_tokens" in k or "lm_head" in k for k in missing)
    assert run_cli(d).exit_code == EXIT_FOUND
    draft = tmp_path / "draft"
    run_ckpt("extract", make_fixture(family), "-o", draft)
    out = tmp_path / "o"
    r = run_ckpt("stitch", draft, d, "-o", out, code=EXIT_INPUT)
    assert "[trunk-missing]" in r.output and not out.exists()
    r = run_ckpt("extract", d, "-o", tmp_path / "e", code=EXIT_INPUT)  # the gate of every other verb: the same
    assert "[trunk-missing]" in r.output


def test_a_draft_is_still_a_draft(make_fixture, tmp_path):
    """The exemption the trunk rules keep: our draft (manifest kind mtp-draft, embed and head carried), and a
    checkpoint of MTP tensors only; validate notes that it was checked as a draft."""
    from conftest import run_ckpt

    family = "qwen3_next"
    draft = tmp_path / "draft"
    run_ckpt("extract", make_fixture(family), "-o", draft, "--with-embed", "--with-head")
    with Checkpoint.open(draft) as c:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(c.tensors)
    rep = validate(draft)
    assert rep.ok and "draft" in {n.rule for n in rep.notes}
    bare = tmp_path / "bare"  # the same without our manifest: embed and head make it a trunk without layers
    shutil.copytree(draft, bare)
    (bare / "ckpt_manifest.json").unlink()
    assert validate(bare).rules() == {"trunk-missing"}
    mtp_only = tmp_path / "mtp-only"
    mtp_only.mkdir()
    tensors = {k: v for f in sorted(bare.glob("*.safetensors")) for k, v in load_file(f).items()
               if k.startswith("mtp.")}
    save_file(tensors, mtp_only / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(bare / "config.json", mtp_only / "config.json")
    rep = validate(mtp_only)
    assert rep.ok and "draft" in {n.rule for n in rep.notes}, rep.problems[:3]


def test_the_gate_and_validate_run_one_rule_set(make_fixture, monkeypatch):
    """Every rule the gate refuses on comes from a check of rules.RULE_SET, and validate runs every check of
    that list: a check made to report a sentinel problem shows up in validate's report, and in the gate's
    when it refuses. A rule added to one and not the other fails here."""
    from dataclasses import replace

    from ckpt_tools.model import rules
    from ckpt_tools.model.consistency import RULES, Problem
    from ckpt_tools.model.gate import check

    assert rules.refusing_rules() - {"index-key-missing"} == set(RULES)  # index-key-missing: refused on opening
    assert set(RULES) <= rules.known_rules()
    monkeypatch.setattr(rules, "RULE_SET", [
        replace(e, run=lambda ctx, e=e: [Problem(e.rules[0], None, f"sentinel.{e.name}", "sentinel")])
        for e in rules.RULE_SET])
    d = make_fixture("deepseek_v3")
    reported = {p.key for p in validate(d).problems if p.message == "sentinel"}
    with Checkpoint.open(d) as c:
        refused = {p.key for p in check(c, scope="model")[0] if p.message == "sentinel"}
    assert reported == {f"sentinel.{e.name}" for e in rules.RULE_SET}
    assert refused == {f"sentinel.{e.name}" for e in rules.RULE_SET if e.refuses}
    assert len(rules.RULE_SET) >= 10
