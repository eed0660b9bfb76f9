"""--overwrite leaves exactly what the new run writes, side files included (issue 40, class 8).

A previous output's side files (ModelOpt's ``hf_quant_config.json``, a tokenizer of another model) must not
survive into the new one: a stale ``hf_quant_config.json`` made an F32 draft inspect as ``modelopt-fp8``.
The previous output here is a real producer's checkpoint (ModelOpt's FP8 export) with its MTP grafted back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpt_tools.io.artefacts import MANIFEST_NAME, RESUME_NAME
from ckpt_tools.stream import writer as writer_mod

from conftest import run_ckpt as ckpt

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
BASE = CORPUS / "transformers-deepseek_v3"
MODELOPT = CORPUS / "modelopt-fp8"


def names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """ModelOpt's FP8 export, with the tokenizer config a real release carries."""
    t = tmp_path / "target"
    shutil.copytree(MODELOPT, t)
    (t / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "OtherModelTokenizer"}))
    return t


def _fresh_extract(tmp_path: Path) -> set[str]:
    ref = tmp_path / "ref"
    ckpt("extract", BASE, "-o", ref, "--dtype", "fp32")
    return names(ref)


def test_overwrite_removes_the_previous_outputs_side_files(target, tmp_path):
    out = tmp_path / "out"
    ckpt("graft", BASE, target, "-o", out)
    assert {"hf_quant_config.json", "tokenizer_config.json", "graft-report.json"} <= names(out)
    (out / "notes.txt").write_text("mine\n")  # no run of ours wrote it: not ours to delete
    ckpt("extract", BASE, "-o", out, "--overwrite", "--dtype", "fp32")
    assert names(out) == _fresh_extract(tmp_path) | {"notes.txt"}
    report = json.loads(ckpt("inspect", out, "--json").stdout)
    assert report["quantization"] is None and report["mtp_quant"] is None  # was: modelopt-fp8, from the stale file
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert set(manifest["written"]) == names(out) - {"notes.txt"}


def test_overwrite_of_an_interrupted_run_removes_what_its_record_lists(target, tmp_path, monkeypatch):
    """A run stopped before its manifest leaves only its resume record: that record lists its side files."""
    out = tmp_path / "out"

    def fail(self, *a, **k):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(writer_mod.Writer, "_write_manifest", fail)
        ckpt("graft", BASE, target, "-o", out, code=4)
    assert MANIFEST_NAME not in names(out) and "hf_quant_config.json" in names(out)
    record = json.loads((out / RESUME_NAME).read_text())
    assert "hf_quant_config.json" in record["written"] and "tokenizer_config.json" in record["written"]
    ckpt("extract", BASE, "-o", out, "--overwrite", "--dtype", "fp32")
    assert names(out) == _fresh_extract(tmp_path)


def test_a_listed_name_leaving_the_output_is_never_removed(target, tmp_path):
    """A manifest is input like any other: a ``written`` entry outside the output is ignored."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    ckpt("extract", BASE, "-o", out)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["written"] += ["../victim.txt", str(victim), ".ckpt.lock"]  # and never the lock this run holds
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    ckpt("extract", BASE, "-o", out, "--overwrite", "--dtype", "fp32")
    assert victim.read_text() == "precious\n"
