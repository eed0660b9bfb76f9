"""A draft's evidence travels with it: `ckpt probe --report --plot` then `ckpt push` (issue 36).

The report is made by running the transformers engine on the tiny trained verifier (tests/probe_model.py),
never written by hand; the card is pushed to the Hub-protocol test server (tests/hubserver.py) and parsed back
with huggingface_hub (``ModelCard``, ``data.eval_results``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import types

import pytest

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools.ops.probe import vllm as probe_vllm  # noqa: E402
from ckpt_tools.ops.shared.tensors_digest import tensors_digest  # noqa: E402

from hubserver import serve_hub  # noqa: E402

DEPTH = 2


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """The trained verifier, a draft extracted from it, and `ckpt probe VERIFIER --draft D --report R --plot P`."""
    verifier, _ = probe_model.build(CACHE)
    work = tmp_path_factory.mktemp("probe-push")
    draft = work / "draft"
    ckpt("extract", verifier, "-o", draft)
    prompts = probe_model.write_prompts(work, 4, 6, seed=7)
    report, plot = work / "out" / "r.json", work / "out" / "p.png"
    report.parent.mkdir()
    ckpt("probe", verifier, "--draft", draft, "--prompts", prompts, "--max-new-tokens", 16, "--depth", DEPTH,
         "--report", report, "--plot", plot)
    return {"verifier": verifier, "draft": draft, "prompts": prompts, "report": report, "plot": plot,
            "json": json.loads(report.read_text())}


def card_of(hub, repo: str):
    from huggingface_hub import ModelCard

    text = hub.state.files(repo)["README.md"].decode()
    return ModelCard(text), text


def metrics_of(card) -> dict[str, float]:
    return {r.metric_type: r.metric_value for r in card.data.eval_results}


def expected_metrics(entry: dict) -> dict[str, float]:
    out = {f"acceptance@{k}": a for k, a in enumerate(entry["agreement"], 1)}
    out |= {f"kl@{k}": v for k, v in enumerate(entry["kl"], 1)}
    out |= {"expected_accepted_tokens": entry["expected_accepted"], "positions": entry["positions"]}
    return out


def vllm_spec(text: str, title: str) -> dict:
    """The --speculative-config JSON of the card's command titled ``title``."""
    block = text.split(f"{title}:\n\n```bash\n", 1)[1].split("```", 1)[0]
    return json.loads(re.search(r"--speculative-config '([^']*)'", block).group(1))


def test_the_report_names_the_tensors_measured_and_the_conditions(measured):
    out = measured["json"]
    verifier, draft = out["drafts"]
    assert verifier["tensors"] == tensors_digest(measured["verifier"]).to_json()
    assert draft["tensors"]["sha256"] == tensors_digest(measured["draft"]).sha256
    assert draft["tensors"]["from_manifest"] == draft["tensors"]["tensors"] > 0  # the extract's manifest vouched
    assert (out["dtype"], out["device"], out["max_new_tokens"]) == ("fp32", "cpu", 16)
    import hashlib

    assert out["prompts_sha256"] == hashlib.sha256(measured["prompts"].read_bytes()).hexdigest()
    assert out["plot"] == "p.png"  # relative to the report: they travel together


def test_the_tensors_digest_is_the_same_with_or_without_a_manifest_and_sees_a_changed_tensor(measured, tmp_path):
    with_manifest = tensors_digest(measured["draft"])
    copy = tmp_path / "copy"
    shutil.copytree(measured["draft"], copy)  # new inodes: the manifest's digests are not taken over
    plain = tensors_digest(copy)
    assert plain.from_manifest == 0 and plain.sha256 == with_manifest.sha256
    import torch
    from safetensors.torch import load_file

    (tmp_path / "bin").mkdir()  # the same tensors in another format: the same digest
    torch.save(load_file(next(measured["draft"].glob("*.safetensors"))), tmp_path / "bin" / "pytorch_model.bin")
    assert tensors_digest(tmp_path / "bin").sha256 == with_manifest.sha256
    swapped = probe_model.edited(measured["draft"], tmp_path / "swapped", probe_model.swap_eh_proj_halves)
    assert tensors_digest(swapped).sha256 != with_manifest.sha256


