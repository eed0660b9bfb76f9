"""Strict safetensors headers, tensor references and byte-range I/O.

Nothing here loads a whole file: a header costs two small reads, a tensor's bytes
are read (or kernel-copied) from its exact range. Every format rule is checked
with an error that names the file and the rule, in the spirit of safetensors'
own ``Metadata::validate``.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import math
import os
import re
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, attrgetter, itemgetter, sub
from pathlib import Path
from typing import NamedTuple, Protocol

from ..dtypes import DTYPES, DType
from ..errors import HeaderError, InputError

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE
COPY_CHUNK = 16 << 20  # buffered fallback chunk: 16 MiB


# ---------------------------------------------------------------------------
# I/O accounting: every byte we read or copy from a source is counted, so tests
# and `--json` reports can prove that only the planned ranges were touched.


@dataclass
class IOStats:
    bytes_read: int = 0  # read into user space (headers, computed tensors)
    bytes_copied: int = 0  # moved by byte-range copies (kernel or buffered)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # a thread reading the output (the writer's check beside the copies), not the inputs: not counted
    _quiet: threading.local = field(default_factory=threading.local, repr=False)

    def add_read(self, n: int) -> None:
        if getattr(self._quiet, "on", False):
            return
        with self._lock:
            self.bytes_read += n

    def quiet(self) -> None:
        """This thread's reads are not counted from now on."""
        self._quiet.on = True

    def add_copied(self, n: int) -> None:
        with self._lock:
            self.bytes_copied += n

    @property
    def total(self) -> int:
        return self.bytes_read + self.bytes_copied

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = 0
            self.bytes_copied = 0


IO_STATS = IOStats()


# ---------------------------------------------------------------------------
# Byte sources: a local file, or (see ``sources``) a remote file read by ranges.


