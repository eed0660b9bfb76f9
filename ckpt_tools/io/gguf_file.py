"""A GGUF file read as metadata: its key-values (typed, in file order) and its tensors' names, types and shapes.

Scanned from a memory map with the ``gguf`` package's constants (no tensor byte is read here). Shapes are given
as numpy / PyTorch order (outermost first), the reverse of GGUF's ``ne``.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError

RULE = "gguf-read"


@dataclass(frozen=True)
class GgufKV:
    key: str
    value: Any
    vtype: Any  # gguf.GGUFValueType
    sub_type: Any = None  # arrays: the element type
    raw: bytes | None = field(default=None, compare=False, repr=False)  # the entry's bytes in a little-endian file


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str  # F32, F16, BF16, Q8_0, ...
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # where its data starts in the file

    def chunks(self, path: Path, size: int = 64 << 20):
        """Its stored bytes, read from ``path`` a piece at a time."""
        with open(path, "rb") as f:
            f.seek(self.offset)
            left = self.nbytes
            while left:
                piece = f.read(min(size, left))
                if not piece:
                    raise InputError(f"tensor {self.name}: the file ends before its data does", rule=RULE,
                                     path=str(path), key=self.name)
                left -= len(piece)
                yield piece


@dataclass
class GgufFile:
    path: Path
    kv: dict[str, GgufKV] = field(default_factory=dict)
    tensors: dict[str, GgufTensor] = field(default_factory=dict)

    @property
    def arch(self) -> str | None:
        kv = self.kv.get("general.architecture")
        return kv.value if kv is not None else None

    def arch_value(self, suffix: str) -> Any:
        """``{arch}.<suffix>`` (None when absent)."""
        kv = self.kv.get(f"{self.arch}.{suffix}")
        return kv.value if kv is not None else None

    @property
    def block_count(self) -> int | None:
        return self.arch_value("block_count")

    @property
    def nextn(self) -> int:
        return int(self.arch_value("nextn_predict_layers") or 0)

    @property
    def vocab_size(self) -> int | None:
        v = self.arch_value("vocab_size")
        if v is not None:
            return int(v)
        tokens = self.kv.get("tokenizer.ggml.tokens")
        return len(tokens.value) if tokens is not None else None


def read_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """The metadata of the GGUF file at ``path``; an unreadable file is refused (rule gguf-read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _scan(path, view)
            finally:
                view.release()  # before the map closes
    except InputError:
        raise
    except (OSError, ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError) as e:
        raise InputError(f"not a readable GGUF file: {e}", rule=RULE, path=str(path)) from None


class _Cursor:
    """Reads GGUF's little- or big-endian fields from a buffer, front to back."""

    def __init__(self, data: memoryview, order: str) -> None:
        self.data, self.order, self.at = data, order, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """An array's strings (a vocabulary: the loop kept tight)."""
        data, at, size = self.data, self.at, len(self.data)
        length = struct.Struct(self.order + "Q").unpack_from
        out = []
        for _ in range(count):
            n = length(data, at)[0]
            at += 8 + n
            if at > size:
                raise ValueError("a string runs past the end of the file")
            out.append(str(data[at - n:at], "utf-8"))
        self.at = at
        return out

    def array(self, fmt: str, count: int) -> list:
        import numpy as np

        dtype = np.dtype(self.order + fmt)
        values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
        self.at += dtype.itemsize * count
        return values.tolist()


def _scan(path: Path, data: memoryview) -> GgufFile:
    """Header, key-values and tensor infos, decoded as gguf's GGUFReader decodes them (``contents()``: Python
    values, arrays as lists), without its object per array element: a 150k-token vocabulary reads in tens of
    milliseconds, not seconds."""
    from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

    if len(data) < 24 or struct.unpack_from("<I", data)[0] != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    version = struct.unpack_from("<I", data, 4)[0]
    order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads as a multiple of 65,536
    cur = _Cursor(data, order)
    cur.at = 4
    if cur.take("I") not in (2, 3):
        raise ValueError(f"GGUF version {version} is not read (2 and 3 are)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    out = GgufFile(path)
    for _ in range(n_kv):
        at = cur.at
        key = cur.string()
        if key in out.kv:
            raise ValueError(f"duplicate key {key}")
        vtype, sub = GGUFValueType(cur.take("I")), None
        if vtype != GGUFValueType.ARRAY:
            value = _value(cur, vtype)
        else:
            sub, count = GGUFValueType(cur.take("I")), cur.take("Q")
            if sub == GGUFValueType.ARRAY:
                raise InputError(f"key {key}: nested arrays are not read", rule=RULE, path=str(path))
            strings = sub == GGUFValueType.STRING
            value = cur.strings(count) if strings else cur.array(VALUE_FORMATS[sub], count)
        # kept so that a writer copies the entry (a vocabulary: megabytes) instead of packing it value by value
        out.kv[key] = GgufKV(key, value, vtype, sub, bytes(data[at:cur.at]) if order == "<" else None)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        ne = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, ne, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
    align_kv = out.kv.get("general.alignment")
    align = 32 if align_kv is None else align_kv.value
    if align_kv is not None and (align_kv.vtype != GGUFValueType.UINT32 or align <= 0 or align & (align - 1)):
        raise ValueError("general.alignment must be a UINT32 power of two")
    start = -(-cur.at // align) * align
    for name, ne, qtype, offset in infos:
        if name in out.tensors:
            raise ValueError(f"duplicate tensor {name}")
        block, size = GGML_QUANT_SIZES[qtype]
        n = 1
        for d in ne:
            n *= d
        nbytes = n * size // block
        if start + offset + nbytes > len(data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        out.tensors[name] = GgufTensor(name, qtype.name, tuple(reversed(ne)), nbytes, start + offset)
    return out


# GGUFValueType -> the struct format of its scalars
VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _value(cur: _Cursor, vtype: Any) -> Any:
    if vtype == 8:  # STRING
        return cur.string()
    return cur.array(VALUE_FORMATS[int(vtype)], 1)[0]  # through numpy, as GGUFReader: float32 widened the same way
