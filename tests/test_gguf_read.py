"""io.gguf_file.read_gguf decodes what gguf's own GGUFReader decodes (every value type, both byte orders), and
refuses what it refuses, with rule gguf-read."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ckpt_tools.errors import InputError  # noqa: E402
from ckpt_tools.io.gguf_file import read_gguf  # noqa: E402

T = gguf.GGUFValueType
VALUES = [
    ("u8", 200, T.UINT8), ("i8", -100, T.INT8), ("u16", 60000, T.UINT16), ("i16", -30000, T.INT16),
    ("u32", 4_000_000_000, T.UINT32), ("i32", -2_000_000_000, T.INT32), ("f32", 1e-5, T.FLOAT32),
    ("yes", True, T.BOOL), ("no", False, T.BOOL), ("s", "ünïcode ✓", T.STRING),
    ("u64", 2**63 + 5, T.UINT64), ("i64", -(2**62), T.INT64), ("f64", 1 / 3, T.FLOAT64),
]
ARRAYS = [
    ("tokens", ["<s>", "", "ä", "a b", "✓"] * 50, T.STRING), ("types", [1, 2, 3, 6] * 10, T.INT32),
    ("scores", [0.1, -2.5, 3e-8], T.FLOAT32), ("flags", [True, False, True], T.BOOL),
    ("bytes", [0, 255, 7], T.UINT8), ("big", [2**40, 3], T.UINT64),
]


def _write(path, endian, alignment=None) -> None:
    w = gguf.GGUFWriter(path, "demo", endianess=endian)
    if alignment is not None:
        w.data_alignment = alignment
        w.add_key_value("general.alignment", alignment, T.UINT32)
    for key, value, vtype in VALUES:
        w.add_key_value(f"demo.{key}", value, vtype)
    for key, value, sub in ARRAYS:
        w.add_key_value(f"demo.{key}", value, T.ARRAY, sub_type=sub)
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))  # the writer swaps the bytes of a big-endian file
    w.add_tensor("b", np.zeros((4, 5, 7), dtype=np.float16))
    w.add_tensor("q", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_reads_as_gguf_reader_reads_it(tmp_path, endian, alignment):
    path = tmp_path / "x.gguf"
    _write(path, endian, alignment)
    ours = read_gguf(path)
    theirs = gguf.GGUFReader(path, "r")
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.kv) == list(fields)
    for key, f in fields.items():
        kv = ours.kv[key]
        assert kv.value == f.contents() and kv.vtype == f.types[0], key
        assert [type(v) for v in np.atleast_1d(kv.value).tolist()] == [type(v) for v in
                                                                      np.atleast_1d(f.contents()).tolist()]
        if f.types[0] == T.ARRAY:
            assert kv.sub_type == f.types[-1]
    assert ours.kv["demo.s"].value == "ünïcode ✓" and ours.kv["demo.u64"].value == 2**63 + 5
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(reversed(t.shape.tolist())) and mine.type_name == t.tensor_type.name
        assert (mine.nbytes, mine.offset) == (int(t.n_bytes), int(t.data_offset))
    assert ours.tensors["q"].shape == (2, 32) and ours.tensors["q"].nbytes == 68


def _refused(path, what: str) -> None:
    with pytest.raises(InputError) as e:
        read_gguf(path)
    assert e.value.rule == "gguf-read" and what in str(e.value) and str(path) in str(e.value)


def test_a_truncated_or_foreign_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "x.gguf"
    _write(path, gguf.GGUFEndian.LITTLE)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in (3, 20, 200, len(data) // 3):
        cut.write_bytes(data[:end])
        _refused(cut, "not a readable GGUF file")
    (tmp_path / "st.gguf").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " * 3)
    _refused(tmp_path / "st.gguf", "magic")


def test_a_duplicate_key_or_a_bad_alignment_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    _write(path, gguf.GGUFEndian.LITTLE, alignment=64)
    data = path.read_bytes()
    dup = tmp_path / "dup.gguf"
    dup.write_bytes(data.replace(b"demo.i8", b"demo.u8", 1))
    _refused(dup, "duplicate key demo.u8")
    bad = tmp_path / "bad.gguf"
    key = b"general.alignment"
    at = data.index(key) + len(key) + 4  # past the key and its type
    bad.write_bytes(data[:at] + (48).to_bytes(4, "little") + data[at + 4:])
    _refused(bad, "power of two")


def test_a_tensor_whose_data_runs_past_the_end_is_refused(tmp_path):
    """A sidecar cut inside its last tensor's data: its metadata is whole, yet it is no GGUF to serve or verify."""
    path = tmp_path / "x.gguf"
    _write(path, gguf.GGUFEndian.LITTLE)
    data = path.read_bytes()
    last = max(read_gguf(path).tensors.values(), key=lambda t: t.offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:last.offset + last.nbytes - 1])
    _refused(cut, f"tensor {last.name} runs past the end of the file")
    cut.write_bytes(data[:last.offset + last.nbytes])  # exactly its data: readable
    assert read_gguf(cut).tensors[last.name].nbytes == last.nbytes
