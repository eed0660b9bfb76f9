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
from ckpt_tools.model.quant.codec import checkpoint_codec
from ckpt_tools.model.tables.loader import all_tables, get_table
from ckpt_tools.ops.inspect.inspect import inspect_checkpoint

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
    # the scale suffix of the family's hinted scheme (weight_scale_inv; DeepSeek-V4's release names them `.scale`)
    q = get_table(family).quantization
    suffix = checkpoint_codec(hint=q).scale_suffix
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


# -- a quantizer output whose MTP was dropped: inspect shows what is there and what is missing ---------------

FLOAT = {"BF16", "F16", "F32"}
PRODUCERS = Path(__file__).resolve().parent.parent / "fixtures" / "producers"


def _drop_keys(src: Path, dst: Path, drop) -> set[str]:
    """``src`` rewritten with safetensors (not our writer) without the keys ``drop(key)`` picks, the index
    updated, as a quantizer that lost MTP leaves it; returns the keys dropped."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    gone: set[str] = set()
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            tensors = load_file(str(p))
            gone |= {k for k in tensors if drop(k)}
            save_file({k: v for k, v in tensors.items() if not drop(k)}, str(dst / p.name), metadata={"format": "pt"})
        elif p.name == "model.safetensors.index.json":
            index = json.loads(p.read_text())
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not drop(k)}
            (dst / p.name).write_text(json.dumps(index))
        else:
            (dst / p.name).write_bytes(p.read_bytes())
    return gone


@pytest.fixture(scope="module")
def mtp_dropped(tmp_path_factory, make_fixture) -> tuple[Path, set[str]]:
    """DeepSeek-V3 block FP8 whose config keeps num_nextn_predict_layers=1 while its shards hold no MTP tensor."""
    src = make_fixture("deepseek_v3", fp8=True)
    cfg = json.loads((src / "config.json").read_text())
    assert _text(cfg)["num_nextn_predict_layers"] == 1
    out = tmp_path_factory.mktemp("dropped") / "ck"
    return out, _drop_keys(src, out, appended_layers(cfg))


def test_inspect_reports_dropped_mtp_instead_of_refusing(mtp_dropped):
    d, gone = mtp_dropped
    assert gone and not any(appended_layers(json.loads((d / "config.json").read_text()))(k) for k in read_all(d))
    runner = CliRunner()
    r = runner.invoke(app, ["inspect", str(d), "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    assert j["mtp_layers"] == 1 and not j["status"]["complete"]
    assert j["totals"]["mtp"]["tensors"] == 0 and j["totals"]["checkpoint"] == totals(read_all(d).values())
    # what is missing: every dropped weight (its FP8 scale is implied), optional per-layer copies as notes
    weights = {k for k in gone if not k.endswith("_scale_inv")}
    assert {f["rule"] for f in j["findings"]} == {"mtp-missing"}
    missing = {f["key"] for f in j["findings"]}
    optional = {n["key"] for n in j["notes"] if n["rule"] in ("copy-absent", "optional-absent")}
    assert missing | optional == weights and not missing & optional
    assert {m["key"] for m in j["status"]["missing"]} == missing
    assert all(f["path"].endswith("config.json") and "ckpt graft" in f["message"] for f in j["findings"])
    assert "allowed_invalid" not in j
    (g,) = j["experts"]
    assert (g["tensors"], g["quant"], g["stored"]) == (0, False, None)

    human = runner.invoke(app, ["inspect", str(d)], env={"COLUMNS": "200"})
    assert human.exit_code == 0 and "Traceback" not in human.output
    text = human.output
    assert "MTP set incomplete" in text and f"{len(missing)} declared tensor(s) missing" in text
    assert f"{len(missing)} finding(s) (mtp-missing x{len(missing)})" in text and "ckpt graft SOURCE" in text
    first = j["findings"][0]["key"]
    assert re.search(rf"\bmtp-missing config\.json {re.escape(first)}:", text)

    # the other verbs still refuse it, validate still fails it: only the diagnostic reads it through
    assert runner.invoke(app, ["validate", str(d)]).exit_code == 1
    refused = runner.invoke(app, ["extract", str(d), "-o", str(d.parent / "x")])
    assert refused.exit_code == EXIT_INPUT and "mtp-missing" in refused.output


def test_api_inspect_returns_findings(mtp_dropped):
    from ckpt_tools import api

    d, _ = mtp_dropped
    report = api.inspect(d)
    assert not report.complete and report.findings and report.findings[0]["rule"] == "mtp-missing"
    assert report.to_json()["findings"] == report.findings


def test_inspect_reports_a_quantized_output_that_dropped_mtp(tmp_path):
    """The same through the quantizer fixtures (compressed-tensors' own compressors write the trunk)."""
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    d = make_quantized_checkpoint("deepseek_v3", tmp_path / "q", QuantOptions("ct-fp8-channel", mtp="dropped"))
    j = json.loads(CliRunner().invoke(app, ["inspect", str(d), "--json"]).stdout)
    assert j["quantization"]["scheme"] == "ct-fp8" and j["totals"]["mtp"]["tensors"] == 0
    assert {f["rule"] for f in j["findings"]} == {"mtp-missing"} and len(j["findings"]) == len(j["status"]["missing"])


def test_inspect_unreadable_input_is_still_exit_3(make_fixture, tmp_path):
    """Exit 3 stays for what cannot be read: a shard cut short."""
    d = tmp_path / "cut"
    d.mkdir()
    src = make_fixture("deepseek_v3")
    for p in src.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    last = sorted(d.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])
    r = CliRunner().invoke(app, ["inspect", str(d)])
    assert r.exit_code == EXIT_INPUT and "Traceback" not in r.output


