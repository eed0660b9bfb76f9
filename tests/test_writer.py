"""The streaming writer against the safetensors library: every dtype, several shards, byte identity, memory."""

from __future__ import annotations

import gc
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_tools.errors import UsageError
from ckpt_tools.io.safetensors_io import LocalFile, read_header, refs_from_header
from ckpt_tools.jsonutil import dumps_indented
from ckpt_tools.stream import manifest
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.plan import Compute, CopyBytes, OutputTensor, Plan, parse_size

# Every dtype that both safetensors.torch and torch know.
SHARED_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
    "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
SHAPES = [(7, 5), (33,), (), (2, 0, 3), (4, 3, 2)]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def make_tensors() -> dict[str, torch.Tensor]:
    """Random bit patterns (NaNs included) of every dtype in several shapes, distinct per key."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dt in SHARED_DTYPES.items():
        itemsize = torch.empty((), dtype=dt).element_size()
        for j, shape in enumerate(SHAPES):
            numel = 1
            for d in shape:
                numel *= d
            if dt == torch.bool:
                t = torch.randint(0, 2, shape, generator=g).to(torch.bool)
            else:
                bits = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
                t = bits.view(dt).reshape(shape)
            out[f"layers.{j}.{name.lower()}"] = t
    return out


def chunked(t: torch.Tensor, pieces: int = 3):
    """A Compute producer yielding the tensor's bytes in a few chunks (bytes, numpy and torch mixed)."""

    def produce():
        data = raw(t)
        step = max(1, -(-len(data) // pieces))
        for i, pos in enumerate(range(0, len(data), step)):
            part = data[pos : pos + step]
            yield part if i % 2 == 0 else torch.frombuffer(bytearray(part), dtype=torch.uint8)

    return produce


def compute_plan(tensors: dict[str, torch.Tensor], max_shard_size: int) -> Plan:
    outs = [
        OutputTensor(k, name_of(t.dtype), tuple(t.shape), Compute(chunked(t), "test"))
        for k, t in tensors.items()
    ]
    return Plan("test", outs, max_shard_size=max_shard_size)


def name_of(dt: torch.dtype) -> str:
    return next(n for n, d in SHARED_DTYPES.items() if d == dt)


def test_every_dtype_round_trips_across_shards(tmp_path):
    tensors = make_tensors()
    out = tmp_path / "out"
    execute(compute_plan(tensors, max_shard_size=600), out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    seen = set()
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert index["weight_map"][k] == shard
                got = f.get_tensor(k)
                assert got.dtype == tensors[k].dtype and tuple(got.shape) == tuple(tensors[k].shape), k
                assert raw(got) == raw(tensors[k]), k
                seen.add(k)
    assert seen == set(tensors)
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    assert set(manifest["tensors"]) == set(tensors)


def test_single_file_is_byte_identical_to_save_file(tmp_path):
    tensors = make_tensors()
    ref = tmp_path / "ref.safetensors"
    save_file(tensors, str(ref), metadata={"format": "pt"})
    out = tmp_path / "out"
    execute(compute_plan(tensors, max_shard_size=10**9), out)
    assert not (out / "model.safetensors.index.json").exists()
    assert (out / "model.safetensors").read_bytes() == ref.read_bytes()


def copy_every_tensor(src_path: Path, out: Path) -> None:
    src = LocalFile(src_path)
    try:
        refs = refs_from_header(src, read_header(src))
        plan = Plan("copy", [OutputTensor(k, r.dtype, r.shape, CopyBytes([r.segment()])) for k, r in refs.items()],
                    inputs=[src_path])
        execute(plan, out)
    finally:
        src.close()


def test_byte_range_copies_reproduce_the_source(tmp_path):
    tensors = make_tensors()
    src_path = tmp_path / "src.safetensors"
    save_file(tensors, str(src_path), metadata={"format": "pt"})
    copy_every_tensor(src_path, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == src_path.read_bytes()


def test_no_future_per_written_tensor_lives_until_the_manifest(tmp_path, monkeypatch):
    """What a write keeps per tensor until its manifest is its digest, not a Future (~1 KB with its Condition: 90 MB
    for a 92k-tensor release)."""
    n = 2000
    src_path = tmp_path / "src.safetensors"
    save_file({f"t.{i}": torch.full((4,), float(i)) for i in range(n)}, str(src_path), metadata={"format": "pt"})
    alive: list[int] = []
    real = manifest.manifest_bytes

    def counting(content: dict) -> bytes:
        gc.collect()
        alive.append(sum(type(o) is Future for o in gc.get_objects()))
        return real(content)

    monkeypatch.setattr(manifest, "manifest_bytes", counting)
    copy_every_tensor(src_path, tmp_path / "out")
    assert alive and alive[0] < 50, f"{alive[0]} Futures alive for {n} tensors written"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == src_path.read_bytes()


def test_indented_json_holds_about_its_text_not_a_string_per_token():
    """A manifest's JSON pieces are joined as they go, not ~25 small strings per entry alive at once."""
    doc = {"tensors": {f"model.layers.{i}.mlp.experts.{i % 64}.weight": {
        "file": f"model-{i % 163:05d}.safetensors", "dtype": "F8_E4M3", "shape": [2048, 7168],
        "blake3": f"{i:064x}"} for i in range(20_000)}}
    tracemalloc.start()
    try:
        text = dumps_indented(doc, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(text) + (1 << 20), f"{peak >> 20} MB traced for {len(text) >> 20} MB of text"


@pytest.mark.parametrize(("text", "size"), [("500MB", 500 * 10**6), ("5GB", 5 * 10**9), ("50GB", 50 * 10**9),
                                            ("1000", 1000)])
def test_max_shard_size_parsing(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["51GB", "100GB", "0", "-5MB", "five", "5XB"])
def test_max_shard_size_refusals(text):
    with pytest.raises(UsageError) as info:
        parse_size(text)
    assert "max-shard-size" in str(info.value)


CHILD = textwrap.dedent("""
    import sys
    from ckpt_tools.io.safetensors_io import LocalFile, read_header, refs_from_header
    from ckpt_tools.stream.plan import CopyBytes, OutputTensor, Plan
    from ckpt_tools.stream.execute import execute

    src, out = sys.argv[1:3]
    f = LocalFile(src)
    refs = refs_from_header(f, read_header(f))
    plan = Plan("rss", [OutputTensor(k, r.dtype, r.shape, CopyBytes([r.segment()])) for k, r in refs.items()],
                inputs=[src], max_shard_size=600_000_000)
    result = execute(plan, out)
    # VmHWM: peak RSS of this address space. ru_maxrss would also count the parent's RSS at
    # fork time (Linux carries the pre-exec high-water mark over), i.e. pytest with torch loaded.
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) * 1024, result.bytes_written)
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc for the child's peak RSS")
def test_writing_1gb_keeps_peak_rss_small(tmp_path):
    """Copy a 1 GiB checkpoint in a child process: its peak RSS stays far below the data size."""
    work = tmp_path / "rss"
    work.mkdir()
    try:
        src = work / "src.safetensors"
        header, pos = {}, 0
        for i in range(4):
            n = 256 << 20
            header[f"t{i}"] = {"dtype": "U8", "shape": [n], "data_offsets": [pos, pos + n]}
            pos += n
        hraw = json.dumps(header).encode()
        hraw += b" " * (-len(hraw) % 8)
        with open(src, "wb") as f:
            f.write(struct.pack("<Q", len(hraw)) + hraw)
            f.write(os.urandom(1 << 20))  # some real bytes at the start, the rest sparse
            f.truncate(8 + len(hraw) + pos)
        out = work / "out"
        proc = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        peak, written = (int(x) for x in proc.stdout.split())
        assert written >= pos
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == pos
        assert len(set(index["weight_map"].values())) == 2
        with open(src, "rb") as f:
            f.seek(8 + len(hraw))
            head = f.read(1 << 20)
        with safe_open(str(out / index["weight_map"]["t0"]), framework="pt") as f:
            assert raw(f.get_slice("t0")[: 1 << 20]) == head
        assert peak < 250 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_small_file_put_into_an_output_holds_no_copy_buffer(tmp_path):
    """A report written into a finished output (and a hashed write, which copies through the copier) needs no 16 MiB
    copy buffer: zero-filled, it is resident."""
    from ckpt_tools.stream.targets import write_output_file

    write_output_file(tmp_path, "first.json", b"{}\n")  # what it imports is not what it holds
    tracemalloc.start()
    try:
        write_output_file(tmp_path, "report.json", b"{}\n")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (tmp_path / "report.json").read_bytes() == b"{}\n"
    assert peak < 1 << 20, f"{peak >> 20} MB traced for a 3-byte file"
