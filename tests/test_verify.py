"""`ckpt verify-manifest`: every listed tensor's digest recomputed (streamed) and compared.
Exit 0 all match, 1 mismatches (each listed), 3 no manifest."""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
from pathlib import Path

import blake3
import pytest
import torch
from safetensors import safe_open

from ckpt_tools.ops.check.verify_manifest import verify_manifest
from ckpt_tools.stream.progress import Progress

from conftest import run_ckpt as ckpt


@pytest.fixture(scope="module")
def draft(make_fixture, tmp_path_factory):
    """An extract output (sharded, so the manifest's file names matter)."""
    out = tmp_path_factory.mktemp("verify") / "draft"
    ckpt("extract", make_fixture("deepseek_v3"), "-o", out, "--max-shard-size", "40KB", code=0)
    return out


@pytest.fixture
def copy(draft, tmp_path):
    import shutil

    d = tmp_path / "d"
    shutil.copytree(draft, d)
    return d


def manifest(d: Path) -> dict:
    return json.loads((d / "ckpt_manifest.json").read_text())


def tensor_location(d: Path, key: str) -> tuple[Path, int, int]:
    """(file, absolute offset, nbytes) of a tensor, read from the header with struct/json only."""
    f = d / manifest(d)["tensors"][key]["file"]
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    return f, 8 + n + begin, end - begin


def test_clean_output_verifies(draft):
    r = ckpt("verify-manifest", draft, "--json", code=0)
    rep = json.loads(r.output)
    m = manifest(draft)["tensors"]
    assert rep["ok"] and rep["verified"] == rep["listed"] == len(m) > 10
    assert rep["bytes_hashed"] == sum(tensor_location(draft, k)[2] for k in m)
    ckpt("verify-manifest", draft, code=0)


def test_hashes_agree_with_the_safetensors_library(draft):
    """The manifest's digest (BLAKE3) is of the tensor's raw bytes, as the library hands them out."""
    entries = manifest(draft)["tensors"]
    key = sorted(entries)[0]
    with safe_open(draft / entries[key]["file"], "pt") as f:
        t = f.get_tensor(key)
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert blake3.blake3(raw).hexdigest() == entries[key]["blake3"]


def test_a_flipped_byte_is_found_and_named(copy):
    key = sorted(manifest(copy)["tensors"])[3]
    f, off, n = tensor_location(copy, key)
    with open(f, "r+b") as fh:
        fh.seek(off + n // 2)
        b = fh.read(1)
        fh.seek(off + n // 2)
        fh.write(bytes([b[0] ^ 0x01]))
    rep = json.loads(ckpt("verify-manifest", copy, "--json", code=1).output)
    assert [(m["key"], m["problem"], m["file"]) for m in rep["mismatches"]] == [(key, "digest", f.name)]
    assert rep["verified"] == rep["listed"] - 1
    text = ckpt("verify-manifest", copy, code=1).output
    assert key in text and "blake3" in text and "mismatch" in text


def test_manifest_edits_are_reported(copy):
    m = manifest(copy)
    keys = sorted(m["tensors"])
    m["tensors"][keys[0]]["blake3"] = "0" * 64
    m["tensors"][keys[1]]["shape"] = [1, 2, 3]
    m["tensors"][keys[2]]["file"] = "elsewhere.safetensors"
    del m["tensors"][keys[3]]["blake3"]
    m["tensors"]["not.in.the.checkpoint"] = {"file": "x.safetensors", "sha256": "1" * 64}
    (copy / "ckpt_manifest.json").write_text(json.dumps(m))
    rep = json.loads(ckpt("verify-manifest", copy, "--json", code=1).output)
    found = {(x["key"], x["problem"]) for x in rep["mismatches"]}
    assert found == {(keys[0], "digest"), (keys[1], "shape"), (keys[2], "file"), (keys[3], "no-hash"),
                     ("not.in.the.checkpoint", "missing")}
    assert rep["unlisted"] == 0


@pytest.mark.parametrize(("content", "rule"), [
    (None, "no-manifest"),
    (b"{not json", "manifest-json"),
    (b"[1, 2]", "manifest-json"),
    (b'{"tensors": [1]}', "manifest-json"),
    (b"\xff\xfe", "manifest-json"),
])
def test_no_usable_manifest_is_exit_3(copy, content, rule):
    p = copy / "ckpt_manifest.json"
    if content is None:
        p.unlink()
    else:
        p.write_bytes(content)
    r = ckpt("verify-manifest", copy, code=3)
    assert f"[{rule}]" in r.output


class Recorder(Progress):
    def __init__(self) -> None:
        self.total = self.done = self.calls = 0

    def phase(self, name: str, total: int = 0) -> None:
        assert name == "hashing"
        self.total = total

    def advance(self, n: int) -> None:
        self.done += n
        self.calls += 1


def test_large_tensor_is_streamed_in_bounded_memory(tmp_path):
    """A 96 MB tensor (a sparse file: no disk space) is hashed with ~one chunk of memory, with progress.

    The manifest records sha256, as earlier versions wrote it: verify-manifest still checks those.
    """
    nbytes = 96 << 20
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    d = tmp_path / "big"
    d.mkdir()
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    h = hashlib.sha256()
    zeros = bytes(1 << 20)
    for _ in range(nbytes >> 20):
        h.update(zeros)
    (d / "ckpt_manifest.json").write_text(json.dumps(
        {"tensors": {"w": {"file": "model.safetensors", "dtype": "F32", "shape": [nbytes // 4],
                           "sha256": h.hexdigest()}}}))
    progress = Recorder()
    tracemalloc.start()
    try:
        rep = verify_manifest(d, progress=progress)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rep.ok and rep.verified == 1 and rep.bytes_hashed == nbytes
    assert progress.total == progress.done == nbytes and progress.calls > 1
    assert peak < 24 << 20, f"peak {peak / 1e6:.1f} MB while hashing {nbytes / 1e6:.0f} MB"
