"""Which kernel path copies a byte range: copy_file_range on one filesystem, sendfile across filesystems
(copy_file_range's EXDEV, e.g. -o in tmpfs), the buffered copy when the kernel refuses or fails."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors*"))}


class Spy:
    """Counts calls of ``os.<name>``; optionally fails them with ``errno``."""

    def __init__(self, monkeypatch, name: str, fail: int | None = None) -> None:
        self.calls, self.real, self.fail = 0, getattr(os, name), fail
        monkeypatch.setattr(os, name, self)

    def __call__(self, *args):
        self.calls += 1
        if self.fail is not None:
            raise OSError(self.fail, os.strerror(self.fail))
        return self.real(*args)


@pytest.fixture(scope="module")
def reference(make_fixture, tmp_path_factory) -> tuple[Path, Path]:
    verifier = make_fixture("deepseek_v3")
    ref = tmp_path_factory.mktemp("ref") / "out"
    ckpt("extract", verifier, "-o", ref)
    return verifier, ref


def test_across_filesystems_the_kernel_copies_with_sendfile(reference, tmp_path, monkeypatch):
    verifier, ref = reference
    Spy(monkeypatch, "copy_file_range", fail=errno.EXDEV)
    sendfile = Spy(monkeypatch, "sendfile")
    ckpt("extract", verifier, "-o", tmp_path / "out")
    assert files(tmp_path / "out") == files(ref)
    assert sendfile.calls > 0


def test_a_sendfile_failure_falls_back_to_the_buffered_copy_that_names_the_failing_side(reference, tmp_path,
                                                                                         monkeypatch):
    verifier, ref = reference
    Spy(monkeypatch, "copy_file_range", fail=errno.EXDEV)
    Spy(monkeypatch, "sendfile", fail=errno.EIO)  # could be either side: the buffered copy finds out
    ckpt("extract", verifier, "-o", tmp_path / "out")
    assert files(tmp_path / "out") == files(ref)


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or shutil.disk_usage("/dev/shm").free < 64 << 20,
                    reason="no tmpfs at /dev/shm with 64 MB free")
def test_an_output_in_tmpfs_is_copied_by_sendfile(reference, monkeypatch):
    verifier, ref = reference
    sendfile = Spy(monkeypatch, "sendfile")
    out = Path("/dev/shm") / f"ckpt-tools-test-{os.getpid()}"
    try:
        ckpt("extract", verifier, "-o", out)
        assert files(out) == files(ref)
        if os.stat(out).st_dev != os.stat(verifier).st_dev:  # really another filesystem here
            assert sendfile.calls > 0
    finally:
        shutil.rmtree(out, ignore_errors=True)
