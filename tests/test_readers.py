"""Draft readers: torch state dicts (.bin/.pt/.pth, sharded with an index) and torch DCP folders.

Every tensor must read as ``t.contiguous()``'s bytes; hostile pickles are refused without running;
memory stays bounded by the largest tensor (measured in a fresh process).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt_tools.dtypes import from_torch
from ckpt_tools.errors import InputError
from ckpt_tools.io.checkpoint import Checkpoint, open_draft_source
from ckpt_tools.io.readers.base import FileSpans, LoadedTensor

from conftest import run_ckpt

REPO = Path(__file__).resolve().parents[1]
ANGELSPEC_PREFIX = "model_state.model.draft_model."  # AngelSpec's DCP keys: {"model_state": {"model": sd}}


def sample_state() -> dict[str, torch.Tensor]:
    """Every kind of tensor a trainer's state dict holds, including views that are not contiguous."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(20, generator=g)
    return {
        "enorm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "eh_proj.weight": torch.randn(16, 32, generator=g),
        "midlayer.mlp.experts_gate_proj": torch.randn(4, 16, 8, generator=g).to(torch.float8_e4m3fn),
        "midlayer.self_attn.o_proj.weight": torch.randn(12, 16, generator=g).T,  # non-contiguous
        "shared.a": shared[:5],  # two views of one storage
        "shared.b": shared[5:].view(3, 5),
        "midlayer.mlp.expert_bias": torch.tensor(0.25, dtype=torch.float64),  # 0-dim
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def expected(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_reads(ckpt: Checkpoint, state: dict[str, torch.Tensor], prefix: str = "") -> None:
    assert set(ckpt.tensors) == {prefix + k for k in state}
    for k, t in state.items():
        ref = ckpt.tensors[prefix + k]
        assert (ref.dtype, ref.shape) == (from_torch(t.dtype), tuple(t.shape)), k
        assert bytes(ref.read()) == expected(t), k
        # and piece by piece, as the writer streams them
        pieces = [read_range(ref, i, min(5, ref.nbytes - i)) for i in range(0, ref.nbytes, 5)]
        assert b"".join(pieces) == expected(t), k


def read_range(ref, start: int, n: int) -> bytes:
    buf = bytearray(n)
    ref.source.readinto(ref.offset + start, memoryview(buf))
    return bytes(buf)


def part_of(ckpt: Checkpoint, key: str):
    ref = ckpt.tensors[key]
    src = ref.source
    part = src.parts[src.starts.index(ref.offset) if ref.nbytes else 0]
    return getattr(part, "_part", None) or part  # a DCP part is decided on first read


def save_dcp(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist warns that it runs without a process group
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def write_ranked_dcp(folder: Path, state: dict[str, torch.Tensor], split: dict[str, int], ranks: int = 2) -> None:
    """A DCP folder as ``ranks`` processes write it: each tensor in ``split`` cut along that axis, one piece
    per rank (contiguous, as DCP stores them); the others whole, as they are, by rank 0."""
    folder.mkdir(parents=True)
    tensors_md, storage = {}, {}
    written = [0] * ranks
    for fqn, t in state.items():
        dim = split.get(fqn)
        pieces = [p.contiguous() for p in t.tensor_split(ranks, dim)] if dim is not None else [t]
        chunks, start = [], 0
        for r, piece in enumerate(pieces):
            offsets = [0] * t.dim()
            if dim is not None:
                offsets[dim] = start
                start += piece.shape[dim]
            name = f"__{r}_0.distcp"
            torch.save(piece, folder / "piece")  # to a path: much faster than to a file object
            with open(folder / name, "ab") as f, open(folder / "piece", "rb") as p:
                shutil.copyfileobj(p, f)
                size = f.tell() - written[r]
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), piece.shape))
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(name, written[r], size)
            written[r] += size
        tensors_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, chunks)
    (folder / "piece").unlink(missing_ok=True)
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(tensors_md, storage_data=storage)))


def refused(path, rule: str, **kw) -> InputError:
    with pytest.raises(InputError) as info:
        open_draft_source(path, **kw) if kw else Checkpoint.open(path)
    assert info.value.rule == rule, str(info.value)
    return info.value


