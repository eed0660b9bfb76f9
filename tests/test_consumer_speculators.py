"""A real consumer: speculators 0.9.0 (PyPI), in its own virtual environment (make speculators-venv).

For Qwen3-Next and Qwen3.5-MoE fixtures, inside that environment:
- `SpeculatorModel.from_pretrained` loads our `extract --format speculators` output (exactly our
  weights) and runs a forward pass;
- speculators' own MTPConverter converts the same verifier; its config equals ours (but for
  auto_map / versions: we write no code file);
- both drafts are "trained" identically (same step on every MTP weight, saved with
  save_pretrained, as a training epoch folder is), and `ckpt stitch` of either into the verifier
  gives byte-identical checkpoints in which exactly the MTP tensors changed.
Skipped, with the build log's tail as the reason, only when the environment could not be built.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from consumer_venv import speculators_python, venv_env
from safetensors import safe_open

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.mtp import open_mtp

from conftest import run_ckpt as ckpt

SCRIPT = Path(__file__).resolve().parent / "consumers" / "speculators_check.py"
NOT_OURS = ("auto_map", "speculators_version", "transformers_version")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_python() -> Path:
    return speculators_python()


def tensors(path: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes() for k in fh.keys()})
    return out


FAMILIES = ["qwen3_next", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def reports(spec_python, make_fixture, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Per family: its folder (the verifier, ``ours``, speculators' ``work``) and the script's report. Both
    families' checks run in one venv subprocess (importing speculators takes 10-20 s), each in its folder."""
    root = tmp_path_factory.mktemp("spec-consumer")
    jobs = []
    for family in FAMILIES:
        d = root / family
        shutil.copytree(make_fixture(family), d / family)
        with pytest.MonkeyPatch.context() as m:
            m.chdir(d)  # relative names: the configs name the verifier as given
            ckpt("extract", family, "-o", "ours", "--format", "speculators")
        jobs.append({"cwd": str(d), "verifier": family, "ours": "ours", "work": "work"})
    r = subprocess.run([str(spec_python), str(SCRIPT), "--jobs", json.dumps(jobs)], cwd=root, env=venv_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('{"class": ')]  # each job's report, in order
    return {f: (root / f, json.loads(line)) for f, line in zip(FAMILIES, lines, strict=True)}


@pytest.mark.parametrize("family", FAMILIES)
def test_speculators_loads_converts_and_stitches_like_us(family, reports, monkeypatch):
    folder, report = reports[family]
    monkeypatch.chdir(folder)  # relative names: the configs name the verifier as given

    assert report["class"] == "MTPDraftModel"
    assert report["not_loaded"] == []  # every tensor of ours, bit for bit
    fwd = report["forward"]
    assert fwd["finite"] and fwd["steps"] == 3 and fwd["logits_shape"][-1] > 0

    theirs = {k: v for k, v in report["theirs_config"].items() if k not in NOT_OURS}
    assert json.loads((folder / "ours" / "config.json").read_text()) == theirs

    for name in ("ours-trained", "theirs-trained"):
        ckpt("stitch", folder / "work" / name, family, "-o", f"stitched-{name}")
    a, b = folder / "stitched-ours-trained", folder / "stitched-theirs-trained"
    files = sorted(p.name for p in a.iterdir() if p.name not in ("ckpt_manifest.json", "stitch-report.json"))
    assert files == sorted(p.name for p in b.iterdir() if p.name not in ("ckpt_manifest.json", "stitch-report.json"))
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f

    before, after = tensors(folder / family), tensors(a)
    assert set(after) == set(before)
    changed = {k for k in after if after[k] != before[k]}
    assert changed == set(open_mtp(Checkpoint.open(folder / family)).keys())