def test_push_a_probed_draft_card_carries_the_reports_numbers_the_plot_and_the_serve_commands(hub, measured):
    r = ckpt("push", measured["draft"], "me/draft", "--probe-report", measured["report"], "--json")
    plan = json.loads(r.stdout)
    got = hub.state.files("me/draft")
    # the report and its plot (found beside it, as the report names it) went up with the checkpoint, byte for byte
    assert got["probe-report.json"] == measured["report"].read_bytes()
    assert got["probe-plot.png"] == measured["plot"].read_bytes()
    assert {o["path"] for o in plan["operations"] if o["op"] == "add"} >= {"probe-report.json", "probe-plot.png"}
    assert plan["probe"] == {"report": "probe-report.json", "plot": "probe-plot.png", "measured": [
        str(measured["draft"])], "tensors_sha256": measured["json"]["drafts"][1]["tensors"]["sha256"]}
    card, text = card_of(hub, "me/draft")
    report = measured["json"]
    assert metrics_of(card) == expected_metrics(report["drafts"][1])  # the draft's numbers, not the verifier's
    first = card.data.eval_results[0]
    assert first.dataset_revision == report["prompts_sha256"]
    assert first.dataset_args == {"prompts": 4, "max_new_tokens": 16}
    assert first.metric_args["engine"] == "transformers" and first.metric_args["engine_version"] == \
        transformers.__version__
    assert (first.metric_args["dtype"], first.metric_args["device"]) == ("fp32", "cpu")
    assert first.metric_args["tensors_sha256"] == report["drafts"][1]["tensors"]["sha256"]
    assert "![acceptance per depth](probe-plot.png)" in text
    assert "| draft (this checkpoint) |" in text and "| the verifier's own MTP |" in text
    assert str(measured["draft"].parent) not in text  # local paths stay local
    spec = vllm_spec(text, "vLLM, after stitching the draft back into the verifier (`ckpt stitch`)")
    assert spec == {"method": probe_vllm.SPEC_METHOD, "num_speculative_tokens": DEPTH}
    assert "--speculative-algorithm NEXTN --speculative-draft-model-path me/draft" in text


def test_push_a_probed_verifier_with_its_report_inside(hub, measured, tmp_path):
    d = tmp_path / "verifier"
    shutil.copytree(measured["verifier"], d)
    shutil.copy(measured["report"], d / "probe-report.json")
    shutil.copy(measured["plot"], d / "p.png")  # the name the report gives, beside it
    r = ckpt("push", d, "me/verifier")
    assert "probe report: probe-report.json (measured these tensors as verifier), plot p.png" in " ".join(
        r.output.split())
    card, text = card_of(hub, "me/verifier")
    assert metrics_of(card) == expected_metrics(measured["json"]["drafts"][0])
    assert "![acceptance per depth](p.png)" in text
    assert hub.state.files("me/verifier")["p.png"] == measured["plot"].read_bytes()
    spec = vllm_spec(text, "vLLM")
    assert spec == {"method": probe_vllm.SPEC_METHOD, "num_speculative_tokens": DEPTH}
    assert f"vllm serve me/verifier \\\n  --speculative-config '{json.dumps(spec)}'" in text
    assert "--speculative-algorithm NEXTN --speculative-num-steps 2 --speculative-eagle-topk 1 " \
           "--speculative-num-draft-tokens 3" in text


def test_the_cards_vllm_config_is_what_probe_engine_vllm_passes(measured, tmp_path):
    """probe_vllm._serve with a stand-in vllm module: the speculative_config it gives vLLM's LLM is the card's."""
    seen: dict = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise RuntimeError("stop here")

    fake = types.SimpleNamespace(LLM=LLM)
    req = probe_vllm.ProbeRequest(str(measured["verifier"]), depth=DEPTH)
    with pytest.raises(Exception, match="stop here"):
        probe_vllm._serve(fake, measured["verifier"], DEPTH, [], req, probe_vllm.VllmOptions(), False)
    assert seen["speculative_config"] == {"method": probe_vllm.SPEC_METHOD, "num_speculative_tokens": DEPTH}