@pytest.mark.parametrize("name", sorted(p.name for p in PRODUCERS.glob("llmcompressor-*") if p.is_dir()) or ["absent"])
def test_inspect_reads_real_llmcompressor_outputs(name):
    """Outputs llm-compressor wrote (fixtures/producers, when present): inspect reads every one, exit 0."""
    d = PRODUCERS / name
    if not (d / "config.json").is_file():
        pytest.skip(f"no producer output at {d}")
    r = CliRunner().invoke(app, ["inspect", str(d), "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    assert j["totals"]["checkpoint"] == totals(read_all(d).values())
    if j["mtp_layers"] and j["totals"]["mtp"]["tensors"] == 0:  # the config declares MTP the quantizer dropped
        assert {f["rule"] for f in j["findings"]} >= {"mtp-missing"}


# -- the expert table says what is stored ---------------------------------------------------------------------


def _golden_options(name: str) -> dict:
    head = (Path(__file__).resolve().parent.parent / "fixtures" / "golden" / f"{name}.txt").read_text()
    line = next(x for x in head.splitlines() if x.startswith("# fixture: "))
    return json.loads(line.removeprefix("# fixture: "))["options"]


def _experts_section(text: str) -> str:
    return text.split("Routed experts", 1)[1].split("Shards holding MTP tensors", 1)[0]


@pytest.mark.parametrize(("family", "opts", "layout"), [
    ("deepseek_v3", {}, "per-expert"),
    ("qwen3_5_moe", {}, "fused"),  # the BF16 multimodal release (Qwen3.6)
    ("qwen3_5_moe", _golden_options("qwen3_5_moe_perexpert"), "per-expert"),  # Qwen3.5-35B-A3B's MTP experts
    ("qwen3_5_moe", {"fp8": True}, "fused"),
])
def test_expert_table_reports_storage(make_fixture, family, opts, layout):
    d = make_fixture(family, **opts)
    tensors = read_all(d)
    j = inspect_checkpoint(d).to_json()
    (g,) = [g for g in j["experts"] if g["depth"] is not None]
    mine = {k: v for k, v in tensors.items() if k.startswith(g["prefix"] + ".")}
    # the oracle: per-expert keys carry the expert index after the prefix, fused ones do not
    per_expert = any(re.match(rf"{re.escape(g['prefix'])}\.\d+\.", k) for k in mine)
    assert ("per-expert" if per_expert else "fused") == layout
    assert g["layout"] == layout
    quantized = any(v["dtype"] not in FLOAT for v in mine.values())
    assert g["quant"] == quantized == bool(opts.get("fp8"))
    assert g["stored"] == ("F8_E4M3 block [128, 128]" if quantized else "BF16")
    text = CliRunner().invoke(app, ["inspect", str(d)], env={"COLUMNS": "200"}).output
    section = _experts_section(text)
    assert "shipped" not in section and layout in section
    if not quantized:  # the table's quant flag is no storage: an unquantized checkpoint shows no FP8
        assert inspect_checkpoint(d).view.resolved.experts()[0].quant  # the table flags them for FP8
        assert "fp8" not in section.lower() and "F8_" not in section and "BF16" in section


def test_expert_table_names_a_scheme_tables_storage(tmp_path):
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    d = make_quantized_checkpoint("deepseek_v3", tmp_path / "q", QuantOptions("ct-nvfp4a16"))
    (g,) = inspect_checkpoint(d).to_json()["experts"]
    assert g["quant"] and g["stored"].startswith("NVFP4") and g["layout"] == "per-expert"
    mine = {k: v for k, v in read_all(d).items() if k.startswith(g["prefix"] + ".")}
    assert "U8" in {v["dtype"] for v in mine.values()}  # packed FP4, as the oracle reads the header
    # its size: every tensor it is stored as (packed weights, scales, global scales), not 0 for want of .weight
    assert (g["tensors"], g["bytes"]) == (len(mine), sum(v["bytes"] for v in mine.values()))
    assert "nothing stored" not in _experts_section(CliRunner().invoke(app, ["inspect", str(d)]).output)
