"""The writer hashes what it copies as it copies it (issue 34 item 4): each source byte read once.

The manifest's digests used to be computed by reading back what landed (``writer._hash_fd_range`` per tensor,
``writer._hash_shard_file`` per whole file); they must be exactly what that read-back gives. graft checks the
source's MTP values (rule nonfinite) from the bytes it copies, and stitch takes its draft's fingerprint from the
comparison that read the draft.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.stream import fingerprint, writer

from conftest import run_ckpt as ckpt

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
SOURCE = CORPUS / "transformers-deepseek_v3"
TARGET = CORPUS / "llmcompressor-nvfp4a16"
MTP = "model.layers.2."  # the DeepSeek-V3 fixture's MTP layer


def read_back(out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(tensor -> digest, whole file -> digest) as the writer computed them before: from the landed bytes."""
    m = json.loads((out / "ckpt_manifest.json").read_text())
    tensors, files = {}, {}
    for name, f in m["files"].items():
        if "blake3" in f:
            files[name] = writer._hash_shard_file(out / name)[0]
    for key, t in m["tensors"].items():
        if "blake3" not in t or t["file"] in m["files"]:
            continue
        with Checkpoint.open(str(out)) as c:
            seg = c.tensors[key].segment()
        fd = os.open(out / t["file"], os.O_RDONLY)
        try:
            tensors[key] = writer._hash_fd_range(fd, seg.offset, seg.length)
        finally:
            os.close(fd)
    return tensors, files


def recorded(out: Path) -> tuple[dict[str, str], dict[str, str]]:
    m = json.loads((out / "ckpt_manifest.json").read_text())
    return ({k: t["blake3"] for k, t in m["tensors"].items() if "blake3" in t and t["file"] not in m["files"]},
            {n: f["blake3"] for n, f in m["files"].items() if "blake3" in f})


@pytest.mark.parametrize("threads", ["2", "0"])  # hashed beside the write, and inline
def test_digests_hashed_while_copying_are_the_read_back_ones(make_fixture, tmp_path, monkeypatch, threads):
    monkeypatch.setenv("CKPT_HASH_THREADS", threads)
    fp8 = make_fixture("deepseek_v3", fp8=True)
    runs = {
        "graft": ("graft", SOURCE, TARGET),  # whole target shards copied, the MTP shard written
        "extract": ("extract", SOURCE),  # byte ranges
        "dequant": ("extract", fp8, "--dequant", "bf16"),  # computed chunks
    }
    for name, args in runs.items():
        out = tmp_path / name
        ckpt(*args, "-o", out)
        tensors, files = recorded(out)
        assert tensors or files
        assert (tensors, files) == read_back(out), name
        if name == "graft":
            assert files, "graft copies the target's shards whole"


def test_graft_checks_the_copied_mtp_values_as_it_writes_them(tmp_path, monkeypatch):
    """A NaN in a source MTP tensor written as it is: refused from the writer's chunks (no read before writing),
    naming the file, the key and the rule; nothing left of the run."""
    from ckpt_tools.ops.shared import compare

    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    key = f"{MTP}eh_proj.weight"
    with Checkpoint.open(str(src)) as c:
        seg = c.tensors[key].segment()
        file = seg.source.name
    with open(file, "r+b") as f:
        f.seek(seg.offset + 2 * 11)
        f.write(struct.pack("<H", 0x7FC0))  # a bf16 NaN

    def no_separate_read(recipe, dtype, shape):
        raise AssertionError("the copied tensors are checked by the writer, not read before it")

    monkeypatch.setattr(compare, "count_nonfinite", no_separate_read)
    out = tmp_path / "out"
    r = ckpt("graft", src, TARGET, "-o", out, code=3)
    assert "[nonfinite]" in r.output and key in " ".join(r.output.split()) and Path(file).name in r.output
    assert not out.exists()  # this run created it: nothing of it is left
    out.mkdir()  # a directory that was there before stays, empty
    ckpt("graft", src, TARGET, "-o", out, code=3)
    assert out.is_dir() and list(out.iterdir()) == []


def test_stitch_takes_the_drafts_fingerprint_from_its_comparison(make_fixture, tmp_path, monkeypatch):
    from test_integrity_output import finetuned_draft

    verifier = make_fixture("deepseek_v3")
    draft = finetuned_draft(verifier, tmp_path / "draft")
    read: list[str] = []
    real = fingerprint.tensor_digest

    def counting(ref):
        read.append(ref.key)
        return real(ref)

    monkeypatch.setattr(fingerprint, "tensor_digest", counting)
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    assert read == []  # every draft tensor was hashed by the comparison that read it
    monkeypatch.setattr(fingerprint.TakenTensors, "settle", read_all)  # as before
    before = tmp_path / "before"
    ckpt("stitch", draft, verifier, "-o", before)
    assert read  # the separate read
    m, b = (json.loads((o / "ckpt_manifest.json").read_text()) for o in (out, before))
    assert m["inputs"]["draft"]["tensors"] == b["inputs"]["draft"]["tensors"]
    assert m["plan"] == b["plan"] and m["tensors"] == b["tensors"]
    ckpt("verify-manifest", out)


def read_all(taken: fingerprint.TakenTensors, written) -> None:
    """The taken tensors' fingerprint as it was computed before: every tensor read for it."""
    digests = [fingerprint.tensor_digest(r) for r in taken.refs]
    taken.fp["tensors"] = {"count": len(taken.refs), "blake3": fingerprint.combined(taken.refs, digests)}