def test_a_report_of_other_tensors_is_refused_naming_both_digests(hub, measured, tmp_path):
    swapped = probe_model.edited(measured["draft"], tmp_path / "swapped", probe_model.swap_eh_proj_halves)
    r = ckpt("push", swapped, "me/swapped", "--probe-report", measured["report"], code=3)
    out = " ".join((r.output + (r.stderr or "")).split())
    assert "probe-report-stale" in out
    assert measured["json"]["drafts"][1]["tensors"]["sha256"] in out  # what the report measured
    assert tensors_digest(swapped).sha256 in out  # what is being pushed
    assert "me/swapped" not in hub.state.repos  # nothing was pushed


def test_the_plot_is_an_image_of_both_panels(measured):
    from PIL import Image

    from ckpt_tools.ops.probe.plot import DPI, SIZE

    with Image.open(measured["plot"]) as img:
        assert img.format == "PNG"
        assert img.size == (int(SIZE[0] * DPI), int(SIZE[1] * DPI))
        gray = img.convert("L")
        inked = sum(gray.histogram()[:200])  # pixels darker than light grey
    assert inked > 0.01 * img.size[0] * img.size[1]  # axes, lines and text: not a blank canvas


def test_plot_without_matplotlib_exits_2_naming_the_extra(measured, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    r = ckpt("probe", measured["verifier"], "--plot", tmp_path / "p.png", code=2)
    assert "ckpt-tools[plot]" in r.output + (r.stderr or "")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m3", "pangu_ultra_moe"])
def test_serving_commands_follow_the_family_tables_engines(family):
    from ckpt_tools.model.model_card import SGLANG_KEYS, VLLM_KEYS, CardFacts, serving_snippets
    from ckpt_tools.model.tables.loader import all_tables

    table = all_tables()[family]
    facts = CardFacts("me/x", "checkpoint", family, 3, engines=dict(table.engines),
                      vllm_method=probe_vllm.SPEC_METHOD)
    titles = [t for t, _ in serving_snippets(facts)]
    assert ("vLLM" in titles) == any(k in table.engines for k in VLLM_KEYS)
    assert ("SGLang" in titles) == any(k in table.engines for k in SGLANG_KEYS)
    assert titles  # every one of these tables lists at least vLLM


def test_without_a_report_the_card_has_no_eval_results(hub, measured, tmp_path):
    d = tmp_path / "draft"
    shutil.copytree(measured["draft"], d)
    ckpt("push", d, "me/plain")
    card, text = card_of(hub, "me/plain")
    assert not card.data.eval_results and "Measured acceptance" not in text
    assert os.path.basename(measured["plot"]) not in text


def test_a_kept_readme_is_said_to_lack_the_numbers(hub, measured, tmp_path):
    d = tmp_path / "draft"
    shutil.copytree(measured["draft"], d)
    (d / "README.md").write_text("# my own card\n")
    r = ckpt("push", d, "me/own", "--probe-report", measured["report"], "--dry-run", "--json")
    assert any("probe report's numbers are not in the card" in n for n in json.loads(r.stdout)["notes"])


@pytest.mark.parametrize(("field", "value", "named"), [
    ("kl", None, "drafts[1].kl[0] (depth 1) is null, not a finite number"),
    ("kl", "inf", 'drafts[1].kl[1] (depth 2) is "inf", not a finite number'),
    ("agreement", "0.5", 'drafts[1].agreement[0] (depth 1) is "0.5", not a share in [0, 1]'),
    ("positions", 3.5, "drafts[1].positions is 3.5, not a count"),
    ("expected_accepted", None, "drafts[1].expected_accepted is null, not a finite number"),
])
def test_a_report_whose_numbers_are_not_numbers_is_refused_naming_the_file_and_field(measured, tmp_path, field,
                                                                                       value, named):
    """A report edited by hand (or by another tool) that still names these tensors: push refuses it (exit 3,
    [probe-report]) naming the report and the field, instead of crashing on the card's formatting (exit 5)."""
    report = json.loads(measured["report"].read_text())
    entry = report["drafts"][1]
    if field in ("kl", "agreement"):
        entry[field][0 if value is None or field == "agreement" else DEPTH - 1] = value
    else:
        entry[field] = value
    bad = tmp_path / "edited-report.json"
    bad.write_text(json.dumps(report))
    r = ckpt("push", measured["draft"], "me/draft", "--probe-report", bad, "--dry-run", code=3)
    out = " ".join((r.output + (r.stderr or "")).split())
    assert "[probe-report]" in out and str(bad) in out and named in out
