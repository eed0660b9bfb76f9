"""`ckpt push` of a GGUF MTP sidecar directory (`ckpt extract --format gguf`): validated as GGUF (the sidecar
against the family's table and against its trunk), and a card that names the trunk, carries the
`ckpt probe --engine llama.cpp --report` numbers and the llama.cpp commands (issue 41).

The report is written by `ckpt probe --engine llama.cpp` against the stand-in llama-speculative-simple of
tests/test_consumer_llama_cpp.py (its counters, no llama.cpp build needed); the card is pushed to the
Hub-protocol test server (tests/hubserver.py) and parsed back with huggingface_hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from ckpt_tools.testing import make_checkpoint
from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

from conftest import run_ckpt as ckpt
from hubserver import serve_hub

gguf = pytest.importorskip("gguf")

FAKE_SOURCE = Path(__file__).resolve().parent / "test_consumer_llama_cpp.py"


def _fake_binary() -> str:
    """The stand-in llama-speculative-simple's source, as test_consumer_llama_cpp defines it."""
    text = FAKE_SOURCE.read_text()
    return text.split("FAKE = r'''", 1)[1].split("'''", 1)[0]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory) -> dict:
    """A GLM-4-MoE fixture, a trunk GGUF for it, our sidecar directory, and a llama.cpp probe report of it inside."""
    work = tmp_path_factory.mktemp("push-gguf")
    src = make_checkpoint("glm4_moe", work / "src")
    (work / "trunk").mkdir()
    trunk = write_trunk_gguf(src, work / "trunk" / "trunk.gguf")
    out = work / "out"
    ckpt("extract", src, "--format", "gguf", "--gguf-trunk", trunk, "-o", out)
    [mtp] = sorted(out.glob("mtp-*.gguf"))
    llama = work / "llama"
    (llama / "bin").mkdir(parents=True)
    binary = llama / "bin" / "llama-speculative-simple"
    binary.write_text(_fake_binary().replace("PYTHON", sys.executable))
    binary.chmod(0o755)
    (work / "t.txt").write_text("ab\n")
    (work / "reports").mkdir()
    os.environ["FAKE_CALLS"] = str(work / "calls")
    try:
        ckpt("probe", trunk, "--engine", "llama.cpp", "--llama-cpp", llama, "--prompts", work / "t.txt",
             "--max-new-tokens", "3", "--draft", mtp, "--report", work / "reports" / "r.json")
    finally:
        del os.environ["FAKE_CALLS"]
    report = work / "reports" / "r.json"
    return {"src": src, "trunk": trunk, "out": out, "mtp": mtp, "work": work, "report_path": report,
            "report": json.loads(report.read_text())}


def _copy(d: dict, dst: Path) -> Path:
    """The sidecar directory with the report inside (probe-report.json), mtimes kept: the measured files."""
    shutil.copytree(d["out"], dst, copy_function=shutil.copy2)
    shutil.copy2(d["report_path"], dst / "probe-report.json")
    return dst


def test_the_llama_cpp_report_names_no_tensor_digest(sidecar):
    [entry] = sidecar["report"]["drafts"]
    assert entry["tensors"] is None and entry["name"] == str(sidecar["mtp"])
    assert sidecar["report"]["engine"]["name"] == "llama.cpp"


def test_push_a_sidecar_card_names_the_trunk_carries_the_report_and_llama_cpps_commands(hub, sidecar):
    from huggingface_hub import ModelCard

    r = ckpt("push", sidecar["out"], "me/mtp", "--probe-report", sidecar["report_path"], "--json")
    plan = json.loads(r.stdout)
    assert plan["validation"] == {"ok": True, "problems": []}
    mtp = sidecar["mtp"]
    sha = hashlib.sha256(mtp.read_bytes()).hexdigest()
    assert plan["probe"]["gguf_sha256"] == sha and plan["probe"]["tensors_sha256"] is None
    assert plan["probe"]["measured"] == [str(mtp)]
    files = hub.state.files("me/mtp")
    assert set(files) - {".gitattributes"} == {mtp.name, "ckpt_manifest.json", "probe-report.json", "README.md"}
    text = files["README.md"].decode()
    card = ModelCard(text)
    assert card.data.library_name == "gguf" and {"gguf", "llama.cpp", "mtp-draft"} <= set(card.data.tags)
    entry = sidecar["report"]["drafts"][0]
    metrics = {e.metric_type: e.metric_value for e in card.data.eval_results}
    assert metrics == {"acceptance@1": entry["agreement"][0], "mean_acceptance_length":
                       entry["mean_acceptance_length"], "positions": entry["positions"]}
    assert all(e.metric_args["gguf_sha256"] == sha and "tensors_sha256" not in e.metric_args
               for e in card.data.eval_results)
    assert f"llama-server -m trunk.gguf -md {mtp.name} --spec-type draft-mtp --spec-draft-n-max 1" in text
    assert f"llama-speculative-simple -m trunk.gguf -md {mtp.name} --spec-type draft-mtp" in text
    assert "trunk (not in this repository): `trunk.gguf`" in text
    assert "each sidecar against the trunk `trunk.gguf`" in text
    assert f"matched to the pushed file by its bytes (sha256 `{sha}`)" in text
    assert "llama.cpp architecture: `glm4moe`" in text


