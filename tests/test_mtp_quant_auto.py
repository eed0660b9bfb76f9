"""`graft --mtp-quant auto` and `extract --format gguf --gguf-type auto` (issue 44): the MTP's storage chosen by
`ckpt probe --mtp-quant`'s measurement, on the trained tiny verifiers; the table in the report, manifest and card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt

pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)
from test_probe_mtp_quant import planted_outliers  # noqa: E402

MEASURE = ("--max-new-tokens", "8", "--depth", "2")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return probe_model.write_prompts(tmp_path_factory.mktemp("prompts"), 3, 6, seed=7)


def _fp8_mtp_target(verifier: Path, d: Path) -> Path:
    """The verifier, its config declaring block FP8 for the MTP only (the trunk excluded): the target graft writes."""
    shutil.copytree(verifier, d)
    config = json.loads((d / "config.json").read_text())
    trunk = [f"model.layers.{i}" for i in range(config["num_hidden_layers"])] + ["lm_head"]
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": trunk}
    (d / "config.json").write_text(json.dumps(config))
    return d


def _graft_auto(source: Path, target: Path, out: Path, prompts: Path, *extra: str) -> dict:
    ckpt("graft", source, target, "-o", out, "--mtp-quant", "auto", "--prompts", prompts, *MEASURE,
         "--allow-invalid", "quant-config", *extra)
    report = json.loads((out / "graft-report.json").read_text())
    assert json.loads((out / "ckpt_manifest.json").read_text())["mtp_quant_auto"] == report["mtp_quant_auto"]
    return report["mtp_quant_auto"]


def _probe(path: Path, prompts: Path) -> dict:
    return json.loads(ckpt("probe", path, "--prompts", prompts, *MEASURE, "--json").stdout)


def _probe_written(out: Path, prompts: Path, tmp_path: Path) -> dict:
    """``ckpt probe`` of graft's output. An MTP written as stored leaves a config declaring FP8 for no module,
    which transformers builds no quantizer for (probe refuses it, [probe-load]): then a copy of the output without
    its quantization config, the same tensors, is probed."""
    config = json.loads((out / "config.json").read_text())
    if any(k.endswith("weight_scale_inv") for k in json.loads((out / "model.safetensors.index.json").read_text())[
            "weight_map"]):
        return _probe(out, prompts)
    plain = tmp_path / "written-unquantized"
    shutil.copytree(out, plain)
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))
    return _probe(plain, prompts)


def _rows(choice: dict) -> dict[str, dict]:
    return {r["scheme"]: r for r in choice["rows"]}


@pytest.mark.parametrize(("family", "chosen"), [("deepseek_v3", "fp8-block"), ("glm4_moe", "as stored")])
def test_auto_measures_every_scheme_and_writes_what_it_measured(family, chosen, prompts, tmp_path):
    """DeepSeek-V3: block FP8 keeps acceptance and is smaller: chosen. GLM-4-MoE: its table marks no MTP weight
    quantizable, every row is the MTP as stored: nothing smaller, written as stored. Either way probing the
    output gives the chosen row's numbers, and the card shows the table."""
    from ckpt_tools.model.model_card import gather, render
    from ckpt_tools.ops.stitch.graft import mtp_quants

    trained, _ = probe_model.build(CACHE, family)
    out = tmp_path / "out"
    choice = _graft_auto(trained, _fp8_mtp_target(trained, tmp_path / "target"), out, prompts)
    rows = _rows(choice)
    assert list(rows)[0] == "as stored" and set(mtp_quants()) <= set(rows), list(rows)
    assert choice["candidates"] == ["fp8-block"] and choice["chosen"] == chosen, choice["why"]
    assert choice["max_drop"] == 0.01 and choice["measured"]["prompts"] == 3
    probed = _probe_written(out, prompts, tmp_path)
    written = probed["drafts"][0]
    assert written["agreement"] == rows[chosen]["agreement"] and written["kl"] == rows[chosen]["kl"]
    if chosen == "fp8-block":
        assert rows["fp8-block"]["bytes"] < rows["as stored"]["bytes"]
        assert probed["mtp_loaded"] == "dequantized by ckpt-tools (fp8-block)"
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    card = render(gather("me/out", out, manifest=manifest, stitch_report=None))
    assert "## MTP precision chosen by measurement" in card and f"chose **{chosen}**" in card
    assert f"| {chosen} | {rows[chosen]['bytes']} |" in card


