"""``ckpt_tools.probe`` (api/measure.py) and ``ckpt probe`` over it, on the tiny trained verifier (probe_model).

The CLI calls the public function with the options it parsed; its ``--json`` equals ``report.to_json()`` of a
direct call; a failed check (``--min-acceptance`` not met) is ``CheckFailed`` carrying the report, exit 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ckpt_tools
from ckpt_tools.api.report import Report
from ckpt_tools.errors import CheckFailed, UsageError

from conftest import run_ckpt

pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools.ops.probe import probe as probe_ops  # noqa: E402


@dataclass
class _Recorded(Report):
    def to_json(self) -> dict[str, Any]:
        return {"recorded": "probe"}


def test_the_cli_calls_the_public_function(monkeypatch, tmp_path):
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(ckpt_tools.api, "probe", lambda *a, **k: calls.append((a, k)) or _Recorded())
    r = run_ckpt("probe", tmp_path / "v", "--draft", tmp_path / "a", "--draft", tmp_path / "b", "--prompts",
                 tmp_path / "p.jsonl", "--max-new-tokens", 5, "--depth", 2, "--device", "auto", "--dtype", "bf16",
                 "--chain", "vllm", "--min-acceptance", 0.5, "--report", tmp_path / "r.json", "--arch", "deepseek_v3",
                 "--json")
    assert json.loads(r.stdout) == {"recorded": "probe"}
    [(args, kwargs)] = calls
    assert args == (str(tmp_path / "v"),)
    assert kwargs == {"drafts": [str(tmp_path / "a"), str(tmp_path / "b")], "prompts": str(tmp_path / "p.jsonl"),
                      "max_new_tokens": 5, "depth": 2, "device": "auto", "dtype": "bf16", "chain": "vllm",
                      "min_acceptance": 0.5, "report": tmp_path / "r.json", "arch": "deepseek_v3",
                      "progress": False, "engine": "transformers", "tensor_parallel_size": 1,
                      "pipeline_parallel_size": 1, "distributed_executor_backend": None, "work_dir": None,
                      "max_model_len": None, "attention_backend": None, "plot": None,
                      "llama_cpp": None, "threads": 1, "mtp_quant": None}


def test_json_is_the_reports_to_json(tmp_path):
    verifier, _ = probe_model.build(CACHE)
    prompts = probe_model.write_prompts(tmp_path, 2, 6, seed=7)
    by_cli = json.loads(run_ckpt("probe", verifier, "--prompts", prompts, "--max-new-tokens", 4, "--json").stdout)
    report = ckpt_tools.probe(verifier, prompts=prompts, max_new_tokens=4, report=tmp_path / "probe.json")
    assert report.to_json() == by_cli
    assert json.loads((tmp_path / "probe.json").read_text()) == by_cli
    assert [d.name for d in report.drafts] == ["verifier"] and report.drafts[0].greedy_equal


def test_min_acceptance_not_met_is_check_failed_with_the_report(monkeypatch, tmp_path):
    verifier = probe_ops.DraftResult("verifier", [0.9], [0.01], 16, True)
    low = probe_ops.DraftResult("./low", [0.6], [0.2], 16, True)
    monkeypatch.setattr(probe_ops, "probe", lambda req, progress=None, announce=None:
                        probe_ops.ProbeResult([verifier, low], 3, 10))
    r = run_ckpt("probe", tmp_path, "--draft", "./low", "--min-acceptance", 0.8, "--json", code=1)
    with pytest.raises(CheckFailed) as e:
        ckpt_tools.probe(tmp_path, drafts=["./low"], min_acceptance=0.8)
    assert e.value.exit_code == 1
    report = e.value.report
    assert report.to_json() == json.loads(r.stdout)
    assert list(report.to_json()) == ["drafts", "prompts", "needed_bytes", "chain", "loaded", "mtp_loaded", "engine",
                                      "reference", "dtype", "device", "max_new_tokens", "prompts_sha256", "plot"]
    assert [d.name for d in report.below_min_acceptance()] == ["./low"]
    assert report.failures() == ["./low: depth-1 agreement 0.6000 is below --min-acceptance 0.8"]
    assert report.failures()[0] in r.stderr
    assert ckpt_tools.probe(tmp_path, drafts=["./low"], min_acceptance=0.6).failures() == []  # met: a report
    with pytest.raises(UsageError):  # out of range: refused before anything runs
        ckpt_tools.probe(Path("nowhere"), min_acceptance=1.5)