def test_graft_takes_the_sources_fingerprint_from_the_mtp_shard_it_writes(tmp_path, monkeypatch):
    """The source's MTP tensors written as they are: their fingerprint digest is the digest of what was written
    (no second read), the same as reading them gives; --mtp-dtype writes other bytes, so those are read."""
    read: list[str] = []
    real = fingerprint.tensor_digest
    monkeypatch.setattr(fingerprint, "tensor_digest", lambda ref: read.append(ref.key) or real(ref))
    out = tmp_path / "out"
    ckpt("graft", SOURCE, TARGET, "-o", out)
    assert read == []
    cast = tmp_path / "cast"
    ckpt("graft", SOURCE, TARGET, "-o", cast, "--mtp-dtype", "fp32")
    assert read and all(k.startswith(MTP) for k in read) and len(read) == len(set(read))  # each once
    with monkeypatch.context() as m:
        m.setattr(fingerprint.TakenTensors, "settle", read_all)
        ckpt("graft", SOURCE, TARGET, "-o", tmp_path / "before")
    m, b = (json.loads((o / "ckpt_manifest.json").read_text()) for o in (out, tmp_path / "before"))
    assert m["inputs"]["source"]["tensors"] == b["inputs"]["source"]["tensors"]
    assert m["inputs"]["source"]["tensors"]["count"] == sum(k.startswith(MTP) for k in m["tensors"])
    ckpt("verify-manifest", out)


def test_graft_resume_writes_again_a_finished_mtp_shard_whose_source_bytes_changed(tmp_path, monkeypatch):
    """The plan digest and the resume record leave out the digests of tensors copied whole (they come from the
    writing); --resume reads them again and does not reuse a finished shard whose copies the source no longer
    holds (same size, header and mtime, other bytes)."""
    from test_integrity_output import interrupt_after, visible

    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 1, "copy_whole_file")  # the MTP shard (checked first) finished, one target shard
        ckpt("graft", src, TARGET, "-o", out, code=130)
    mtp_shard = out / "model-mtp.safetensors"
    assert mtp_shard.is_file() and not (out / "model.safetensors.index.json").exists()
    finished = mtp_shard.read_bytes()
    key = f"{MTP}eh_proj.weight"
    with Checkpoint.open(str(src)) as c:
        seg = c.tensors[key].segment()
        file = Path(seg.source.name)
    st = file.stat()
    with open(file, "r+b") as f:
        f.seek(seg.offset)
        f.write(struct.pack("<H", 0x3F80))  # bf16 1.0
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    ckpt("graft", src, TARGET, "-o", out, "--resume")
    assert mtp_shard.read_bytes() != finished
    ckpt("graft", src, TARGET, "-o", tmp_path / "fresh")
    assert visible(out) == visible(tmp_path / "fresh")
    ckpt("verify-manifest", out)


@pytest.mark.parametrize("step", [4096, 8 << 20])  # a step inside the header; one step for the whole file
def test_a_linked_file_hashed_from_a_mapping_is_its_bytes_digest(tmp_path, monkeypatch, step):
    """A hard-linked shard is hashed from a read-only mapping in steps: the digest of its bytes, its size and its
    header, whatever the step; an empty file too."""
    from ckpt_tools.io import digest

    shard = sorted(SOURCE.glob("*.safetensors"))[0]
    monkeypatch.setattr(writer, "MAP_STEP", step)
    d, size, header = writer._hash_shard_file(shard)
    h = digest.new()
    h.update(shard.read_bytes())
    assert (d, size) == (h.hexdigest(), shard.stat().st_size)
    with Checkpoint.open(str(SOURCE)) as c:
        assert sorted(header.tensors) == sorted(c.shard_keys[shard.name])
    (tmp_path / "empty").write_bytes(b"")
    assert writer._hash_shard_file(tmp_path / "empty")[:2] == (digest.new().hexdigest(), 0)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64"])
def test_the_writers_value_check_counts_what_a_read_counts(dtype):
    """``FiniteCheck`` (fed the writer's chunks, cut anywhere) counts the NaN / Inf ``count_nonfinite`` counts."""
    import numpy as np

    from ckpt_tools.io.safetensors_io import Segment
    from ckpt_tools.ops.shared.compare import FiniteCheck, count_nonfinite
    from ckpt_tools.stream.plan import CopyBytes

    class Memory:
        name = "memory"

        def __init__(self, data: bytes) -> None:
            self.data, self.size = data, len(data)

        def readinto(self, offset: int, buf: memoryview) -> None:
            buf[:] = self.data[offset: offset + len(buf)]

        def local_fd(self) -> None:
            return None

    width = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}[dtype]
    raw = np.random.default_rng(1).integers(0, 256, size=width * 50_000, dtype=np.uint8).tobytes()
    for cut in (1, 777, 4096, len(raw)):
        check = FiniteCheck("k", dtype, "p", "w")
        for at in range(0, len(raw), cut):
            check.update(memoryview(raw)[at: at + cut])
        want = count_nonfinite(CopyBytes([Segment(Memory(raw), 0, len(raw))]), dtype, (len(raw) // width,))
        assert check.bad == want > 0


def test_a_sink_error_holding_a_view_of_the_mapping_is_the_error_raised(tmp_path):
    """A sink that fails while a view of the mapped bytes is alive (a value check's array in its traceback): its own
    error comes out, not a BufferError from closing the mapping over the exported view (exit 5, "cannot close
    exported pointers exist")."""
    import numpy as np

    from ckpt_tools.stream.hashcopy import feed_mapped

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)

    class Failing:
        def update(self, data):
            values = np.frombuffer(data, np.uint8)  # held by this frame, so by the traceback
            raise ValueError(f"bad value at {int(values.argmax())}")

    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="bad value"):
            feed_mapped(Failing(), fd, str(path), 100, 1000)
    finally:
        os.close(fd)