def test_auto_does_not_choose_a_scheme_that_loses_acceptance(prompts, tmp_path):
    """A planted outlier (a down_proj column of 1e6 behind a silenced unit: nothing changes in float) makes block
    FP8 flush every other weight of the matrix: its acceptance drops, so auto writes the MTP as stored; on the
    same verifier without the outlier it chooses block FP8 (the test above)."""
    planted = planted_outliers(probe_model.build(CACHE)[0], tmp_path / "planted")
    out = tmp_path / "out"
    choice = _graft_auto(planted, _fp8_mtp_target(planted, tmp_path / "target"), out, prompts)
    rows = _rows(choice)
    assert rows["fp8-block"]["agreement_change"][0] < -0.01 and rows["fp8-block"]["bytes"] < rows["as stored"]["bytes"]
    assert choice["chosen"] == "as stored" and "fp8-block -0." in choice["why"], choice["why"]
    report = json.loads((out / "graft-report.json").read_text())
    assert report["mtp_storage"] == "as the source stores it"
    written = _probe_written(out, prompts, tmp_path)["drafts"][0]
    assert written["agreement"] == rows["as stored"]["agreement"] and written["kl"] == rows["as stored"]["kl"]


def test_gguf_type_auto_writes_the_sidecar_whose_bytes_the_table_measured(prompts, tmp_path):
    """The GGUF rows decode the sidecar's own bytes: the sidecar auto writes holds, for every MTP tensor, the
    values its row measured; the manifest records the table."""
    import gguf
    import numpy as np

    from ckpt_tools.api.mtp_choice import encode_mtp
    from ckpt_tools.io.checkpoint import Checkpoint
    from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

    trained, _ = probe_model.build(CACHE)
    trunk = write_trunk_gguf(trained, tmp_path / "trunk.gguf", tensors=False)
    out = tmp_path / "out"
    ckpt("extract", trained, "--format", "gguf", "--gguf-trunk", trunk, "-o", out, "--gguf-type", "auto",
         "--prompts", prompts, *MEASURE)
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    choice = manifest["mtp_quant_auto"]
    rows = _rows(choice)
    assert list(rows) == ["as stored", "gguf-f32", "gguf-f16", "gguf-bf16", "gguf-q8_0"]
    assert all(r["status"] == "measured" for r in rows.values())
    # the smallest within 0.01 at every depth: q8_0 on the tiny verifier (its rows fall back to F16 where the
    # columns are not whole blocks of 32, as llama.cpp's converter does)
    assert choice["chosen"] == "gguf-q8_0" and manifest["gguf_type"] == "q8_0", choice["why"]
    assert rows["gguf-q8_0"]["bytes"] < rows["gguf-f16"]["bytes"] < rows["gguf-f32"]["bytes"]
    with Checkpoint.open(trained) as ck:
        decoded = {k: np.frombuffer(bytes(ts[0].recipe.produce()[0]), np.float32).reshape(ts[0].shape)
                   for k, (ts, _) in encode_mtp(ck, "gguf-q8_0").items()}
    reader = gguf.GGUFReader(out / manifest["file"]["name"])
    compared = 0
    for t in reader.tensors:
        meta = manifest["tensors"][t.name]
        if "split" in meta or not set(meta["source"]) <= decoded.keys():
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        assert np.array_equal(values, np.stack([decoded[k] for k in meta["source"]]).reshape(values.shape)), t.name
        compared += 1
    assert compared >= 15


def test_auto_without_prompts_is_refused(tmp_path):
    trained, _ = probe_model.build(CACHE)
    r = ckpt("graft", trained, trained, "-o", tmp_path / "o", "--mtp-quant", "auto", code=2)
    assert "[mtp-quant-auto]" in r.output and "--prompts FILE" in r.output and not (tmp_path / "o").exists()
    r = ckpt("extract", trained, "--format", "gguf", "--gguf-trunk", tmp_path / "t.gguf", "-o", tmp_path / "g",
             "--gguf-type", "auto", code=2)
    assert "[mtp-quant-auto]" in r.output and "--gguf-type auto" in r.output and not (tmp_path / "g").exists()
    r = ckpt("graft", trained, trained, "-o", tmp_path / "o", "--mtp-quant", "fp8-block", "--prompts",
             tmp_path / "p", code=2)
    assert "--prompts measures for --mtp-quant auto only" in r.output


def test_a_scheme_table_may_not_take_a_gguf_row_name(tmp_path):
    from ckpt_tools.errors import TableError
    from ckpt_tools.model.quant import all_schemes
    from ckpt_tools.model.quant.tables import quant_dirs, register_scheme_dir, unregister_scheme_dir

    shipped = next(d for d in quant_dirs() if (d / "fp8-block.yaml").is_file())
    text = (shipped / "fp8-block.yaml").read_text().replace("scheme: fp8-block", "scheme: gguf-q8_0")
    (tmp_path / "gguf-q8_0.yaml").write_text(text)
    register_scheme_dir(tmp_path)
    try:
        with pytest.raises(TableError, match="GGUF sidecar types"):
            all_schemes()
    finally:
        unregister_scheme_dir(tmp_path)
