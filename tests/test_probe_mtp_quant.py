"""`ckpt probe --mtp-quant`: the verifier's own MTP encoded into each scheme as graft writes it, decoded as the
engine reads it, and measured on the same greedy path (issue 44)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt

pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

TOKENS, DEPTH = "8", "2"


@pytest.fixture(scope="module")
def trained() -> Path:
    return probe_model.build(CACHE)[0]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return probe_model.write_prompts(tmp_path_factory.mktemp("prompts"), 3, 6, seed=7)


def probe(verifier, prompts, *extra, code: int = 0) -> dict:
    r = ckpt("probe", verifier, "--prompts", prompts, "--max-new-tokens", TOKENS, "--depth", DEPTH, "--json", *extra,
             code=code)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def reported(trained, prompts, tmp_path_factory) -> Path:
    """--mtp-quant all, with --report and --plot (the JSON on stdout is the report's)."""
    out = tmp_path_factory.mktemp("reported")
    data = probe(trained, prompts, "--mtp-quant", "all", "--report", out / "r.json", "--plot", out / "p.png")
    assert json.loads((out / "r.json").read_text()) == data
    return out


@pytest.fixture(scope="module")
def table(reported) -> dict:
    return json.loads((reported / "r.json").read_text())


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from hubserver import serve_hub

    yield from serve_hub(monkeypatch, tmp_path)


def _rows(report: dict) -> dict[str, dict]:
    return {r["scheme"]: r for r in report["mtp_quant"]}


def test_the_table_covers_every_scheme_and_its_first_row_is_plain_probe(trained, prompts, table):
    from ckpt_tools.model.quant import all_schemes
    from ckpt_tools.ops.stitch.graft import mtp_quants

    rows = _rows(table)
    gguf = ["gguf-f32", "gguf-f16", "gguf-bf16", "gguf-q8_0"]  # the sidecar types, in `all` after the tables
    assert list(rows)[0] == "as stored" and set(rows) == {"as stored", *all_schemes(), *gguf}
    assert list(rows)[-4:] == gguf and all(rows[g]["status"] == "measured" for g in gguf)
    assert rows["gguf-q8_0"]["bytes"] < rows["gguf-f16"]["bytes"] < rows["gguf-f32"]["bytes"]
    assert "reason" not in rows["gguf-q8_0"]  # not "the family table marks no MTP weight quantizable"
    plain = probe(trained, prompts)["drafts"][0]
    assert rows["gguf-f32"]["agreement"] == plain["agreement"] and rows["gguf-f32"]["kl"] == plain["kl"]
    assert rows["as stored"]["agreement"] == plain["agreement"] and rows["as stored"]["kl"] == plain["kl"]
    assert table["drafts"][0]["agreement"] == plain["agreement"] and len(table["drafts"]) == 1  # rows: no drafts
    assert rows["quark-mxfp4"]["status"] == "no-encoder" and "agreement" not in rows["quark-mxfp4"]
    for name in mtp_quants():  # every scheme with an encoder: measured, or listed with the reason
        row = rows[name]
        assert row["status"] in ("measured", "unserved", "unencodable"), row
        assert ("agreement" in row) == (row["status"] == "measured") and (row["status"] == "measured" or row["reason"])
    # the tiny DeepSeek-V3 has routed experts: vLLM's CPU build has no int8 MoE backend; deepseek-v4 is V4's layout
    assert rows["ct-int8"]["status"] == "unserved" and "Int8 MoE" in rows["ct-int8"]["reason"]
    assert rows["deepseek-v4"]["status"] == "unserved"
    fp8 = rows["fp8-block"]
    assert fp8["status"] == "measured" and len(fp8["agreement"]) == len(fp8["kl"]) == int(DEPTH)
    assert fp8["bytes"] < rows["as stored"]["bytes"]  # F32 weights written as FP8 with block scales
    assert fp8["agreement_change"] == [a - b for a, b in zip(fp8["agreement"], plain["agreement"], strict=True)]
    assert fp8["kl"] != rows["as stored"]["kl"]  # decoded values, not the float ones


def test_a_row_equals_probe_on_the_checkpoint_graft_writes(trained, prompts, table, tmp_path):
    """The fp8-block row measures the bytes `ckpt graft --mtp-quant fp8-block` writes: probing the written
    checkpoint gives the same agreement and KL."""
    target = tmp_path / "target"
    shutil.copytree(trained, target)
    config = json.loads((target / "config.json").read_text())
    trunk = [f"model.layers.{i}" for i in range(config["num_hidden_layers"])] + ["lm_head"]
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": trunk}
    (target / "config.json").write_text(json.dumps(config))  # declares block FP8 for the MTP only
    out = tmp_path / "out"
    ckpt("graft", trained, target, "-o", out, "--mtp-quant", "fp8-block", "--allow-invalid", "quant-config")
    written = probe(out, prompts)
    assert written["mtp_loaded"] == "dequantized by ckpt-tools (fp8-block)"
    row = _rows(table)["fp8-block"]
    assert written["drafts"][0]["agreement"] == row["agreement"] and written["drafts"][0]["kl"] == row["kl"]


def planted_outliers(verifier: Path, out: Path) -> Path:
    """A copy of ``verifier`` where, in every MLP of the MTP layer, intermediate unit 0 is silenced (its up_proj row
    zero) and its down_proj column set to 1e6. The float model computes 0 * 1e6 = 0 (unchanged but for that unit);
    a per-tensor or per-block FP8 scale set by the outlier flushes every other down_proj weight to zero."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(verifier, out)
    f = out / "model-mtp.safetensors"
    tensors = load_file(str(f))
    for key in [k for k in tensors if k.endswith("down_proj.weight")]:
        tensors[key.replace("down_proj", "up_proj")][0] = 0.0
        tensors[key][:, 0] = 1e6
    save_file(tensors, str(f), metadata={"format": "pt"})
    return out


def test_a_planted_outlier_mtp_drops_under_fp8(trained, prompts, tmp_path):
    planted = planted_outliers(trained, tmp_path / "planted")
    rows = _rows(probe(planted, prompts, "--mtp-quant", "modelopt-fp8,fp8-block,gguf-f16"))
    assert list(rows) == ["as stored", "modelopt-fp8", "fp8-block", "gguf-f16"]
    # 1e6 is beyond F16 (65504): the sidecar would hold inf; listed with the reason, not measured (nor a NaN report)
    assert rows["gguf-f16"]["status"] == "unencodable" and "not finite once stored as f16" in rows["gguf-f16"]["reason"]
    stored = rows["as stored"]["agreement"][0]
    for name in ("modelopt-fp8", "fp8-block"):
        assert rows[name]["agreement"][0] < stored - 0.1, (name, rows[name]["agreement"], stored)
        assert rows[name]["agreement_change"][0] < -0.1


def test_unknown_schemes_and_the_vllm_engine_are_refused(trained, prompts):
    r = ckpt("probe", trained, "--prompts", prompts, "--mtp-quant", "fp8-block,nope", code=2)
    assert "[mtp-quant-scheme]" in r.output and "nope" in r.output
    r = ckpt("probe", trained, "--prompts", prompts, "--mtp-quant", "all", "--engine", "vllm", code=2)
    assert "--engine transformers" in r.output


def test_the_table_goes_into_the_plot_and_the_card(hub, trained, reported, table, tmp_path):
    from huggingface_hub import ModelCard

    from ckpt_tools.ops.probe.plot import quant_series

    assert (reported / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = [r["scheme"] for r in table["mtp_quant"] if r["status"] == "measured" and r["scheme"] != "as stored"]
    assert [s["name"] for s in quant_series(table)] == [f"mtp-quant {n}" for n in measured] and measured
    d = tmp_path / "verifier"
    shutil.copytree(trained, d)
    shutil.copy(reported / "r.json", d / "probe-report.json")
    ckpt("push", d, "me/verifier")
    text = hub.state.files("me/verifier")["README.md"].decode()
    ModelCard(text)  # parses
    assert "### The MTP per storage scheme" in text
    fp8 = _rows(table)["fp8-block"]
    row = next(line for line in text.splitlines() if line.startswith("| fp8-block |"))
    assert f"| {fp8['bytes']} | {fp8['agreement'][0]:.4f} |" in row
    assert "| quark-mxfp4 | - |" in text and "no-encoder: its table names no encoder" in text


@pytest.mark.parametrize(("edit", "named"), [
    (lambda rows: rows[1].update(kl=[None, 0.1]), "mtp_quant[1].kl[0] (depth 1) is null, not a finite number"),
    (lambda rows: rows[1].update(status="great"), "mtp_quant[1].status is \"great\", not one of measured"),
    (lambda rows: rows[1].update(agreement=[1.5, 1.0]), "mtp_quant[1].agreement[0] (depth 1) is 1.5, not a share"),
    (lambda rows: next(r for r in rows if r["status"] == "no-encoder").update(agreement=[1.0]),
     "holds numbers: only a measured row does"),
])
def test_a_report_whose_mtp_quant_rows_are_not_probes_is_refused(trained, table, tmp_path, edit, named):
    report = json.loads(json.dumps(table))
    edit(report["mtp_quant"])
    bad = tmp_path / "edited-report.json"
    bad.write_text(json.dumps(report))
    r = ckpt("push", trained, "me/v", "--probe-report", bad, "--dry-run", code=3)
    out = " ".join((r.output + (r.stderr or "")).split())
    assert "[probe-report]" in out and named in out


def test_glm4_moe_rows_say_its_table_marks_no_mtp_weight_quantizable(prompts):
    """The GLM-4-MoE table marks no MTP weight `quant: true` (its FP8 releases' MTP scales are unverified): graft
    writes its MTP as stored in every scheme, and each row says so rather than read as lossless."""
    glm, _ = probe_model.build(CACHE, "glm4_moe")
    rows = _rows(probe(glm, prompts, "--mtp-quant", "fp8-block,ct-nvfp4"))
    for name in ("fp8-block", "ct-nvfp4"):
        assert rows[name]["status"] == "measured" and "marks no MTP weight quantizable" in rows[name]["reason"]
        assert rows[name]["bytes"] == rows["as stored"]["bytes"]
        assert rows[name]["agreement"] == rows["as stored"]["agreement"]
