"""Coverage-guided fuzz target for the safetensors header reader (atheris / libFuzzer).

    python tests/fuzz_header.py -max_total_time=60 [CORPUS_DIR ...]

Contract under test, for any bytes: ``read_header`` either raises HeaderError naming its
rule, or accepts a file that the safetensors library accepts too and whose tensors cover
the data section exactly. Anything else (another exception, an accepted file the library
refuses, a hole or an overlap) is a crash that libFuzzer reports with the input that
caused it. tests/test_hostile.py runs it for a few seconds from a seed corpus; the
hypothesis properties in tests/test_header_fuzz.py explore the same contract by strategy.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from ckpt_tools.errors import HeaderError
    from ckpt_tools.io.safetensors_io import read_header

import safetensors  # noqa: E402 - the reference implementation, not instrumented

# Tokens that let mutations reach deep into the validation (libFuzzer -dict format).
DICT = [
    '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"format"', '"pt"', '"F32"', '"BF16"',
    '"F8_E4M3"', '"F4"', '"BOOL"', '"U8"', '"I64"', "[0,4]", "[]", "{}", "-1", "18446744073709551616",
    "1e3", "null", "true", '"\\ud800"', ":", ",",
]


class Mem:
    """A byte source over ``data`` that refuses reads past the end (the reader must never ask)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.name = "fuzz.safetensors"

    @property
    def size(self) -> int:
        return len(self.data)

    def readinto(self, offset: int, buf: memoryview) -> None:
        chunk = self.data[offset : offset + len(buf)]
        if len(chunk) != len(buf):
            raise AssertionError(f"read of {len(buf)} bytes at {offset} past the end of {len(self.data)}")
        buf[:] = chunk

    def local_fd(self):
        return None


def check(data: bytes) -> None:
    try:
        h = read_header(Mem(data))
    except HeaderError as e:
        if not e.rule:
            raise AssertionError("a HeaderError without a rule") from e
        return
    safetensors.deserialize(data)  # raises (= a crash) if the library refuses what we accepted
    end = 0
    for info in sorted(h.tensors.values(), key=lambda i: (i.begin, i.end)):
        if info.begin != end:
            raise AssertionError(f"accepted a header with a hole or overlap at {info.begin}")
        end = info.end
    if 8 + h.header_len + end != len(data):
        raise AssertionError("accepted a header that does not cover the file exactly")


def _claimed_end(body: bytes) -> int:
    """The data section a header body asks for (when small), so mutated headers can still be accepted."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return 0
    if not isinstance(obj, dict):
        return 0
    offsets = [v.get("data_offsets") for v in obj.values() if isinstance(v, dict)]
    ends = [o[1] for o in offsets if isinstance(o, list) and len(o) == 2 and isinstance(o[1], int)]
    end = max(ends, default=0)
    return end if 0 <= end <= 1 << 16 else 0


def test_one_input(data: bytes) -> None:
    """First byte: how to read the rest. 0: a whole file; 1: a header body (length prefix computed);
    2: a header body followed by the data section it claims. Modes 1 and 2 keep mutated headers
    consistent with their length field, so the fuzzer explores validation rather than framing."""
    if not data:
        return
    mode, body = data[0] % 3, data[1:]
    if mode == 0:
        check(body)
    elif mode == 1:
        check(struct.pack("<Q", len(body)) + body)
    else:
        check(struct.pack("<Q", len(body)) + body + bytes(_claimed_end(body)))


def seed_corpus(directory: Path) -> None:
    """A few valid files (and near misses) to start from: the fuzzer mutates structure, not noise."""
    directory.mkdir(parents=True, exist_ok=True)
    seeds = {
        "empty": {},
        "meta": {"__metadata__": {"format": "pt"}},
        "one": {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        "two": {"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
                "b": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]}},
        "fp4": {"x": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}},
        "zero": {"z": {"dtype": "F64", "shape": [0, 5], "data_offsets": [0, 0]}},
    }
    for name, header in seeds.items():
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        size = max([0] + [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"])
        (directory / f"{name}.file").write_bytes(b"\0" + struct.pack("<Q", len(raw)) + raw + bytes(size))
        (directory / f"{name}.body").write_bytes(b"\2" + raw)


def write_dict(path: Path) -> None:
    path.write_text("".join(f"kw{i}={json.dumps(tok)}\n" for i, tok in enumerate(DICT)))


def main(argv: list[str]) -> None:
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
