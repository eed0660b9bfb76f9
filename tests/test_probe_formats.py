"""`ckpt probe` across draft formats, on the tiny trained DeepSeek-V3-layout verifier (tests/probe_model.py).

A draft that went through another format (and back through stitch) must measure exactly like the
verifier's own MTP; a draft whose gate/up halves a trainer swapped must show a larger KL.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402

CACHE = Path(tempfile.gettempdir()) / "ckpt-tools-test-cache"


@pytest.fixture(scope="module")
def trained() -> Path:
    d, _ = probe_model.build(CACHE)
    return d


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(11)
    x = probe_model.sample(3, 6, g)
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in x))
    return p


def probe_json(verifier, prompts, *drafts) -> dict:
    args = ["probe", verifier, "--prompts", prompts, "--max-new-tokens", 12, "--depth", 1, "--json"]
    for d in drafts:
        args += ["--draft", d]
    return json.loads(ckpt(*args).stdout)


def _numbers(entry: dict) -> tuple:
    return entry["agreement"], entry["kl"], entry["positions"], entry["greedy_equal"]


@pytest.fixture(scope="module")
def drafts(trained, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for fmt in ("native", "sglang-nextn"):
        out[fmt] = root / fmt
        ckpt("extract", trained, "-o", out[fmt], "--format", fmt)
    return out


def test_deepseek_v3_is_listed_without_speculators_and_extract_refuses_it(trained, tmp_path):
    r = ckpt("extract", trained, "-o", tmp_path / "spec", "--format", "speculators", code=3)
    assert "format-unsupported" in r.output and "deepseek_v3" in r.output
    assert not (tmp_path / "spec" / "model.safetensors").exists()


def test_one_draft_in_two_formats_measures_identically_to_the_verifier(trained, prompts, drafts):
    out = probe_json(trained, prompts, drafts["native"], drafts["sglang-nextn"])
    v, native, nextn = out["drafts"]
    assert [d["name"] for d in out["drafts"]] == ["verifier", str(drafts["native"]), str(drafts["sglang-nextn"])]
    assert v["agreement"][0] >= 0.8 and v["greedy_equal"] is True
    assert v["positions"] == 3 * 12
    assert _numbers(native) == _numbers(v)
    assert _numbers(nextn) == _numbers(v)


def test_sglang_nextn_draft_stitched_back_measures_identically(trained, prompts, drafts, tmp_path):
    stitched = tmp_path / "stitched"
    ckpt("stitch", drafts["sglang-nextn"], trained, "-o", stitched)
    [base] = probe_json(trained, prompts)["drafts"]
    [again] = probe_json(stitched, prompts)["drafts"]
    assert _numbers(again) == _numbers(base)
