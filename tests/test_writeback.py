"""A shard's writeback starts while it is written (stream.targets.local): the disk writes beside the computing,
and the fsync that makes the shard durable waits only for the rest."""

from __future__ import annotations

import os

from ckpt_tools.io.safetensors_io import LocalFile, Segment
from ckpt_tools.stream.targets import local


def test_a_shard_starts_the_writeback_of_each_written_stretch(tmp_path, monkeypatch):
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(local, "WRITEBACK", 1 << 20)
    monkeypatch.setattr(local, "start_writeback", lambda fd, off, n: calls.append((off, n)))
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    target = local.LocalTarget(tmp_path / "out")
    target.lock()
    up = target.open("x.safetensors", b"h" * 10)
    piece = 700 << 10
    for _ in range(3):  # written bytes: each stretch of at least 1 MiB, once
        up.write(memoryview(b"a" * piece))
    f = LocalFile(src)
    up.copy(Segment(f, 0, 3 << 20), None, None)  # copied bytes too
    f.close()
    up.close()
    up.commit()
    target.settle()  # fsync'd and renamed on the target's thread
    assert calls == [(0, 10 + 2 * piece), (10 + 2 * piece, piece + (3 << 20))]
    data = (tmp_path / "out" / "x.safetensors").read_bytes()
    assert data == b"h" * 10 + b"a" * 3 * piece + src.read_bytes()
    target.release(True)


def test_start_writeback_leaves_the_bytes_as_written(tmp_path):
    p = tmp_path / "f"
    body = os.urandom(5 << 20)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, body)
        local.start_writeback(fd, 0, len(body))
        local.start_writeback(fd, len(body), 1 << 20)  # past the end: nothing to write, no error
        os.fsync(fd)
    finally:
        os.close(fd)
    assert p.read_bytes() == body


def test_a_gguf_sidecar_starts_the_writeback_of_each_written_stretch(tmp_path, monkeypatch):
    """The GGUF writer too: every stretch of WRITEBACK bytes, once, in order, while the next tensors are produced;
    the file's bytes are those written without it."""
    from gguf import GGMLQuantizationType

    from ckpt_tools.io.gguf_file import read_gguf
    from ckpt_tools.stream import gguf_out

    body = [os.urandom(600 << 10) for _ in range(5)]
    f32 = GGMLQuantizationType.F32
    tensors = [gguf_out.GgufTensorOut(f"t{i}", (len(b) // 4,), f32, lambda b=b: [b[:1000], b[1000:]], {})
               for i, b in enumerate(body)]
    gguf_out.write_gguf(tmp_path / "plain.gguf", "llama", [], tensors)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(gguf_out, "WRITEBACK", 1 << 20)
    monkeypatch.setattr(gguf_out, "start_writeback", lambda fd, off, n: calls.append((off, n)))
    gguf_out.write_gguf(tmp_path / "out.gguf", "llama", [], tensors)
    assert (tmp_path / "out.gguf").read_bytes() == (tmp_path / "plain.gguf").read_bytes()
    assert len(calls) == 2 and calls[0][0] == 0 and calls[1][0] == sum(calls[0]) and all(n >= 1 << 20 for _, n in calls)
    assert sum(calls[-1]) <= (tmp_path / "out.gguf").stat().st_size
    assert sorted(read_gguf(tmp_path / "out.gguf").tensors) == [f"t{i}" for i in range(5)]


def test_a_whole_file_copy_starts_the_writeback_of_each_step(tmp_path, monkeypatch):
    """A shard copied whole (stitch's and graft's untouched shards) starts the writeback of each copied step, in
    order, covering the file once; the copy is the source's bytes."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(local, "WHOLE_FILE_STEP", 1 << 20)
    monkeypatch.setattr(local, "start_writeback", lambda fd, off, n: calls.append((off, n)))
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom((5 << 20) + 123))
    local.copy_whole_file(src, tmp_path / "copy", reflink=False, progress=local.Progress(),
                          buf=memoryview(bytearray(1 << 16)))
    assert calls == [(i << 20, 1 << 20) for i in range(5)] + [(5 << 20, 123)]
    assert (tmp_path / "copy").read_bytes() == src.read_bytes()
