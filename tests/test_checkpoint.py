"""Checkpoint.open: headers only, shard names confined to the directory, index and shards consistent."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.errors import EXIT_INPUT, InputError
from ckpt_tools.io.checkpoint import Checkpoint, open_lenient
from ckpt_tools.io.safetensors_io import IO_STATS

INDEX = "model.safetensors.index.json"


def copy_fixture(make_fixture, tmp_path: Path, family: str = "deepseek_v3", **kw) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(make_fixture(family, **kw), dst, symlinks=True)
    return dst


def edit_index(d: Path, fn) -> dict:
    index = json.loads((d / INDEX).read_text())
    fn(index)
    (d / INDEX).write_text(json.dumps(index))
    return index


def refused(d: Path, rule: str) -> InputError:
    with pytest.raises(InputError) as info:
        Checkpoint.open(d)
    assert info.value.rule == rule, str(info.value)
    assert f"[{rule}]" in str(info.value)
    result = CliRunner().invoke(app, ["inspect", str(d)])
    assert result.exit_code == EXIT_INPUT, result.output
    assert rule in result.output and "Traceback" not in result.output
    return info.value


def a_key(d: Path, shard_index: int = 0) -> tuple[str, str]:
    index = json.loads((d / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[shard_index]
    return next(k for k, s in index["weight_map"].items() if s == shard), shard


def test_open_reads_only_headers(make_fixture):
    d = make_fixture("deepseek_v3")
    IO_STATS.reset()
    ckpt = Checkpoint.open(d)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert sorted(ckpt.headers) == shards
    assert IO_STATS.bytes_read == sum(8 + h.header_len for h in ckpt.headers.values())
    assert IO_STATS.bytes_copied == 0
    index = json.loads((d / INDEX).read_text())
    assert set(ckpt.tensors) == set(index["weight_map"])
    for key, shard in list(index["weight_map"].items())[::7]:
        with safe_open(str(d / shard), framework="pt") as f:
            t = f.get_tensor(key)
        ref = ckpt.tensors[key]
        assert ckpt.shard_of(key) == shard
        assert bytes(ref.read()) == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_refuses_absolute_shard_name(make_fixture, tmp_path):
    d = copy_fixture(make_fixture, tmp_path)
    key, shard = a_key(d)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(d / shard, outside)
    edit_index(d, lambda ix: ix["weight_map"].__setitem__(key, str(outside)))
    err = refused(d, "shard-path")
    assert str(outside) in str(err)


def test_refuses_dotdot_shard_name(make_fixture, tmp_path):
    d = copy_fixture(make_fixture, tmp_path)
    key, shard = a_key(d)
    shutil.copy(d / shard, tmp_path / "outside.safetensors")
    edit_index(d, lambda ix: ix["weight_map"].__setitem__(key, "../outside.safetensors"))
    refused(d, "shard-path")


def test_refuses_symlink_resolving_outside(make_fixture, tmp_path):
    d = copy_fixture(make_fixture, tmp_path)
    key, shard = a_key(d)
    shutil.copy(d / shard, tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", d / "linked.safetensors")
    edit_index(d, lambda ix: ix["weight_map"].__setitem__(key, "linked.safetensors"))
    err = refused(d, "shard-path")
    assert "linked.safetensors" in str(err)


def test_refuses_missing_shard(make_fixture, tmp_path):
    d = copy_fixture(make_fixture, tmp_path)
    _, shard = a_key(d, 1)
    (d / shard).unlink()
    err = refused(d, "missing-shard")
    assert shard in str(err)


def test_refuses_key_its_shard_does_not_hold(make_fixture, tmp_path):
    d = copy_fixture(make_fixture, tmp_path)
    key, _ = a_key(d, 0)
    _, other = a_key(d, 1)
    edit_index(d, lambda ix: ix["weight_map"].__setitem__(key, other))
    err = refused(d, "index-key-missing")
    assert key in str(err) and other in str(err)


def _hf_cache(src: Path, root: Path, repo: str = "models--org--tiny", rev: str = "abc123") -> Path:
    """Lay ``src`` out like the Hugging Face cache: snapshot files link to ../../blobs/<sha256>."""
    blobs = root / repo / "blobs"
    snap = root / repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copy(p, blobs / digest)
        os.symlink(f"../../blobs/{digest}", snap / p.name)
    return snap


def test_accepts_hf_cache_snapshot(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    snap = _hf_cache(src, tmp_path / "hub")
    ckpt = Checkpoint.open(snap)
    plain = Checkpoint.open(src)
    assert set(ckpt.tensors) == set(plain.tensors)
    for key in list(plain.tensors)[::11]:
        assert ckpt.tensors[key].read() == plain.tensors[key].read()
    assert "tokenizer_config.json" in ckpt.files
    result = CliRunner().invoke(app, ["validate", str(snap)])
    assert result.exit_code == 0, result.output


def test_hf_cache_link_into_another_repo_is_refused(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    hub = tmp_path / "hub"
    snap = _hf_cache(src, hub)
    other = hub / "models--other--repo" / "blobs"
    other.mkdir(parents=True)
    _, shard = a_key(snap, 1)
    shutil.copy(snap / shard, other / "x")
    (snap / shard).unlink()
    os.symlink("../../../models--other--repo/blobs/x", snap / shard)
    refused(snap, "shard-path")


# -- Checkpoint.open and open_lenient: one code path ------------------------------------------------


def _shard(d: Path, i: int) -> str:
    return sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))[i]


def _break_header(d: Path, i: int) -> None:
    with open(d / _shard(d, i), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))  # a header length past every limit


BREAKS = {
    "config": lambda d: (d / "config.json").write_text("{"),
    "index": lambda d: (d / INDEX).write_text("["),
    "missing-shard": lambda d: (d / _shard(d, 1)).unlink(),
    "header": lambda d: _break_header(d, 0),
    "last-header": lambda d: _break_header(d, -1),
    "manifest": lambda d: (d / "ckpt_manifest.json").write_text('{"tensors": []}'),
}


@pytest.mark.parametrize("breaks", [["config"], ["index"], ["missing-shard"], ["header"], ["manifest"],
                                    ["missing-shard", "header"], ["config", "last-header", "manifest"]],
                         ids="+".join)
def test_open_refuses_with_the_first_problem_open_lenient_collects(breaks, make_fixture, tmp_path):
    """The strict open refuses with exactly the first problem the lenient one lists (rule, path, message),
    and the lenient one lists one problem per break, opening every shard it can read."""
    d = copy_fixture(make_fixture, tmp_path)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    for name in breaks:
        BREAKS[name](d)
    with pytest.raises(InputError) as info:
        Checkpoint.open(d)
    opened = open_lenient(d)
    try:
        strict, first = info.value, opened.errors[0]
        assert (strict.rule, strict.path, str(strict)) == (first.rule, first.path, str(first))
        assert len(opened.errors) == len(breaks), [str(e) for e in opened.errors]
        assert sorted(opened.ckpt.headers) == [s for s in shards if s not in opened.unreadable]
    finally:
        opened.ckpt.close()


def test_a_missing_shard_is_named_by_its_path(make_fixture, tmp_path):
    d = copy_fixture(make_fixture, tmp_path)
    shard = _shard(d, 1)
    (d / shard).unlink()
    err = refused(d, "missing-shard")
    assert err.path == str(d / shard)


def test_open_lenient_closes_the_file_of_a_shard_it_cannot_read(make_fixture, tmp_path):
    d = copy_fixture(make_fixture, tmp_path)
    _break_header(d, -1)
    opened = open_lenient(d)
    try:
        held = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
        assert opened.unreadable == [_shard(d, -1)]
        assert str((d / _shard(d, 0)).resolve()) in held  # the readable shards stay open for reading
        assert str((d / _shard(d, -1)).resolve()) not in held
    finally:
        opened.ckpt.close()


def test_the_index_and_headers_are_hashed_on_a_second_thread_as_they_are_parsed(make_fixture, monkeypatch):
    """Fingerprints need the sha256 of the index and of every header (20 MB at release scale): hashlib releases
    the GIL, so a second thread takes them while json parses; the digests are those of the bytes as stored."""
    import threading

    src = make_fixture("deepseek_v3")
    calls: list[tuple[int, int]] = []  # (thread, bytes hashed)
    sha256 = hashlib.sha256

    def recorded(data=b""):
        calls.append((threading.get_ident(), len(data)))
        return sha256(data)

    monkeypatch.setattr(hashlib, "sha256", recorded)
    with Checkpoint.open(src) as ckpt:
        monkeypatch.undo()
        for name, header in ckpt.headers.items():
            with open(src / name, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                assert header.sha256 == sha256(f.read(n)).hexdigest()
        assert ckpt.digests[INDEX] == sha256((src / INDEX).read_bytes()).hexdigest()
    here = [n for t, n in calls if t == threading.get_ident()]
    assert here == [(src / "config.json").stat().st_size]  # read before the index and the headers
    assert len(calls) == len(ckpt.headers) + 2
