"""Untouched bytes move by copy_file_range again, and are hashed from the page cache (issue 43 item 1).

A large local byte range is copied by the kernel and its digest taken from a read-only mapping of the source,
on one thread beside the copies (or inline with ``CKPT_HASH_THREADS=0``): the digests are the read-back ones,
a value check still sees every byte, and a kernel that refuses the copy (EXDEV) falls back to read, hash,
write. The fixtures are small: ``KERNEL_MIN`` and ``PIECE`` are lowered so that their tensors take that path.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct

import pytest
from test_hash_while_copying import MTP, SOURCE, TARGET, read_back, recorded

from ckpt_tools.io import digest
from ckpt_tools.io import safetensors_io as sio
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.safetensors_io import LocalFile, Segment
from ckpt_tools.stream import hashcopy

from conftest import run_ckpt as ckpt


@pytest.fixture
def small_ranges(monkeypatch) -> list[int]:
    """Every range of the fixtures through the kernel, in pieces of 4 KiB; the copy_file_range calls counted."""
    monkeypatch.setattr(hashcopy, "KERNEL_MIN", 1, raising=False)  # raising: the code before it fails, not errs
    monkeypatch.setattr(hashcopy, "PIECE", 4096, raising=False)
    monkeypatch.setattr(sio, "_CFR_OK", True)
    calls: list[int] = []
    real = os.copy_file_range

    def counting(src, dst, count, *a, **k):
        calls.append(count)
        return real(src, dst, count, *a, **k)

    monkeypatch.setattr(os, "copy_file_range", counting)
    return calls


@pytest.mark.parametrize("threads", ["2", "0"])
def test_hashed_copies_go_through_the_kernel_with_the_read_back_digests(small_ranges, tmp_path, monkeypatch,
                                                                        threads):
    monkeypatch.setenv("CKPT_HASH_THREADS", threads)
    for name, args in {"graft": ("graft", SOURCE, TARGET), "extract": ("extract", SOURCE)}.items():
        small_ranges.clear()
        out = tmp_path / name
        ckpt(*args, "-o", out)
        assert small_ranges, f"{name}: no copy_file_range while hashing"
        tensors, files = recorded(out)
        assert (tensors, files) == read_back(out), name
        ckpt("verify-manifest", out)


def test_a_kernel_that_refuses_falls_back_with_the_same_digests(small_ranges, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    out = tmp_path / "out"
    ckpt("graft", SOURCE, TARGET, "-o", out)
    assert recorded(out) == read_back(out)
    assert sio._CFR_OK is False  # not asked again


@pytest.mark.parametrize("threads", ["2", "0"])
def test_the_value_check_sees_the_bytes_hashed_from_the_page_cache(small_ranges, tmp_path, monkeypatch, threads):
    """A NaN in the last piece of a source MTP tensor: refused (nonfinite) though hashed on the other thread."""
    monkeypatch.setenv("CKPT_HASH_THREADS", threads)
    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    key = f"{MTP}eh_proj.weight"
    with Checkpoint.open(str(src)) as c:
        seg = c.tensors[key].segment()
    assert seg.length > 2 * 4096
    with open(seg.source.name, "r+b") as f:
        f.seek(seg.offset + seg.length - 2)
        f.write(struct.pack("<H", 0x7FC0))  # a bf16 NaN, the tensor's last value
    small_ranges.clear()
    r = ckpt("graft", src, TARGET, "-o", tmp_path / "out", code=3)
    assert "[nonfinite]" in r.output and key in " ".join(r.output.split())
    assert small_ranges and not (tmp_path / "out").exists()


@pytest.mark.parametrize("threads", [1, 0])
def test_a_large_range_is_one_kernel_copy_per_piece_and_never_written_from_user_space(tmp_path, threads):
    data = os.urandom(12 << 20)
    (tmp_path / "src").write_bytes(data)
    seg = Segment(LocalFile(tmp_path / "src"), 4097, (9 << 20) + 5)
    copier, h = hashcopy.HashingCopier(threads=threads), digest.new()
    written: list[int] = []
    with open(tmp_path / "dst", "wb") as fo:
        fo.write(b"head")
        fo.flush()
        copier.segment(seg, h, lambda mv: written.append(len(mv)), fo.fileno())
        result = copier.later(h.hexdigest).result()
    copier.close()
    want = data[seg.offset : seg.offset + seg.length]
    assert written == []  # nothing went through a user-space buffer
    assert (tmp_path / "dst").read_bytes() == b"head" + want
    expected = digest.new()
    expected.update(want)
    assert result == expected.hexdigest()


def test_tensors_laid_out_end_to_end_move_in_one_copy_with_their_own_digests(small_ranges, tmp_path, monkeypatch):
    """The source's MTP tensors lie in the order graft writes them: consecutive ones move by one copy (pieces as
    large as PIECE), each tensor still with the digest of its own bytes."""
    monkeypatch.setattr(hashcopy, "PIECE", 8 << 20)
    out = tmp_path / "out"
    ckpt("graft", SOURCE, TARGET, "-o", out)
    assert recorded(out) == read_back(out)
    with Checkpoint.open(str(out)) as c:
        mtp = [k for k in c.tensors if k.startswith(MTP)]
    assert len(mtp) > 10 and len(small_ranges) < len(mtp) / 3  # 8 here (4 runs, 2 target shards); 36 one by one
