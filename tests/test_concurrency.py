"""Two commands writing the same output directory: one writes, the other refuses; nothing is corrupted."""

from __future__ import annotations

import fcntl
import os
import time

import pytest
from test_crash import assert_same_output, is_complete, shared_zygote
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.io.artefacts import LOCK_NAME
from ckpt_tools.stream.output_dir import DirLock as _Lock

runner = CliRunner()


@pytest.fixture
def zygote():
    return shared_zygote(torch=False)  # extract needs no torch


@pytest.fixture(scope="module")
def verifier(make_fixture):
    return make_fixture("deepseek_v3")


@pytest.fixture(scope="module")
def ref(verifier, tmp_path_factory):
    out = tmp_path_factory.mktemp("conc") / "ref"
    r = runner.invoke(app, ["extract", str(verifier), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def refusal(text: str) -> bool:
    return ("lock" in text and "another ckpt command" in text) or "not empty" in text


@pytest.mark.parametrize("round_", range(3))
def test_two_writers_started_together(round_, zygote, verifier, ref, tmp_path):
    out = tmp_path / "out"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    zygote.wait_ready()
    pids = [zygote.start(["extract", verifier, "-o", out], log) for log in logs]
    codes = [zygote.wait(pid) for pid in pids]
    texts = [log.read_text() for log in logs]
    assert sorted(codes) == [0, 4], (codes, texts)
    loser = texts[codes.index(4)]
    assert refusal(loser), loser
    assert "Traceback" not in loser
    assert_same_output(out, ref)
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0
    assert not (out / LOCK_NAME).exists()


def test_second_writer_with_overwrite_meets_the_lock(zygote, verifier, ref, tmp_path):
    """--overwrite passes the emptiness check, so the lock is what stops it - before it deletes anything."""
    out = tmp_path / "out"
    zygote.wait_ready()
    first = zygote.start(["extract", verifier, "-o", out], tmp_path / "a.log", kill=("pause", 1, 3.0))
    deadline = time.monotonic() + 30
    while not list(out.glob(".*.partial")):  # the first writer holds the lock, mid-shard
        assert time.monotonic() < deadline, (tmp_path / "a.log").read_text()
        time.sleep(0.02)
    code, _ = zygote.run(["extract", verifier, "-o", out, "--overwrite"], tmp_path / "b.log")
    text = (tmp_path / "b.log").read_text()
    assert code == 4 and "lock" in text and f"pid {first}" in text, text
    assert list(out.glob(".*.partial")), "the refused writer touched the first writer's files"
    assert zygote.wait(first) == 0, (tmp_path / "a.log").read_text()
    assert is_complete(out)
    assert_same_output(out, ref)


def test_lock_retries_when_the_holder_unlinks_the_file_under_it(tmp_path, monkeypatch):
    """A writer that opened the lock file just before the previous holder unlinked it must not lock the
    orphan (a third writer would then lock a new file and both would write)."""
    real_flock = fcntl.flock
    calls = []

    def racing_flock(fd, op):
        calls.append(fd)
        if len(calls) == 1:  # the previous holder releases now: unlinks the file we opened
            os.unlink(tmp_path / LOCK_NAME)
        return real_flock(fd, op)

    (tmp_path / LOCK_NAME).write_text("123\n")
    monkeypatch.setattr(fcntl, "flock", racing_flock)
    lock = _Lock(tmp_path)
    try:
        assert len(calls) == 2
        assert os.path.samestat(os.fstat(lock.fd), os.stat(tmp_path / LOCK_NAME))
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_stale_lock_file_does_not_block(verifier, ref, tmp_path):
    """The lock file of a dead process holds no flock: a new run proceeds (and cleans it up)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text("999999\n")
    r = runner.invoke(app, ["extract", str(verifier), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert_same_output(out, ref)
    assert not (out / LOCK_NAME).exists()
