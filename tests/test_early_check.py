"""The output's check runs on a thread while the writer copies whole files (issue 43): the files still being
copied are read from their inputs in their place, and before the completion marker what landed is proven to
be what was checked; a copy that landed other bytes is checked again as it landed (exit 4 when invalid).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from ckpt_tools.stream.targets import local

from conftest import run_ckpt as ckpt

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
SOURCE = CORPUS / "transformers-deepseek_v3"
TARGET = CORPUS / "llmcompressor-nvfp4a16"
SHARDS = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}  # the target's, copied whole


def _watch_checks(monkeypatch) -> tuple[threading.Event, list[set[str]]]:
    """An event set when the output's check starts, and for each check the files it read in place of copies."""
    import ckpt_tools.ops.check.validate as v

    real, started, stand_ins = v.validate, threading.Event(), []

    def watched(path, arch=None, *, pending=None):
        stand_ins.append({n for n, p in (pending.renamed if pending else {}).items() if callable(p)})
        started.set()
        return real(path, arch, pending=pending)

    monkeypatch.setattr(v, "validate", watched)
    return started, stand_ins


def test_the_check_runs_while_the_target_shards_are_copied(tmp_path, monkeypatch):
    started, stand_ins = _watch_checks(monkeypatch)
    real = local.copy_whole_file
    waited = []

    def copy(src, dst, **kw):
        if Path(src).name in SHARDS:
            waited.append(started.wait(10))  # the check starts before this copy is done: it does not wait for it
        return real(src, dst, **kw)

    monkeypatch.setattr(local, "copy_whole_file", copy)
    out = tmp_path / "out"
    ckpt("graft", SOURCE, TARGET, "-o", out)
    assert waited == [True, True]
    assert stand_ins == [SHARDS]  # checked once: what landed is proven to be what it read
    assert (out / "model.safetensors.index.json").is_file()
    assert ckpt("verify-manifest", out).exit_code == 0


def _junk_after(fd: int, tmp: Path) -> None:
    os.ftruncate(fd, os.fstat(fd).st_size + 8)


def _bad_dtype(fd: int, tmp: Path) -> None:
    head = tmp.read_bytes()[:4096]
    os.pwrite(fd, b"Q", head.index(b'"dtype":"') + len(b'"dtype":"'))  # an unknown dtype, at the same size


@pytest.mark.parametrize("change, rule", [(_junk_after, "trailing-bytes"), (_bad_dtype, "unknown-dtype")])
def test_a_copy_that_lands_other_bytes_than_were_checked_is_checked_again(change, rule, tmp_path, monkeypatch):
    """The check read the target's shard in its copy's place; the copy lands changed (after its bytes were hashed):
    not proven, so checked as it landed, and refused."""
    started, stand_ins = _watch_checks(monkeypatch)
    real = local._Durable.later
    name = sorted(SHARDS)[1]

    def later(self, fd, tmp, final, rename=True):
        if final.name == name and fd >= 0:
            started.wait(10)
            change(fd, tmp)
        return real(self, fd, tmp, final, rename)

    monkeypatch.setattr(local._Durable, "later", later)
    out = tmp_path / "out"
    r = ckpt("graft", SOURCE, TARGET, "-o", out, code=4)
    assert f"[{rule}]" in r.output and name in r.output and "left incomplete" in r.output
    assert len(stand_ins) == 2 and stand_ins[0] == SHARDS and stand_ins[1] == set()  # again, as it landed
    assert not (out / "model.safetensors.index.json").exists()


def _early(tmp_path: Path, read):
    from ckpt_tools.stream import early_check

    src, out = tmp_path / "input.bin", tmp_path / "out"
    src.write_bytes(bytes(range(256)) * 4)
    out.mkdir()
    (out / "f").write_bytes(src.read_bytes())
    ready: Future = Future()
    ready.set_result(None)

    def run(stand_ins):
        s = stand_ins["f"]()
        read(s)
        s.close()
        return {"tensors": {}}

    check = early_check.EarlyCheck(run, {"f": src}, ready)
    assert check.passed()
    return check, out


def test_what_landed_is_proven_byte_for_byte(tmp_path):

    check, out = _early(tmp_path, lambda s: s.readinto(100, memoryview(bytearray(10))))
    assert check.proven(out, {"tensors": {}})
    data = bytearray((out / "f").read_bytes())
    data[105] ^= 1
    (out / "f").write_bytes(bytes(data))
    assert not check.proven(out, {"tensors": {}})  # a byte it read differs
    (out / "f").write_bytes(bytes(data[:-1]))
    assert not check.proven(out, {"tensors": {}})
    assert not check.proven(out, {"tensors": {"k": {"file": "f", "dtype": "F32", "shape": [1]}}})  # another manifest


def test_a_stand_in_keeps_digests_not_the_bytes_it_read(tmp_path):
    """Memory stays bounded whatever share of a copy the check reads (a release's ~160 MB of scales, where no gate
    vouched for them): a stand-in keeps each range's offset, length and digest, not its bytes; the proof still
    catches a changed byte."""
    size = 1024  # the file _early writes
    check, out = _early(tmp_path, lambda s: [s.readinto(at, memoryview(bytearray(size // 4))) for at in (0, size // 2)])
    [stand] = check.stands.values()
    assert sum(len(str(r)) for r in stand.reads) < 300 and all(len(r[2]) == 64 for r in stand.reads), stand.reads
    assert check.proven(out, {"tensors": {}})
    data = bytearray((out / "f").read_bytes())
    data[size // 2 + 7] ^= 1
    (out / "f").write_bytes(bytes(data))
    assert not check.proven(out, {"tensors": {}})


def test_a_stand_in_whose_descriptor_was_read_is_not_proven(tmp_path):
    """Reads through the descriptor are not kept: what landed there cannot be compared, so it is checked again."""
    check, out = _early(tmp_path, lambda s: s.local_fd())
    assert not check.proven(out, {"tensors": {}})


def test_a_refusal_of_the_inputs_in_the_copies_place_is_judged_again_on_what_landed(tmp_path):
    """The early check reads inputs in place of copies: its refusal is not the verdict (``passed`` is False, so the
    writer checks what landed, and reports that); a crash in it is raised, not taken for a refusal."""
    from ckpt_tools.errors import InputError
    from ckpt_tools.stream import early_check

    ready: Future = Future()
    ready.set_result(None)

    def refuse(stand_ins):
        raise InputError("a bad value", rule="nonfinite")

    def crash(stand_ins):
        raise RuntimeError("a bug")

    assert not early_check.EarlyCheck(refuse, {}, ready).passed()
    with pytest.raises(RuntimeError, match="a bug"):
        early_check.EarlyCheck(crash, {}, ready).passed()