class ByteSource(Protocol):
    name: str  # shown in error messages

    @property
    def size(self) -> int: ...

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` completely from ``offset``; raise InputError on a short read."""

    def local_fd(self) -> int | None:
        """An OS file descriptor usable with copy_file_range, or None for remote sources."""


class LocalFile:
    """A read-only local file, opened once and read with pread."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.name = str(path)
        try:
            # ``path`` itself, not a copy: a path object may fetch its file when opened (hub cache)
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise InputError(f"cannot open: {e.strerror}", path=self.name) from e
        self._size = os.fstat(self._fd).st_size

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, offset: int, buf: memoryview) -> None:
        done = 0
        while done < len(buf):
            try:
                n = os.preadv(self._fd, [buf[done:]], offset + done)
            except OSError as e:
                raise read_error(e, self.name, offset + done) from e
            if n <= 0:
                raise short_read(self.name, offset + done)
            done += n
        IO_STATS.add_read(done)

    def local_fd(self) -> int | None:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter shutdown
        # no module globals here (contextlib, os may already be None at shutdown): builtins only
        try:
            self.close()
        except Exception:  # noqa: S110 - nothing to report to at shutdown
            pass


def read_error(e: OSError, name: str, at: int) -> InputError:
    """An input that cannot be read is an input error (exit 3) naming it, never an output error."""
    return InputError(f"cannot read at byte {at}: {e.strerror or e}", rule="read-error", path=name)


def short_read(name: str, at: int) -> InputError:
    return InputError(f"short read at byte {at} (file changed or shrank while reading?)", rule="short-read",
                      path=name)


def read_bytes(src: ByteSource, offset: int, length: int) -> bytearray:
    buf = bytearray(length)
    if length:
        src.readinto(offset, memoryview(buf))
    return buf


# ---------------------------------------------------------------------------
# Headers


class TensorInfo(NamedTuple):
    """One header entry. ``begin``/``end`` are relative to the data section.

    A tuple, not a dataclass: a release's headers hold ~92,000 entries, and this is 4x cheaper to make.
    """

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    source_name: str
    header_len: int
    tensors: Mapping[str, TensorInfo]
    metadata: dict[str, str] | None
    sha256: str = ""  # of the header JSON bytes as read: part of an input's fingerprint
    # read from a source (read_header): its entries as references into it, which ``tensors`` is a view of (one
    # object per tensor: a release's checkpoint references are these same 92,000 objects)
    refs: dict[str, TensorRef] | None = field(default=None, compare=False, repr=False)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_bytes(self) -> int:
        """The bytes its tensors span (without making an entry per tensor when the references are there)."""
        entries = self.refs if self.refs is not None else self.tensors
        return sum(map(_NBYTES, entries.values()))  # in C for references (a field; TensorInfo's is a property)

    def in_offset_order(self) -> list[str]:
        """Its keys by offset (writers store them so: then no sort)."""
        entries = self.refs if self.refs is not None else self.tensors
        begins = list(map(_OFFSET if self.refs is not None else _BEGIN, entries.values()))
        if begins == sorted(begins):  # a sorted list is one run to sort: linear, in C
            return list(entries)
        order = sorted(range(len(begins)), key=begins.__getitem__)  # stable: ties keep their order
        keys = list(entries)
        return [keys[i] for i in order]


_OFFSET = attrgetter("offset")
_BEGIN = attrgetter("begin")
_NBYTES = attrgetter("nbytes")


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


# A \ud800-\udfff escape: Python's json decodes a lone one into a string that is not UTF-8 (the library
# refuses it, and no output header could hold it). Valid UTF-8 text cannot contain one otherwise.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _lone_surrogate(obj: object) -> str | None:
    """The first key (or string value) holding a lone surrogate, walking without recursion."""
    stack = [obj]
    while stack:
        o = stack.pop()
        items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
        for k, v in items:
            for s in (k, v):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        return s
            if isinstance(v, (dict, list)):
                stack.append(v)
    return None


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


# Far beyond any real tensor (numpy stops at 64 dims); refusing early keeps a 100 MB list of dims cheap.
MAX_RANK = 1024
MAX_NUMEL = 2**64 - 1  # the library multiplies dims in u64 (checked_mul) and refuses an overflow
EXACT_FLOAT = 2**53  # every integer up to it is a float


def _numel(shape: list[int]) -> int | None:
    """Element count, or None when it overflows 64 bits (checked dim by dim, like the library)."""
    n = 1
    for d in shape:
        n *= d
        if n > MAX_NUMEL:
            return None
    return n


def _short(v: object, limit: int = 80) -> str:
    """repr of a hostile value, cut short for error messages."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _parse_int(s: str) -> int | float:
    """Negative integer literals (including -0) become floats: no shape or offset may be negative."""
    return float(s) if s.startswith("-") else int(s)


def _is_int(v: object) -> bool:
    """A JSON integer the library can hold: it parses dims and offsets as u64."""
    return isinstance(v, int) and not isinstance(v, bool) and v <= MAX_NUMEL


def parse_header_bytes(raw: bytes | bytearray, file_size: int, name: str, src: ByteSource | None = None,
                       hasher: Executor | None = None) -> Header:
    """Validate header JSON ``raw`` (without the 8-byte length) of a file of ``file_size`` bytes (``src``: the
    file it was read from, whose tensor references the header then holds; ``hasher``: a thread that takes its
    sha256 while it is parsed - hashlib releases the GIL)."""
    digest = hasher.submit(_sha256_hex, raw) if hasher is not None else None
    if digest is not None:  # the hasher takes the GIL now and hashes (without it) while this thread parses; else it
        time.sleep(0)  # waits for the parse to end (the switch interval, 5 ms, is longer) and the two run in turn

    def fail(rule: str, msg: str) -> HeaderError:
        return HeaderError(msg, rule=rule, path=name)

    header_len = len(raw)
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail("header-json", f"header is not valid UTF-8 (byte {e.start})") from None
    data_len = file_size - 8 - header_len
    compact = _compact(text, src, 8 + header_len)
    if compact is not None:
        metadata, entries, end = compact
        _check_end(end, data_len, fail)
        tensors = entries if src is None else _InfoView(entries, 8 + header_len)
        return Header(name, header_len, tensors, metadata, digest.result() if digest else _sha256_hex(raw),
                      None if src is None else entries)
    if not text.lstrip().startswith("{"):
        raise fail("header-not-object", "header JSON must be an object starting with '{'")
    obj = _load_fast(text)
    if obj is None:
        obj = _load_strict(text, fail)
    if not isinstance(obj, dict):
        raise fail("header-not-object", "header JSON must be an object")
    if _SURROGATE_ESCAPE.search(text) and (bad := _lone_surrogate(obj)) is not None:
        raise fail("header-json", f"{_short(bad)} holds a lone UTF-16 surrogate escape (not valid UTF-8)")

    metadata = obj.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise fail("metadata-not-string", "__metadata__ must be an object of strings")
        for k, v in metadata.items():
            if not isinstance(v, str):
                raise fail("metadata-not-string", f"__metadata__[{k!r}] is {type(v).__name__}, not a string")

    fast = _entries_fast(obj, src, 8 + header_len)
    refs = None
    if fast is None:
        tensors: Mapping[str, TensorInfo] = _entries_strict(obj, fail)
        _check_coverage(tensors, data_len, fail)
    else:
        entries, end = fast
        if src is not None:
            refs, tensors = entries, _InfoView(entries, 8 + header_len)
        else:
            tensors = entries
        if end is None:  # not stored in offset order: the sorting check names what is wrong, if anything
            _check_coverage(tensors, data_len, fail)
        else:
            _check_end(end, data_len, fail)
    return Header(name, header_len, tensors, metadata, digest.result() if digest else _sha256_hex(raw), refs)


def _sha256_hex(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


class _InfoView(Mapping):
    """A header's entries (``TensorInfo``, offsets relative to the data section) seen through its references."""

    __slots__ = ("_refs", "_base")

    def __init__(self, refs: dict[str, TensorRef], base: int) -> None:
        self._refs, self._base = refs, base

    def __getitem__(self, key: str) -> TensorInfo:
        r = self._refs[key]
        begin = r.offset - self._base
        return TensorInfo(r.dtype, r.shape, begin, begin + r.nbytes)

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)


def _load_fast(text: str) -> dict | None:
    """The header parsed by json's C scanner alone, or None when only the strict parser can vouch for it.

    The strict parser's hook rejects a key that appears twice, at a Python call per JSON object (92,000 in a
    release's headers). Here: a ':' outside strings separates exactly one pair, so when the text holds no more
    ':' than the keys of the parsed top-level object and of its object values, no object anywhere lost a
    duplicate (a deeper object, or a ':' inside a string, only makes the count larger: the strict path runs).
    """
    if "-0" in text:  # the strict parser reads negative integers as floats (see _parse_int)
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None  # the strict parser names the error
    if type(obj) is not dict:
        return None
    values = obj.values()
    pairs = len(obj) + (sum(map(len, values)) if set(map(type, values)) == {dict} else
                        sum(len(v) for v in values if type(v) is dict))
    return obj if text.count(":") == pairs else None


# A header as safetensors' own writer (serde_json) and ours store it: compact JSON, fields in the order dtype, shape,
# data_offsets, keys without escapes. One regular expression reads it into columns, and every check is one C-level
# pass over a column (or over its few distinct dtypes and shapes): no JSON object per entry, ~40% less time at
# release scale. Anything else (and any doubt) goes to json (_load_fast / _load_strict), which names the rule.
# Numbers are read as digits (a plain class scans faster than JSON's integer grammar); that they are JSON integers
# (no leading zero, no empty dimension) is checked on the columns: each distinct shape once, the offsets as the ends
# they continue, written back
_ENTRY = re.compile(r'([{,])"([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]+)","shape":\[([0-9,]*)\],'
                    r'"data_offsets":\[([0-9]+),([0-9]+)\]\}')
_ENTRY_CHARS = len('{"":{"dtype":"","shape":[],"data_offsets":[,]}')  # an entry's characters besides its groups
_METADATA = '{"__metadata__":'
_STRICT = json.JSONDecoder(object_pairs_hook=_reject_duplicates)


def _compact(text: str, src: ByteSource | None, base: int) -> tuple[dict | None, dict, int] | None:
    """(metadata, entries, end of the data they cover) of a compact header whose entries are stored in offset
    order without holes, every one well-formed (see ``_entries_fast`` for what entries are); None otherwise."""
    last = len(text.rstrip(" \t\n\r")) - 1  # where the object closes (the writer pads with spaces)
    metadata = None
    at = 0
    if text.startswith(_METADATA):
        if _SURROGATE_ESCAPE.search(text):
            return None
        try:
            metadata, at = _STRICT.raw_decode(text, len(_METADATA))
        except (ValueError, RecursionError, _Duplicate):
            return None
        if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
            return None
    if last <= at or text[last] != "}" or text[0] != "{":
        return None
    rows = _ENTRY.findall(text, at, last)
    if not rows:
        return None
    seps, keys, dtypes, shapes, begins, ends = zip(*rows, strict=True)
    n = len(rows)
    # the entries tile the text between the braces (their lengths add up to it: nothing else in between), the
    # first after '{' or the metadata, the others after ','
    if (sum(map(len, keys)) + sum(map(len, dtypes)) + sum(map(len, shapes)) + sum(map(len, begins))
            + sum(map(len, ends)) + n * _ENTRY_CHARS != last - at or seps[0] != ("," if at else "{")
            or seps.count(",") != n - (not at)):
        return None
    sizes = {}  # (dtype, shape text) -> its shape and byte size: a few dozen in a release
    try:
        for dtype, shape in set(zip(dtypes, shapes, strict=True)):
            dims = tuple(map(int, shape.split(","))) if shape else ()
            numel = _numel(dims) if len(dims) <= MAX_RANK else None
            bits = _BITS.get(dtype)
            if (numel is None or bits is None or numel * bits & 7 or max(dims, default=0) > MAX_NUMEL
                    or ",".join(map(str, dims)) != shape):  # a leading zero
                return None
            sizes[dtype, shape] = dims, numel * bits >> 3
        # each entry begins where the one before ends (as text: then a begin is a JSON integer as that end is)
        if begins[0] != "0" or begins[1:] != ends[:-1]:
            return None  # out of order too: the json path sorts them and names what is wrong
        ends_text, ends = ends, list(map(int, ends))
        if list(map(str, ends)) != list(ends_text):  # a leading zero
            return None
    except ValueError:  # an empty dimension, or an integer of more digits than int() reads
        return None
    begins = [0, *ends[:-1]]
    shape_size = list(map(sizes.__getitem__, zip(dtypes, shapes, strict=True)))
    nbytes = list(map(sub, ends, begins))
    if nbytes != list(map(itemgetter(1), shape_size)) or ends[-1] > MAX_NUMEL or "__metadata__" in keys:
        return None
    new = tuple.__new__
    dims = map(itemgetter(0), shape_size)
    # (not strict: repeat is endless)
    fields = (zip(repeat(src), keys, dtypes, dims, map(add, repeat(base), begins), nbytes, strict=False)
              if src is not None else zip(dtypes, dims, begins, ends, strict=True))
    entries = dict(zip(keys, map(new, repeat(TensorInfo if src is None else TensorRef), fields), strict=True))
    return (metadata, entries, ends[-1]) if len(entries) == n else None  # else a key appears twice


def _load_strict(text: str, fail) -> object:
    try:
        # "-0" is an integer to Python but a float to the library (serde_json), which refuses it as a size
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_int=_parse_int if "-0" in text else None)
    except _Duplicate as d:
        raise fail("duplicate-key", f"key {_short(d.key)} appears twice in the header") from None
    except RecursionError:
        raise fail("header-json", "header JSON is nested too deeply") from None
    except ValueError as e:
        raise fail("header-json", f"header is not valid JSON: {e}") from None


_BITS = {name: dt.bits for name, dt in DTYPES.items()}


def _entries_fast(obj: dict, src: ByteSource | None = None, base: int = 0) -> tuple[dict, int | None] | None:
    """The entries of a well-formed header, checked with a few operations per entry and the integer checks
    done once over all of them; None at the first doubt, for ``_entries_strict`` to name the rule broken.

    The entries are TensorInfos, or with ``src`` TensorRefs into it (``base``: where its data section starts);
    with them the end of the data they cover when they are stored in offset order without holes (else None)."""
    tensors: dict = {}
    numbers: list[list] = []
    add = numbers.append
    prod = math.prod
    bits_of = _BITS.get
    new = tuple.__new__  # the tuple itself, without the named tuple's Python-level __new__ (92,000 per release)
    cls = TensorInfo if src is None else TensorRef
    expected: int | None = 0
    try:
        for key, entry in obj.items():
            if type(entry) is not dict or len(entry) != 3:
                return None
            dtype_name, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
            if type(shape) is not list or type(offs) is not list or len(offs) != 2 or len(shape) > MAX_RANK:
                return None
            bits = bits_of(dtype_name)  # JSON gives str keys; an unhashable dtype is a TypeError: strict path
            if bits is None:
                return None
            # a float product: it raises on a list or string among the dimensions, where the integer product
            # would build it repeated (a [big, [3], big] shape asked for petabytes); exact up to 2**53 elements
            # (no partial product exceeds a nonzero total), beyond that the strict path counts exactly. A float,
            # bool or negative dimension or offset is refused after the loop.
            numel = prod(shape, start=1.0)
            if numel > EXACT_FLOAT:
                return None
            size = int(numel) * bits
            begin, end = offs
            if size & 7 or end - begin != size >> 3:
                return None
            add(shape)
            add(offs)
            tensors[key] = new(cls, (dtype_name, tuple(shape), begin, end) if src is None else
                               (src, key, dtype_name, tuple(shape), base + begin, end - begin))
            expected = end if begin == expected else None
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    flat = list(itertools.chain.from_iterable(numbers))
    # every dimension and offset a JSON integer in [0, 2**64) (not a float, bool or string)
    if flat and (set(map(type, flat)) != {int} or min(flat) < 0 or max(flat) > MAX_NUMEL):
        return None
    return tensors, expected


def _entries_strict(obj: dict, fail) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for key, entry in obj.items():
        key_s = _short(key)
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise fail("tensor-entry", f"tensor {key_s} must have exactly dtype, shape and data_offsets")
        dtype_name = entry["dtype"]
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise fail("unknown-dtype", f"tensor {key_s} has unknown dtype {_short(dtype_name)}")
        shape = entry["shape"]
        if isinstance(shape, list) and len(shape) > MAX_RANK:
            raise fail("bad-shape", f"tensor {key_s} has {len(shape)} dimensions (at most {MAX_RANK})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise fail("bad-shape", f"tensor {key_s} shape {_short(shape)} is not a list of integers in [0, 2**64)")
        offs = entry["data_offsets"]
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(_is_int(o) and o >= 0 for o in offs)
            or offs[0] > offs[1]
        ):
            raise fail("bad-offsets", f"tensor {key_s} data_offsets {_short(offs)} is not [begin, end] with "
                       "0 <= begin <= end < 2**64")
        numel = _numel(shape)
        if numel is None:
            # no span in a real file can match (the library's checked_mul overflows here too)
            raise fail("size-mismatch", f"tensor {key_s}: data_offsets span {offs[1] - offs[0]} bytes but shape "
                       f"{_short(shape)} has more than 2**64 elements")
        dt: DType = DTYPES[dtype_name]
        bits = numel * dt.bits
        if bits % 8:
            raise fail("misaligned",
                       f"tensor {key_s}: {dtype_name} x {_short(shape)} does not end on a byte boundary")
        if offs[1] - offs[0] != bits // 8:
            raise fail(
                "size-mismatch",
                f"tensor {key_s}: data_offsets span {offs[1] - offs[0]} bytes but {dtype_name} x {_short(shape)} "
                f"needs {bits // 8}",
            )
        tensors[key] = TensorInfo(dtype_name, tuple(shape), offs[0], offs[1])
    return tensors


def _check_coverage(tensors: dict[str, TensorInfo], data_len: int, fail) -> None:
    """The data section must be covered exactly: sorted by offsets, from 0, no holes or overlaps."""
    expected = 0
    for info in tensors.values():  # writers store tensors in offset order: then no sort is needed
        if info.begin != expected:
            break
        expected = info.end
    else:
        _check_end(expected, data_len, fail)
        return
    expected = 0
    for key, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin < expected:
            raise fail("overlap", f"tensor {_short(key)} starts at {info.begin}, inside the previous tensor "
                       f"(which ends at {expected})")
        if info.begin > expected:
            raise fail("offsets-not-contiguous",
                       f"tensor {_short(key)} starts at {info.begin}, leaving a hole after {expected}")
        expected = info.end
    _check_end(expected, data_len, fail)


def _check_end(expected: int, data_len: int, fail) -> None:
    if expected > data_len:
        raise fail("past-end", f"tensors need {expected} data bytes but the file holds {data_len}")
    if expected < data_len:
        raise fail("trailing-bytes", f"{data_len - expected} bytes after the last tensor")


def read_header(src: ByteSource, hasher: Executor | None = None) -> Header:
    """Read and validate the header of ``src`` without touching tensor data (``hasher``: see
    ``parse_header_bytes``)."""
    size = src.size
    if size < 8:
        raise HeaderError(f"file is {size} bytes, too short for the 8-byte header length",
                          rule="header-length", path=src.name)
    (n,) = struct.unpack("<Q", read_bytes(src, 0, 8))
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit", rule="header-too-large",
                          path=src.name)
    if 8 + n > size:
        raise HeaderError(f"header length {n} runs past the end of the {size}-byte file", rule="header-length",
                          path=src.name)
    return parse_header_bytes(read_bytes(src, 8, n), size, src.name, src, hasher)


# ---------------------------------------------------------------------------
# Tensor references


class TensorRef(NamedTuple):
    """A tensor inside a source file: where its bytes are, and what they mean.

    A tuple (immutable, no per-instance dict): a release has 92,000 of them, and a tuple is the cheapest
    object to make (``_replace`` makes a renamed copy).
    """

    source: ByteSource
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def file(self) -> str:
        return self.source.name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def segment(self, start: int = 0, length: int | None = None) -> Segment:
        """A byte range of this tensor (relative ``start``), for byte-level recipes."""
        length = self.nbytes - start if length is None else length
        if start < 0 or start + length > self.nbytes:
            raise ValueError(f"range {start}+{length} outside {self.key} ({self.nbytes} bytes)")
        return Segment(self.source, self.offset + start, length)

    def read(self) -> bytearray:
        return read_bytes(self.source, self.offset, self.nbytes)

    def numpy(self):
        """The tensor as a numpy array (bf16 and fp8 come back as their raw uint views)."""
        from ..arrays import bytes_to_numpy

        return bytes_to_numpy(self.read(), self.dtype, self.shape)

    def torch(self):
        from ..arrays import bytes_to_torch

        return bytes_to_torch(self.read(), self.dtype, self.shape)


def refs_from_header(src: ByteSource, header: Header) -> dict[str, TensorRef]:
    if header.refs is not None and all(r.source is src for r in itertools.islice(header.refs.values(), 1)):
        return dict(header.refs)
    base = header.data_start
    return {
        key: TensorRef(src, key, info.dtype, info.shape, base + info.begin, info.nbytes)
        for key, info in header.tensors.items()
    }


# ---------------------------------------------------------------------------
# Byte-range copies


@dataclass(frozen=True, slots=True)  # slots: a plan holds one per copied tensor (92,000 for a release)
class Segment:
    """``length`` bytes of ``source`` starting at absolute ``offset``."""

    source: ByteSource
    offset: int
    length: int


def coalesce(segments: list[Segment]) -> list[Segment]:
    """Merge segments that continue each other in the same source (fewer, larger copies)."""
    out: list[Segment] = []
    for s in segments:
        if s.length == 0:
            continue
        if out and out[-1].source is s.source and out[-1].offset + out[-1].length == s.offset:
            out[-1] = Segment(s.source, out[-1].offset, out[-1].length + s.length)
        else:
            out.append(s)
    return out


_CFR_OK = hasattr(os, "copy_file_range")
# copy_file_range refusals that mean "not here" (old kernel, cross-device, special file, filesystem)
_CFR_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM,
                    errno.ETXTBSY, errno.EOVERFLOW}
# copy_file_range errors that can only be the output's: reported as they are
_CFR_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def copy_segment(seg: Segment, dst_fd: int, buf: memoryview) -> None:
    """Append ``seg`` to ``dst_fd`` at its current position, all of it or an error.

    Uses ``os.copy_file_range`` (in-kernel, no user-space buffer) when both ends are
    local files, and a buffered copy through ``buf`` otherwise or when the kernel
    refuses (cross-device, unsupported filesystem). A kernel copy error that could be
    either side's (EIO) is retried through the buffered path, whose separate read and
    write say which side fails: a read is an ``InputError`` (``read-error``), a write
    stays an ``OSError`` for the writer. A copy that ends early is ``short-read``.
    """
    global _CFR_OK
    stream = getattr(seg.source, "stream", None)
    if stream is not None:  # a remote source: parts fetched in parallel, a bounded window ahead
        for chunk in stream(seg.offset, seg.length):
            _write_all(dst_fd, memoryview(chunk))
        IO_STATS.add_copied(seg.length)
        return
    src_fd = seg.source.local_fd()
    done = 0
    if _CFR_OK and src_fd is not None:
        try:
            while done < seg.length:
                n = os.copy_file_range(src_fd, dst_fd, seg.length - done, seg.offset + done)
                if n == 0:
                    raise short_read(seg.source.name, seg.offset + done)
                done += n
        except OSError as e:
            if e.errno in _CFR_WRITE_ERRORS:
                raise
            if e.errno in _CFR_UNSUPPORTED and not done:
                _CFR_OK = False  # not on this system: do not ask again
    IO_STATS.add_copied(done)
    while done < seg.length:
        n = min(len(buf), seg.length - done)
        seg.source.readinto(seg.offset + done, buf[:n])
        _write_all(dst_fd, buf[:n])
        done += n


def iter_chunks(seg: Segment, chunk: int = COPY_CHUNK) -> Iterator[bytearray]:
    """Read a segment in chunks (for hashing or computing on it)."""
    pos = 0
    while pos < seg.length:
        n = min(chunk, seg.length - pos)
        yield read_bytes(seg.source, seg.offset + pos, n)
        pos += n