# -- torch state dicts ---------------------------------------------------------------------------


@pytest.fixture(params=[16 << 20, 8], ids=["pieces-16MB", "pieces-8B"])
def piece_bytes(request, monkeypatch):
    """Strided tensors are copied out in pieces; tiny pieces drive the row-by-row path on small tensors."""
    monkeypatch.setattr("ckpt_tools.io.readers.base.PIECE_BYTES", request.param)


def test_state_dict_bytes(tmp_path, piece_bytes):
    state = sample_state()
    torch.save(state, tmp_path / "pytorch_model.bin")
    ckpt = Checkpoint.open(tmp_path)
    assert (ckpt.reader, ckpt.headers, ckpt.index, list(ckpt.shard_keys)) == ("torch", {}, None, ["pytorch_model.bin"])
    assert_reads(ckpt, state)
    # contiguous tensors are byte ranges of the file; only the strided one is loaded (mmap, when read)
    assert isinstance(part_of(ckpt, "midlayer.self_attn.o_proj.weight"), LoadedTensor)
    assert all(isinstance(part_of(ckpt, k), FileSpans) for k in state if k != "midlayer.self_attn.o_proj.weight")
    assert Checkpoint.open(tmp_path / "pytorch_model.bin").tensors.keys() == ckpt.tensors.keys()


@pytest.mark.parametrize("name", ["draft.pt", "weights.pth", "model.bin"])
def test_single_file_found_beside_side_files(tmp_path, name):
    state = sample_state()
    torch.save(state, tmp_path / name)
    for side in ("optimizer.pt", "rng_state.pth", "training_args.bin", "scheduler.pt"):
        (tmp_path / side).write_bytes(b"not read")  # trainer files with the same suffixes are never weights
    (tmp_path / "tokenizer.json").write_text("{}")
    ckpt = Checkpoint.open(tmp_path)
    assert_reads(ckpt, state)
    assert ckpt.files == ["tokenizer.json"]
    torch.save(state, tmp_path / "other.pt")
    err = refused(tmp_path, "ambiguous-weights")
    assert "other.pt" in str(err) and name in str(err)


def test_sharded_bin_with_index(tmp_path):
    state = sample_state()
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[:4], "pytorch_model-00002-of-00002.bin": keys[4:]}
    weight_map = {}
    for name, ks in shards.items():
        torch.save({k: state[k] for k in ks}, tmp_path / name)
        weight_map.update(dict.fromkeys(ks, name))
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ckpt = Checkpoint.open(tmp_path)
    assert_reads(ckpt, state)
    assert sorted(ckpt.shard_keys) == sorted(shards) and ckpt.files == []  # the bin index is never carried
    assert ckpt.shard_of(keys[0]) == "pytorch_model-00001-of-00002.bin"

    weight_map[keys[0]] = "pytorch_model-00002-of-00002.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(tmp_path, "index-key-missing")
    weight_map[keys[0]] = "../outside.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(tmp_path, "shard-path")


def test_wrapped_state_dicts(tmp_path):
    state = sample_state()
    torch.save({"state_dict": state, "epoch": 3, "optimizer_states": [{"lr": 0.1}]}, tmp_path / "last.pt")
    ckpt = Checkpoint.open(tmp_path)
    assert_reads(ckpt, state)
    assert ckpt.reader_notes == ["last.pt: took the state dict under 'state_dict', ignored the rest"]

    for bad in ({"model": {"model": state}}, {"w": torch.ones(2), "epoch": 3}, [state], {}, {"model": state,
                                                                                          "state_dict": state}):
        torch.save(bad, tmp_path / "last.pt")
        assert "not a flat dict of tensors" in str(refused(tmp_path, "not-a-state-dict"))


