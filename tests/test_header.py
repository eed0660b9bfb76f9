"""The strict safetensors header reader: one case per format rule, checked against the safetensors library.

Every file our reader refuses for a rule the library also enforces must be refused by
``safetensors.deserialize`` too (the library is the oracle); files both accept must
describe the same tensors.
"""

from __future__ import annotations

import json
import struct

import pytest
import safetensors
import torch
from safetensors.torch import save

from ckpt_tools.errors import HeaderError
from ckpt_tools.io.safetensors_io import LocalFile, read_header


class Mem:
    """An in-memory ByteSource."""

    def __init__(self, data: bytes, name: str = "mem.safetensors") -> None:
        self.data = data
        self.name = name

    @property
    def size(self) -> int:
        return len(self.data)

    def readinto(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.data[offset : offset + len(buf)]

    def local_fd(self):
        return None


def entry(dtype: str, shape: list, offsets: list) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def file_bytes(header, data: bytes = b"", n: int | None = None) -> bytes:
    raw = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


A = entry("F32", [2], [0, 8])
EIGHT = b"\0" * 8

# (rule, file bytes, does the safetensors library enforce it too)
CASES = [
    ("header-length", b"\x01\x02", True),
    ("header-length", file_bytes({"a": A}, EIGHT, n=1000), True),
    ("header-too-large", file_bytes({"a": A}, EIGHT, n=200_000_000), True),
    ("header-json", file_bytes('{"a": {"dtype": "F32", ', b""), True),
    ("header-json", struct.pack("<Q", 8) + b'{"\xff":12}', True),
    ("header-not-object", file_bytes("[1, 2]"), True),
    ("duplicate-key", file_bytes('{"a":' + json.dumps(A) + ',"a":' + json.dumps(A) + "}", EIGHT), False),
    ("metadata-not-string", file_bytes({"__metadata__": {"format": 1}, "a": A}, EIGHT), True),
    ("metadata-not-string", file_bytes({"__metadata__": ["pt"], "a": A}, EIGHT), True),
    ("tensor-entry", file_bytes({"a": {**A, "extra": 1}}, EIGHT), False),
    ("tensor-entry", file_bytes({"a": 5}), True),
    ("unknown-dtype", file_bytes({"a": entry("Q4", [2], [0, 8])}, EIGHT), True),
    ("bad-shape", file_bytes({"a": entry("F32", [-2], [0, 8])}, EIGHT), True),
    ("bad-shape", file_bytes({"a": entry("F32", [2.0], [0, 8])}, EIGHT), True),
    ("bad-shape", file_bytes({"a": entry("BOOL", [True], [0, 1])}, b"\0"), True),
    # found by the coverage-guided fuzzer: a list (or string) among big dimensions, which an integer product
    # would repeat into petabytes before any type check
    ("bad-shape", file_bytes({"a": entry("F64", [24444444, [3], 44444444], [0, 8])}, EIGHT), True),
    ("bad-shape", file_bytes({"a": entry("F64", [10**9, "x"], [0, 8])}, EIGHT), True),
    ("bad-offsets", file_bytes({"a": entry("F32", [2], [8, 0])}, EIGHT), True),
    ("misaligned", file_bytes({"a": entry("F4", [3], [0, 2])}, b"\0\0"), True),
    ("size-mismatch", file_bytes({"a": entry("F32", [3], [0, 8])}, EIGHT), True),
    ("size-mismatch", file_bytes({"a": entry("F32", [2**40, 2**40], [0, 8])}, EIGHT), True),
    ("overlap", file_bytes({"a": A, "b": A}, EIGHT), True),
    ("offsets-not-contiguous", file_bytes({"a": entry("F32", [2], [8, 16])}, EIGHT * 2), True),
    ("past-end", file_bytes({"a": A}, b"\0" * 4), True),
    ("trailing-bytes", file_bytes({"a": A}, b"\0" * 12), True),
]


@pytest.mark.parametrize(("rule", "data", "library_enforces"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_rule_is_refused_with_its_name(rule, data, library_enforces):
    with pytest.raises(HeaderError) as info:
        read_header(Mem(data))
    assert info.value.rule == rule
    assert f"[{rule}]" in str(info.value) and "mem.safetensors" in str(info.value)
    if library_enforces:
        with pytest.raises(safetensors.SafetensorError):
            safetensors.deserialize(data)
    else:  # stricter than the library on purpose: ambiguous files are refused
        safetensors.deserialize(data)


def _tensors():
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 5, dtype=torch.int8),
        "fp8": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.float8_e4m3fn),
        "flag": torch.tensor([True, False, True]),
    }


def test_library_files_are_read_exactly(tmp_path):
    tensors = _tensors()
    data = save(tensors, metadata={"format": "pt"})
    h = read_header(Mem(data))
    assert h.metadata == {"format": "pt"}
    assert set(h.tensors) == set(tensors)
    with _open(data, tmp_path) as f:
        for key in tensors:
            info = h.tensors[key]
            assert list(info.shape) == f.get_slice(key).get_shape()
            assert info.dtype == f.get_slice(key).get_dtype()
    # the byte range of each tensor holds exactly the library's bytes
    for key, t in tensors.items():
        info = h.tensors[key]
        raw = data[h.data_start + info.begin : h.data_start + info.end]
        assert raw == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _open(data: bytes, tmp_path):
    p = tmp_path / "lib.safetensors"
    p.write_bytes(data)
    return safetensors.safe_open(str(p), framework="pt")


def test_leading_whitespace_and_padding_are_accepted():
    body = '  {"a":' + json.dumps(A) + "}    "
    data = file_bytes(body, EIGHT)
    assert set(read_header(Mem(data)).tensors) == {"a"}
    safetensors.deserialize(data)  # the library agrees


def test_metadata_without_format_is_a_valid_file():
    data = file_bytes({"__metadata__": {"producer": "x"}, "a": A}, EIGHT)
    assert read_header(Mem(data)).metadata == {"producer": "x"}


def test_local_file_reads_header_without_touching_data(tmp_path):
    from ckpt_tools.io.safetensors_io import IO_STATS

    p = tmp_path / "big.safetensors"
    raw = json.dumps({"a": entry("U8", [50_000_000], [0, 50_000_000])}).encode()
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 50_000_000)  # sparse: no data written
    IO_STATS.reset()
    src = LocalFile(p)
    try:
        h = read_header(src)
    finally:
        src.close()
    assert h.tensors["a"].nbytes == 50_000_000
    assert IO_STATS.bytes_read == 8 + len(raw)
