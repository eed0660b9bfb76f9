"""Property tests: random and mutated headers only ever produce HeaderError, quickly and in small memory.

Whatever the reader accepts, the safetensors library must accept too (we are at least as
strict), and the accepted header must describe a data section covered exactly.
"""

from __future__ import annotations

import json
import struct
import tracemalloc

import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_tools.dtypes import DTYPES
from ckpt_tools.errors import HeaderError
from ckpt_tools.io import safetensors_io
from ckpt_tools.io.safetensors_io import parse_header_bytes, read_header

FAST = settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


class Mem:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.name = "fuzz.safetensors"

    @property
    def size(self) -> int:
        return len(self.data)

    def readinto(self, offset: int, buf: memoryview) -> None:
        chunk = self.data[offset : offset + len(buf)]
        assert len(chunk) == len(buf), "the reader asked for bytes past the end of the file"
        buf[:] = chunk

    def local_fd(self):
        return None


def check(data: bytes) -> None:
    """Read ``data``: either a HeaderError or a header the library accepts and that covers the data exactly."""
    try:
        h = read_header(Mem(data))
    except HeaderError as e:
        assert e.rule, "every HeaderError names its rule"
        return
    safetensors.deserialize(data)  # accepted by us => accepted by the reference implementation
    end = 0
    for info in sorted(h.tensors.values(), key=lambda i: i.begin):
        assert info.begin == end
        end = info.end
    assert 8 + h.header_len + end == len(data)


# -- random bytes ----------------------------------------------------------------------------


@FAST
@given(st.binary(max_size=256))
def test_random_bytes(data):
    check(data)


@FAST
@given(st.binary(max_size=200), st.integers(min_value=0, max_value=2**64 - 1))
def test_random_header_with_any_length_field(body, n):
    check(struct.pack("<Q", n) + body)


# -- mutated valid headers -------------------------------------------------------------------

DTYPE_NAMES = sorted(DTYPES)
weird = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=8), st.lists(st.integers(min_value=-3, max_value=2**64), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@st.composite
def valid_file(draw):
    """A valid header (possibly with metadata) and its data section."""
    n = draw(st.integers(min_value=0, max_value=4))
    header: dict = {}
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    pos = 0
    for i in range(n):
        dt = draw(st.sampled_from([d for d in DTYPE_NAMES if DTYPES[d].bits % 8 == 0]))
        shape = draw(st.lists(st.integers(min_value=0, max_value=4), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPES[dt].bits // 8
        header[f"t{i}"] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    return header, pos


@st.composite
def mutated_file(draw, least: int = 1):
    header, data_len = draw(valid_file())
    keys = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(min_value=least, max_value=3))):
        what = draw(st.sampled_from(["field", "dim", "offset", "extra", "drop", "meta", "key"]))
        if what == "meta":
            header["__metadata__"] = draw(weird)
        elif what == "extra":
            header[draw(st.text(max_size=6))] = draw(weird)
        elif keys:
            k = draw(st.sampled_from(keys))
            e = header[k]
            if not isinstance(e, dict):
                continue
            if what == "field":
                e[draw(st.sampled_from(["dtype", "shape", "data_offsets", "junk"]))] = draw(weird)
            elif what == "dim" and isinstance(e.get("shape"), list):
                e["shape"] = e["shape"] + [draw(st.integers(min_value=-1, max_value=2**63))]
            elif what == "offset" and isinstance(e.get("data_offsets"), list) and e["data_offsets"]:
                e["data_offsets"][draw(st.integers(0, len(e["data_offsets"]) - 1))] += draw(
                    st.integers(min_value=-9, max_value=2**40))
            elif what == "drop":
                e.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
            elif what == "key":
                header[draw(st.text(max_size=6))] = header.pop(k)
                keys = [x for x in header if x != "__metadata__"]
    # compact (safetensors' and our writers' layout: the regular-expression path) or json.dumps' default spacing
    compact = draw(st.booleans())
    raw = json.dumps(header, allow_nan=True, separators=(",", ":") if compact else None,
                     ensure_ascii=not compact or draw(st.booleans())).encode()
    raw += b" " * draw(st.integers(0, 7))
    data_len = max(0, data_len + draw(st.integers(min_value=-3, max_value=3)))
    data = struct.pack("<Q", len(raw)) + raw + bytes(data_len)
    if draw(st.booleans()):  # flip a byte somewhere in the header
        i = draw(st.integers(8, max(8, 8 + len(raw) - 1)))
        if i < len(data):
            data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
    return data


@FAST
@given(mutated_file())
def test_mutated_headers(data):
    check(data)


def _read(data: bytes) -> tuple:
    try:
        h = read_header(Mem(data))
    except HeaderError as e:
        return e.rule, str(e)
    refs = [(k, r[1:]) for k, r in (h.refs or {}).items()]  # (without the source: one per read)
    return h.header_len, list(h.tensors.items()), refs, h.metadata, h.sha256


def _by_json(data: bytes) -> tuple:
    saved = safetensors_io._compact
    safetensors_io._compact = lambda *a: None
    try:
        return _read(data)
    finally:
        safetensors_io._compact = saved


@st.composite
def compact_file(draw):
    """A compact header (the regular-expression path's) with a character JSON cares about put in, or not."""
    header, data_len = draw(valid_file())
    text = json.dumps(header, separators=(",", ":"))
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(0, len(text) - 1))
        cut = i + draw(st.integers(0, 2))  # insert, replace one, replace two
        text = text[:i] + draw(st.sampled_from('{}[],:"\\0123456789-.eE +_a\u00e9\x00\t')) + text[cut:]
    raw = text.encode() + b" " * draw(st.integers(0, 3))
    return struct.pack("<Q", len(raw)) + raw + bytes(max(0, data_len + draw(st.integers(-2, 2))))


