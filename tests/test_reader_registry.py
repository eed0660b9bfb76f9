"""The readers registry: a new trainer format is one reader, registered from outside the package.

The toy format here - a folder of ``.npy`` files, one per tensor (its bytes as a flat uint8 array), named
by a small JSON manifest with each tensor's dtype and shape - is known to this test alone. Once its
``Reader`` is registered, ``Checkpoint.open``, ``ckpt inspect``, ``ckpt extract`` and ``ckpt stitch`` read
it like any checkpoint, with no other change to the tool, and agree byte for byte with the safetensors
checkpoint it was made from; unregistered, the tool no longer recognises it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_tools.errors import InputError
from ckpt_tools.io.checkpoint import Checkpoint, open_draft_source
from ckpt_tools.io.readers import READERS, Reader, register, unregister
from ckpt_tools.io.readers.base import FileSpans, Tensor, TensorCache, WeightSet, build_weight_set
from ckpt_tools.io.safetensors_io import LocalFile, Segment, read_bytes

from conftest import run_ckpt

NAME = "npy"
MANIFEST = "npy_tensors.json"


# -- the toy reader: everything a new format needs -------------------------------------------------------


def _detect(d: Path) -> str | None:
    return f"a .npy folder ({MANIFEST})" if (d / MANIFEST).is_file() else None


def _data_offset(path: Path, nbytes: int) -> int:
    """Where the data of a flat uint8 ``.npy`` file of ``nbytes`` starts (after its header)."""
    with path.open("rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, fortran, dtype = read_header[version](f)
        if (shape, dtype) != ((nbytes,), np.dtype(np.uint8)):
            raise InputError(f"holds {dtype} {list(shape)}, not {nbytes} bytes", rule="tensor-mismatch",
                             path=str(path))
        return f.tell()


def _read(d: Path, confine, read_index, only: str | None) -> WeightSet:
    from ckpt_tools.dtypes import DTYPES

    entries = json.loads(confine(MANIFEST).read_bytes())
    found: dict[str, list[Tensor]] = {}
    opened: dict[str, list[LocalFile]] = {}
    for key, e in entries.items():
        shape = tuple(e["shape"])
        nbytes = DTYPES[e["dtype"]].nbytes(int(np.prod(shape, dtype=np.int64)))
        path = confine(e["file"])
        src = LocalFile(path)
        found[e["file"]] = [Tensor(key, e["dtype"], shape, FileSpans([Segment(src, _data_offset(path, nbytes),
                                                                               nbytes)]))]
        opened[e["file"]] = [src]
    return build_weight_set(NAME, found, opened, TensorCache(), [], consumed={MANIFEST, *found})


TOY = Reader(NAME, f".npy ({MANIFEST})", detect=_detect, read=_read)


@pytest.fixture
def toy_reader():
    register(TOY)
    try:
        yield TOY
    finally:
        unregister(NAME)


def as_npy_folder(src: Path, out: Path) -> Path:
    """The checkpoint ``src`` in the toy format: its tensors as .npy files, its other files beside them."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "ckpt_manifest.json"))
    entries = {}
    with Checkpoint.open(src) as ckpt:
        for i, (key, ref) in enumerate(sorted(ckpt.tensors.items())):
            data = np.frombuffer(bytes(read_bytes(ref.source, ref.offset, ref.nbytes)), np.uint8)
            np.save(out / f"t{i:04d}.npy", data)
            entries[key] = {"file": f"t{i:04d}.npy", "dtype": ref.dtype, "shape": list(ref.shape)}
    (out / MANIFEST).write_text(json.dumps(entries))
    return out


@pytest.fixture(scope="module")
def verifier(make_fixture) -> Path:
    return make_fixture("deepseek_v3")


@pytest.fixture(scope="module")
def native_draft(verifier, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "draft"
    run_ckpt("extract", verifier, "-o", out)
    return out


# -- the tool reads it, with no other change ---------------------------------------------------------------


def test_open_reads_every_tensor_as_stored(toy_reader, native_draft, tmp_path):
    toy = as_npy_folder(native_draft, tmp_path / "toy")
    with Checkpoint.open(toy) as ckpt, Checkpoint.open(native_draft) as ref:
        assert (ckpt.reader, ckpt.config_present) == (NAME, True)
        assert ref.reader == "safetensors"
        assert sorted(ckpt.tensors) == sorted(ref.tensors)
        for key, r in ref.tensors.items():
            t = ckpt.tensors[key]
            assert (t.dtype, t.shape) == (r.dtype, r.shape), key
            assert read_bytes(t.source, t.offset, t.nbytes) == read_bytes(r.source, r.offset, r.nbytes), key
        # the format's own files are weights, never carried into outputs
        assert not [f for f in ckpt.files if f.endswith(".npy") or f == MANIFEST]
    torch.save({"w": torch.ones(2)}, toy / "pytorch_model.bin")
    with pytest.raises(InputError) as e:  # two readers recognise the folder: the caller must choose
        Checkpoint.open(toy)
    assert e.value.rule == "ambiguous-weights" and MANIFEST in str(e.value) and "pytorch_model.bin" in str(e.value)
    assert open_draft_source(toy, NAME).reader == NAME
    (toy / "pytorch_model.bin").unlink()
    unregister(NAME)
    with pytest.raises(InputError) as e:  # unregistered, the tool knows nothing of the format
        Checkpoint.open(toy)
    assert e.value.rule == "no-weights"
    assert NAME not in READERS


def test_inspect_matches_the_safetensors_draft(toy_reader, native_draft, tmp_path):
    toy = as_npy_folder(native_draft, tmp_path / "toy")
    a = json.loads(run_ckpt("inspect", toy, "--json").output)
    b = json.loads(run_ckpt("inspect", native_draft, "--json").output)
    assert (a["reader"], b["reader"]) == (NAME, "safetensors")
    for report in (a, b):
        for field in ("path", "reader", "shards"):
            report.pop(field)
        for entry in report["tensors"]:
            entry.pop("shard", None)
        for total in report["totals"].values():
            total.pop("shards")  # one file per tensor here, one shard there
    assert a == b


def test_extract_and_stitch_match_the_safetensors_originals(toy_reader, verifier, native_draft, tmp_path):
    # extract from a verifier in the toy format: the same draft as from its safetensors
    run_ckpt("extract", as_npy_folder(verifier, tmp_path / "toy-verifier"), "-o", tmp_path / "from-toy")
    assert (tmp_path / "from-toy" / "model.safetensors").read_bytes() == \
        (native_draft / "model.safetensors").read_bytes()
    # stitch a draft in the toy format: the same checkpoint as from its safetensors
    run_ckpt("stitch", as_npy_folder(native_draft, tmp_path / "toy-draft"), verifier, "-o", tmp_path / "a")
    run_ckpt("stitch", native_draft, verifier, "-o", tmp_path / "b")
    shards = sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
