"""Write failures (file size limit, full disk, a failing file object): exit 4, the file and the bytes
written are named, temporary files are removed, nothing incomplete is renamed into place, and the
inputs are untouched. A sharded output keeps its finished shards, so --resume finishes it later."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
from test_crash import INDEX, MANIFEST, SINGLE, assert_same_output, shared_zygote
from typer.testing import CliRunner

import ckpt_tools.stream.targets.local as writer
from ckpt_tools.cli import app

from conftest import tree_hash

runner = CliRunner()


@pytest.fixture
def zygote():
    return shared_zygote(torch=False)  # extract needs no torch


@pytest.fixture(scope="module")
def verifier(make_fixture):
    return make_fixture("deepseek_v3")


def extract(verifier: Path, out: Path, *extra: str, code: int = 0):
    r = runner.invoke(app, ["extract", str(verifier), "-o", str(out), *extra])
    assert "Traceback" not in r.output
    assert r.exit_code == code, r.output
    return r.output


def written_bytes(text: str) -> int:
    m = re.search(r"after (\d+) bytes", text)
    assert m, text
    return int(m.group(1))


def assert_clean_failure(out: Path, text: str, failed_file: str, what: str) -> None:
    """The message names the file, the cause and the bytes; no temporary file, marker or manifest."""
    flat = " ".join(text.split())  # rich wraps long messages
    assert "Traceback" not in text
    assert f"{out / failed_file}: write failed ({what})" in flat, text
    assert not list(out.rglob(".*.partial")), "temporary files left behind"
    assert not (out / INDEX).exists() and not (out / SINGLE).exists(), "a completion marker after a failure"
    assert not (out / MANIFEST).exists(), "a manifest after a failure"
    assert not (out / ".ckpt.lock").exists()


def test_file_size_limit_single_file(zygote, verifier, tmp_path):
    """RLIMIT_FSIZE in a real child process: the lone model.safetensors cannot be written."""
    before = tree_hash(verifier)
    out, log = tmp_path / "out", tmp_path / "log"
    code, _ = zygote.run(["extract", verifier, "-o", out], log, fsize=64 * 1024)
    text = log.read_text()
    assert code == 4, text
    assert_clean_failure(out, text, SINGLE, "file size limit exceeded")
    assert 0 < written_bytes(" ".join(text.split())) <= 64 * 1024
    assert tree_hash(verifier) == before


def test_file_size_limit_keeps_finished_shards_for_resume(zygote, verifier, tmp_path):
    ref, out, log = tmp_path / "ref", tmp_path / "out", tmp_path / "log"
    extract(verifier, ref, "--max-shard-size", "40KB")
    index = json.loads((ref / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    sizes = [(ref / s).stat().st_size for s in shards]
    # the first shard larger than every shard before it: those fit under the limit, it does not
    k = next(j for j in range(1, len(sizes)) if sizes[j] > max(sizes[:j]))
    limit = sizes[k] - 1
    before = tree_hash(verifier)
    code, _ = zygote.run(["extract", verifier, "-o", out, "--max-shard-size", "40KB"], log, fsize=limit)
    text = log.read_text()
    assert code == 4, text
    assert_clean_failure(out, text, shards[k], "file size limit exceeded")
    assert written_bytes(" ".join(text.split())) == limit
    for s in shards[:k]:  # finished before the failure: complete, byte for byte
        assert (out / s).read_bytes() == (ref / s).read_bytes()
    assert not (out / shards[k]).exists()
    assert runner.invoke(app, ["validate", str(out)]).exit_code in (1, 3)
    extract(verifier, out, "--max-shard-size", "40KB", "--resume")
    assert_same_output(out, ref)
    assert tree_hash(verifier) == before


class FullDisk:
    """os.write / os.copy_file_range that behave like a filesystem with ``budget`` bytes left (for files
    under ``root``): partial writes up to the budget, then ENOSPC."""

    def __init__(self, root: Path, budget: int) -> None:
        self.root, self.left = str(root), budget
        self.real_write, self.real_cfr = os.write, os.copy_file_range

    def _ours(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False

    def _take(self, n: int) -> int:
        if self.left == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return min(n, self.left)

    def write(self, fd, data):
        if not self._ours(fd):
            return self.real_write(fd, data)
        n = self.real_write(fd, memoryview(data).cast("B")[: self._take(len(memoryview(data).cast("B")))])
        self.left -= n
        return n

    def copy_file_range(self, src, dst, count, *args):
        if not self._ours(dst):
            return self.real_cfr(src, dst, count, *args)
        n = self.real_cfr(src, dst, self._take(count), *args)
        self.left -= n
        return n


@pytest.mark.parametrize("dtype", ["keep", "fp32"])  # byte-range copies, computed (cast) tensors
def test_disk_full_in_process(dtype, verifier, tmp_path, monkeypatch):
    before = tree_hash(verifier)
    out = tmp_path / "out"
    disk = FullDisk(out, 100_000)
    monkeypatch.setattr(os, "write", disk.write)
    monkeypatch.setattr(os, "copy_file_range", disk.copy_file_range)
    text = extract(verifier, out, "--dtype", dtype, code=4)
    assert_clean_failure(out, text, SINGLE, "disk full")
    assert 100_000 - 64 < written_bytes(" ".join(text.split())) <= 100_000  # the lock file took a few bytes
    assert tree_hash(verifier) == before


class FailingFile:
    """A file object whose writes fail with ENOSPC (the writer's small files: config, manifest, index)."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, data):
        self.f.write(bytes(data)[:10])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("victim", ["config.json", MANIFEST, INDEX])
def test_failing_file_object(victim, verifier, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def fake_open(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)  # noqa: SIM115 - handed to the writer, which closes it
        return FailingFile(f) if "w" in mode and Path(path).name == f".{victim}.partial" else f

    monkeypatch.setattr(writer, "open", fake_open, raising=False)
    text = extract(verifier, out, "--max-shard-size", "40KB", code=4)
    assert_clean_failure(out, text, victim, "disk full")
    assert written_bytes(" ".join(text.split())) == 10
    assert not (out / victim).exists()
