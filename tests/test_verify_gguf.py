"""`ckpt verify-manifest` of a GGUF sidecar directory: every tensor of the sidecar against the manifest's type,
shape and BLAKE3 of its data; a changed byte, an unlisted or missing tensor, another size: exit 1, named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools import extract_gguf
from ckpt_tools.io.gguf_file import read_gguf
from ckpt_tools.testing import make_checkpoint
from ckpt_tools.testing.gguf_trunk import write_trunk_gguf


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("verify-gguf")
    src = make_checkpoint("glm4_moe", d / "src")
    out = d / "out"
    extract_gguf(src, out, write_trunk_gguf(src, d / "trunk.gguf"))
    return out


def _verify(path: Path) -> tuple[int, dict]:
    run = subprocess.run([sys.executable, "-m", "ckpt_tools", "verify-manifest", str(path), "--json"],
                         capture_output=True, text=True)
    return run.returncode, json.loads(run.stdout)


def _copy(sidecar: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "copy"
    shutil.copytree(sidecar, out)
    return out, next(out.glob("*.gguf"))


def test_an_untouched_sidecar_verifies_every_tensor(sidecar):
    code, report = _verify(sidecar)
    tensors = read_gguf(next(sidecar.glob("*.gguf"))).tensors
    assert code == 0 and report["ok"]
    assert report["listed"] == report["verified"] == len(tensors) > 10
    assert report["bytes_hashed"] == sum(t.nbytes for t in tensors.values())


def test_one_changed_byte_is_named_by_its_tensor(sidecar, tmp_path):
    out, gguf = _copy(sidecar, tmp_path)
    t = max(read_gguf(gguf).tensors.values(), key=lambda t: t.nbytes)
    with open(gguf, "r+b") as f:
        f.seek(t.offset + t.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    code, report = _verify(out)
    assert code == 1 and not report["ok"]
    assert [(m["key"], m["problem"]) for m in report["mismatches"]] == [(t.name, "digest")]
    assert report["verified"] == report["listed"] - 1


def test_an_unlisted_tensor_a_wrong_shape_and_a_missing_file_are_found(sidecar, tmp_path):
    out, gguf = _copy(sidecar, tmp_path)
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    dropped, reshaped = sorted(manifest["tensors"])[:2]
    del manifest["tensors"][dropped]
    manifest["tensors"][reshaped]["shape"] = [1, 2, 3]
    (out / "ckpt_manifest.json").write_text(json.dumps(manifest))
    code, report = _verify(out)
    assert code == 1
    assert {(m["key"], m["problem"]) for m in report["mismatches"]} == {(dropped, "unlisted"), (reshaped, "shape")}
    gguf.unlink()
    code, report = _verify(out)
    assert code == 1 and [m["problem"] for m in report["mismatches"]] == ["missing"]


def test_a_longer_file_is_a_size_mismatch(sidecar, tmp_path):
    out, gguf = _copy(sidecar, tmp_path)
    with open(gguf, "ab") as f:
        f.write(b"\0" * 32)
    code, report = _verify(out)
    assert code == 1 and [m["problem"] for m in report["mismatches"]] == ["file-size"]
