"""A GGUF file read as metadata: its key-values (typed, in file order) and its tensors' names, types and shapes.

Reads through the ``gguf`` package's GGUFReader (a memory map: no tensor byte is read here). Shapes are given
as numpy / PyTorch order (outermost first), the reverse of GGUF's ``ne``.
"""

from __future__ import annotations

import os
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
    from gguf import GGUFReader, GGUFValueType

    path = Path(path)
    try:
        reader = GGUFReader(path, "r")
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise InputError(f"not a readable GGUF file: {e}", rule=RULE, path=str(path)) from None
    out = GgufFile(path)
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not key-values
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        if vtype == GGUFValueType.ARRAY and len(f.types) > 2:
            raise InputError(f"key {key}: nested arrays are not read", rule=RULE, path=str(path))
        out.kv[key] = GgufKV(key, f.contents(), vtype, sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out.tensors[t.name] = GgufTensor(t.name, t.tensor_type.name, shape, int(t.n_bytes), int(t.data_offset))
    return out