@settings(FAST, max_examples=500)
@given(st.one_of(compact_file(), mutated_file(least=0)))
def test_compact_path_reads_what_json_reads(data):
    """Whatever the regular-expression path decides (a header, or None: json decides) is what json decides."""
    assert _read(data) == _by_json(data)


@pytest.mark.parametrize(("a", "refused"), [
    ('"shape":[2,04],"data_offsets":[0,16]', True), ('"shape":[2,,4],"data_offsets":[0,16]', True),
    ('"shape":[8],"data_offsets":[0,016]', True), ('"shape":[8],"data_offsets":[00,16]', True),
    ('"shape":[2,4],"data_offsets":[0,16]', False)])
def test_compact_numbers_are_json_integers(a, refused):
    """The regular expression reads digits; a leading zero or an empty dimension is still json's to refuse."""
    raw = ('{"a":{"dtype":"F16",' + a + '},"b":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}}').encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(20)
    got = _read(data)
    assert got == _by_json(data)
    assert isinstance(got[0], str) == refused  # (rule, message) when refused, else the header's length first


def test_compact_header_makes_no_json_object_per_entry(monkeypatch):
    """A header as safetensors writes it (compact, with metadata, padded) is read without json's objects."""
    header = {"__metadata__": {"format": "pt", "note": "a \\ \"quoted\" \u00e9"},
              "a.weight": {"dtype": "F8_E4M3", "shape": [4, 8], "data_offsets": [0, 32]},
              "a.weight_scale_inv": {"dtype": "F32", "shape": [1, 1], "data_offsets": [32, 36]},
              "b": {"dtype": "BF16", "shape": [], "data_offsets": [36, 38]}}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode() + b"   "
    data = struct.pack("<Q", len(raw)) + raw + bytes(38)
    expected = _read(data)
    monkeypatch.setattr(safetensors_io, "_load_fast", lambda text: pytest.fail("json read a compact header"))
    assert _read(data) == expected
    assert expected[3] == header["__metadata__"]
    assert [k for k, _ in expected[1]] == ["a.weight", "a.weight_scale_inv", "b"]


@FAST
@given(valid_file())
def test_valid_headers_are_accepted(file):
    header, data_len = file
    raw = json.dumps(header).encode()
    h = read_header(Mem(struct.pack("<Q", len(raw)) + raw + bytes(data_len)))
    assert set(h.tensors) == {k for k in header if k != "__metadata__"}


# -- hostile sizes: no allocation proportional to what a header claims ------------------------


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except HeaderError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_claimed_90mb_header_in_a_tiny_file_allocates_nothing_big():
    data = struct.pack("<Q", 90_000_000) + b'{"a": 1}'
    peak = _peak(lambda: read_header(Mem(data)))
    assert peak < 1_000_000, peak


@FAST
@given(st.lists(st.integers(min_value=0, max_value=2**62), min_size=1, max_size=6),
       st.sampled_from(DTYPE_NAMES), st.integers(min_value=0, max_value=2**62))
def test_huge_shapes_and_offsets_in_a_tiny_file(shape, dtype, end):
    raw = json.dumps({"a": {"dtype": dtype, "shape": shape, "data_offsets": [0, end]}}).encode()
    data = struct.pack("<Q", len(raw)) + raw + b"\0" * 16
    peak = _peak(lambda: read_header(Mem(data)))
    assert peak < 1_000_000, peak


def test_deeply_nested_json_is_a_header_error():
    raw = b"{" + b'"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    try:
        parse_header_bytes(raw, 8 + len(raw), "nested.safetensors")
    except HeaderError as e:
        assert e.rule in ("header-json", "tensor-entry")
    else:
        raise AssertionError("accepted a nested header")