def test_what_safetensors_cannot_hold(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental in torch
        torch.save({"c": torch.zeros(2, dtype=torch.complex32)}, tmp_path / "a.pt")
    assert "complex32" in str(refused(tmp_path / "a.pt", "unsupported-dtype"))
    torch.save({"s": torch.eye(3).to_sparse()}, tmp_path / "a.pt")
    assert "sparse" in str(refused(tmp_path / "a.pt", "unsupported-tensor"))


class Payload:
    """Unpickling this would create a file: proof that no code from the checkpoint ran."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.write_text, (self.target, "pwned"))


def test_malicious_pickles_never_run(tmp_path):
    target = tmp_path / "pwned"
    d = tmp_path / "zip"
    d.mkdir()
    torch.save({"w": torch.ones(2), "x": Payload(target)}, d / "pytorch_model.bin")
    err = refused(d, "unsafe-pickle")
    assert "pytorch_model.bin" in str(err) and "weights_only=False" not in str(err)
    out = run_ckpt("inspect", d, code=3).output
    assert "[unsafe-pickle]" in out

    d = tmp_path / "legacy"
    d.mkdir()
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": Payload(target)}, f)  # a legacy (non-zip) torch file is refused before any unpickling
    refused(d, "legacy-torch-file")

    d = tmp_path / "dcp"
    save_dcp({"w": torch.ones(2)}, d)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(Payload(target), f)
    assert "names pathlib.Path.write_text" in str(refused(d, "unsafe-pickle"))
    run_ckpt("validate", d, code=3)
    assert not target.exists()


# -- DCP -------------------------------------------------------------------------------------------


def angelspec_step(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    """A training step folder as AngelSpec's checkpoint.save writes it (model, optimizer, scheduler, rng, meta)."""
    step = tmp_path / "iter_0000100"
    save_dcp({"model_state": {"model": {f"draft_model.{k}": v for k, v in state.items()}}}, step / "model")
    save_dcp({"optim_state": {"optim": {"state": {"0": {"exp_avg": torch.ones(3), "step": torch.tensor(5.0)}},
                                        "param_groups": [{"lr": 0.1, "params": [0]}]}}}, step / "optimizer")
    save_dcp({"lr_scheduler_state": {"lr_scheduler": {"last_epoch": 4}}}, step / "lr_scheduler")
    torch.save({"torch": torch.get_rng_state()}, step / "rng.pt")
    (step / "meta.json").write_text(json.dumps({"iteration": 100}))
    return step


def test_dcp_step_folder(tmp_path, piece_bytes):
    state = sample_state()
    step = angelspec_step(tmp_path, state)
    ckpt = Checkpoint.open(step)
    assert (ckpt.reader, ckpt.files, list(ckpt.shard_keys)) == ("dcp", [], ["model"])
    assert_reads(ckpt, state, ANGELSPEC_PREFIX)  # keys as stored: prefix handling is the format layer's
    assert ckpt.reader_notes == ["read model/; ignored lr_scheduler/, meta.json, optimizer/, rng.pt"]
    assert isinstance(part_of(ckpt, ANGELSPEC_PREFIX + "midlayer.self_attn.o_proj.weight"), LoadedTensor)
    assert isinstance(part_of(ckpt, ANGELSPEC_PREFIX + "eh_proj.weight"), FileSpans)
    assert Checkpoint.open(step / "model").tensors.keys() == ckpt.tensors.keys()


def test_dcp_chunks_from_several_ranks(tmp_path, piece_bytes):
    """Row shards (FSDP) read as byte ranges of each rank's file; any other split is assembled by DCP's loader."""
    g = torch.Generator().manual_seed(1)
    state = {"rows": torch.randn(7, 6, generator=g), "cols": torch.randn(5, 9, generator=g).to(torch.bfloat16),
             "whole": torch.randn(3, generator=g), "optimizer.state.rows.exp_avg": torch.randn(7, 6, generator=g)}
    write_ranked_dcp(tmp_path / "ckpt", state, {"rows": 0, "cols": 1, "optimizer.state.rows.exp_avg": 0})
    # torch's own loader agrees with the layout written by hand
    check = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(check, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert all(torch.equal(check[k], v) for k, v in state.items())

    ckpt = Checkpoint.open(tmp_path / "ckpt")
    del state["optimizer.state.rows.exp_avg"]
    assert_reads(ckpt, state)
    assert ckpt.reader_notes == ["ignored 1 optimizer.*"]
    assert isinstance(part_of(ckpt, "rows"), FileSpans) and len(part_of(ckpt, "rows").spans) == 2
    assert isinstance(part_of(ckpt, "cols"), LoadedTensor)


def test_dcp_transformed_chunks_go_through_dcp_load(tmp_path, monkeypatch):
    """Chunks stored through a DCP transform are read by DCP's own loader (here: every chunk, to test that path)."""
    from ckpt_tools.io.readers.dcp import _Folder

    monkeypatch.setattr(_Folder, "_assemble", _Folder._load)
    state = {"cols": torch.randn(5, 9).to(torch.bfloat16), "t": torch.randn(4, 3).T}
    write_ranked_dcp(tmp_path / "ckpt", state, {"cols": 1})
    assert_reads(Checkpoint.open(tmp_path / "ckpt"), state)


def test_dcp_chunks_must_cover_the_tensor(tmp_path):
    write_ranked_dcp(tmp_path / "ckpt", {"w": torch.ones(4, 2)}, {"w": 0})
    md = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    md.state_dict_metadata["w"].chunks[1].sizes = torch.Size([1, 2])  # rows 3.. are nowhere
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    assert "chunks hold 6 elements" in str(refused(tmp_path / "ckpt", "dcp-metadata"))
    md.state_dict_metadata["w"].chunks[1].sizes = torch.Size([2, 2])
    md.storage_data = {k: _StorageInfo("../../etc/passwd", 0, 1) for k in md.storage_data}
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    refused(tmp_path / "ckpt", "shard-path")


def test_detection(tmp_path):
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no-weights")
    both = tmp_path / "both"
    save_dcp({"w": torch.ones(2)}, both)
    torch.save({"w": torch.ones(2)}, both / "pytorch_model.bin")
    refused(both, "ambiguous-weights")
    assert open_draft_source(both, kind="dcp").reader == "dcp"
    assert open_draft_source(both, kind="torch").reader == "torch"
    # a directory with safetensors weights is read as today, whatever lies beside them
    st = tmp_path / "st"
    shutil.copytree(both, st)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, st / "model.safetensors")
    assert Checkpoint.open(st).reader == "safetensors"


# -- through the verbs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def native_draft(make_fixture, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "draft"
    run_ckpt("extract", make_fixture("deepseek_v3"), "-o", out)
    return out


def as_torch_draft(draft: Path, out: Path, fmt: str, change=lambda k, t: t) -> Path:
    """The same draft as a trainer would save it: pytorch_model.bin or a DCP folder, beside its config.json."""
    out.mkdir()
    shutil.copy(draft / "config.json", out / "config.json")
    state = {k: change(k, t) for k, t in load_file(draft / "model.safetensors").items()}
    if fmt == "bin":
        torch.save(state, out / "pytorch_model.bin")
    else:
        save_dcp(state, out)
    return out


@pytest.mark.parametrize("fmt", ["bin", "dcp"])
def test_inspect_and_diff_match_the_safetensors_draft(native_draft, tmp_path, fmt):
    other = as_torch_draft(native_draft, tmp_path / fmt, fmt)
    # the same tensors and config; the torch draft was saved without the side files the native draft carries
    d = json.loads(run_ckpt("diff", other, native_draft, "--json", code=1).output)
    assert (d["tensors"], d["config"]["status"], d["problems"]) == ([], "unchanged", [])
    assert {f["status"] for f in d["files"] if f.get("counted", True)} == {"added"}
    a = json.loads(run_ckpt("inspect", other, "--json").output)
    b = json.loads(run_ckpt("inspect", native_draft, "--json").output)
    # the reports say which reader read the weights, and otherwise agree
    assert (a["reader"], b["reader"]) == ({"bin": "torch", "dcp": "dcp"}[fmt], "safetensors")
    for report in (a, b):
        report.pop("path")
        report.pop("reader")
        for entry in report["tensors"] + report["shards"]:
            entry.pop("shard", None)
            entry.pop("name", None)
    assert a == b


def test_stitch_a_trained_bin_draft(native_draft, make_fixture, tmp_path):
    """A finetuned fp32 draft stitches the same from pytorch_model.bin as from model.safetensors."""
    def trained(key, t):
        return (t.float() * 1.01) if t.is_floating_point() and t.element_size() > 1 else t

    bin_draft = as_torch_draft(native_draft, tmp_path / "bin", "bin", trained)
    st_draft = tmp_path / "st"
    st_draft.mkdir()
    shutil.copy(native_draft / "config.json", st_draft / "config.json")
    from safetensors.torch import save_file

    save_file({k: trained(k, t) for k, t in load_file(native_draft / "model.safetensors").items()},
              st_draft / "model.safetensors")
    verifier = make_fixture("deepseek_v3")
    run_ckpt("stitch", bin_draft, verifier, "-o", tmp_path / "from-bin")
    run_ckpt("stitch", st_draft, verifier, "-o", tmp_path / "from-st")
    run_ckpt("diff", tmp_path / "from-bin", tmp_path / "from-st", code=0)
    assert run_ckpt("diff", tmp_path / "from-bin", verifier, code=1)


# -- memory ------------------------------------------------------------------------------------------

BIG = 64 << 20  # elements: a 256 MB fp32 tensor, larger than everything else combined

# One process measures every case: the kernel's high-water mark of its memory (VmHWM) is reset before each.
# (getrusage's ru_maxrss cannot be reset, and Linux carries it over from the forking parent across exec.)
_MEASURE = """
import gc, json, sys
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.safetensors_io import iter_chunks

def status(field):
    return int(next(x for x in open("/proc/self/status") if x.startswith(field + ":")).split()[1]) * 1024

for path in sys.argv[1:]:
    ckpt = Checkpoint.open(path)
    gc.collect()
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    for ref in ckpt.tensors.values():  # streamed as the writer and hashing read them
        for _ in iter_chunks(ref.segment()):
            pass
    print(json.dumps({"reader": ckpt.reader, "before": before, "peak": status("VmHWM")}))
    for src in ckpt.sources.values():
        src.close()
    del ckpt, src
"""


@pytest.fixture
def big_dir(tmp_path):
    """Room for 1 GB of inputs: in memory when /dev/shm exists (this VM writes to disk at 0.5 GB/s)."""
    if not Path("/dev/shm").is_dir():
        return tmp_path
    d = Path(tempfile.mkdtemp(prefix="ckpt-readers-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures with Linux's /proc peak-RSS reset")
def test_memory_bounded_by_the_largest_tensor(big_dir):
    """Peak memory while streaming every tensor, above what the opened checkpoint already used.

    Byte ranges (contiguous tensors of a .bin, row-sharded DCP chunks) cost nothing; a tensor torch must
    load costs about one copy of it (strided: read as stored; split along columns: the tensor plus a chunk).
    """
    small = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(8)}
    big = torch.ones(BIG // 1024, 1024)
    cases = {"bin": 0.25, "dcp-rows": 0.25, "dcp-strided": 1.5, "dcp-cols": 1.75}
    (big_dir / "bin").mkdir()
    # 5x faster to write; torch's own patch (monkeypatch's undo deletes the option, breaking later torch.save)
    with torch.utils.serialization.config.patch({"save.compute_crc32": False}):
        torch.save({"big": big, **small}, big_dir / "bin" / "pytorch_model.bin")
        write_ranked_dcp(big_dir / "dcp-rows", {"big": big, **small}, {"big": 0})
        write_ranked_dcp(big_dir / "dcp-cols", {"big": big, **small}, {"big": 1})
        write_ranked_dcp(big_dir / "dcp-strided", {"big": big.view(1024, -1).T, **small}, {})
    del big
    out = subprocess.run([sys.executable, "-c", _MEASURE, *(str(big_dir / c) for c in cases)], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    for (case, limit), line in zip(cases.items(), out.stdout.splitlines(), strict=True):
        m = json.loads(line)
        ratio = (m["peak"] - m["before"]) / (BIG * 4)
        print(f"{case}: {m['reader']}, peak {m['peak'] >> 20} MB, {ratio:.2f} x the 256 MB tensor above "
              f"{m['before'] >> 20} MB")
        assert ratio < limit, (case, ratio)