def test_push_validates_the_sidecar_against_its_trunk(hub, sidecar, tmp_path):
    """A sidecar whose trunk has another vocabulary (the manifest's trunk replaced): refused, exit 3, the rule and
    key named; nothing pushed."""
    d = _copy(sidecar, tmp_path / "out")
    manifest = json.loads((d / "ckpt_manifest.json").read_text())
    other = write_trunk_gguf(sidecar["src"], tmp_path / "trunk.gguf",
                             overrides={"glm4moe.context_length": 12345})
    manifest["trunk"]["path"] = str(other)
    (d / "ckpt_manifest.json").write_text(json.dumps(manifest))
    r = ckpt("push", d, "me/bad", "--dry-run", code=3)
    assert "[gguf-pair]" in r.output and "glm4moe.context_length" in r.output
    assert "me/bad" not in hub.state.repos


def test_push_a_sidecar_whose_mtp_tensors_are_missing_is_refused(hub, sidecar, tmp_path):
    """The GGUF checks judge the pushed file: a sidecar lacking an MTP tensor is refused (gguf-mtp-missing)."""
    d = tmp_path / "out"
    d.mkdir()
    shutil.copy2(sidecar["out"] / "ckpt_manifest.json", d)
    reader = gguf.GGUFReader(sidecar["mtp"])
    w = gguf.GGUFWriter(d / sidecar["mtp"].name, "glm4moe")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if not t.name.endswith("nextn.eh_proj.weight"):
            w.add_tensor(t.name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = ckpt("push", d, "me/missing", "--dry-run", code=3)
    assert "[gguf-mtp-missing]" in r.output and "nextn.eh_proj" in r.output


def test_a_report_of_other_bytes_is_refused(hub, sidecar, tmp_path):
    """The file the report measured now holds other bytes (re-extracted as Q8_0 over it): probe-report-stale,
    naming the file's sha256 now; nothing pushed."""
    d = _copy(sidecar, tmp_path / "out")
    report = json.loads((d / "probe-report.json").read_text())
    measured = tmp_path / "measured.gguf"
    measured.write_bytes(b"GGUF other bytes")
    report["drafts"][0]["name"] = str(measured)
    (d / "probe-report.json").write_text(json.dumps(report))
    r = ckpt("push", d, "me/stale", "--dry-run", code=3)
    assert "[probe-report-stale]" in r.output and "measured.gguf: sha256" in r.output
    assert "me/stale" not in hub.state.repos


def test_a_report_older_than_the_file_it_names_is_refused(hub, sidecar, tmp_path):
    """The measured file was written again after the report (its bytes may have been others when measured)."""
    d = _copy(sidecar, tmp_path / "out")
    report = json.loads((d / "probe-report.json").read_text())
    measured = tmp_path / "measured.gguf"
    shutil.copyfile(sidecar["mtp"], measured)
    report["drafts"][0]["name"] = str(measured)
    (d / "probe-report.json").write_text(json.dumps(report))
    t = (d / "probe-report.json").stat().st_mtime
    os.utime(measured, (t + 10, t + 10))
    r = ckpt("push", d, "me/later", "--dry-run", code=3)
    assert "[probe-report-stale]" in r.output and "modified after the report was written" in r.output


def test_push_without_the_trunk_at_hand_says_the_pair_was_not_checked(hub, sidecar, tmp_path):
    """The manifest's trunk is not on this machine: the sidecar is checked against its table only, and the card
    says so (and still names the trunk by its file name)."""
    d = _copy(sidecar, tmp_path / "out")
    manifest = json.loads((d / "ckpt_manifest.json").read_text())
    manifest["trunk"]["path"] = str(tmp_path / "elsewhere" / "trunk.gguf")
    (d / "ckpt_manifest.json").write_text(json.dumps(manifest))
    r = ckpt("push", d, "me/alone", "--dry-run", "--json")
    plan = json.loads(r.stdout)
    assert plan["validation"]["ok"] is True
    ckpt("push", d, "me/alone")
    text = hub.state.files("me/alone")["README.md"].decode()
    assert "the trunk was not at hand, so the pair was not checked" in text
    assert "checked against its family's table only: not against a trunk" in text
    assert "llama-server -m trunk.gguf -md" in text
