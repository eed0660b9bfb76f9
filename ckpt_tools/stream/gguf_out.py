"""One GGUF file written with bounded memory: the header, key-values and every tensor's info first, then each
tensor's data from an iterator of byte chunks, one tensor at a time, into a temporary file in the output directory
that is fsync'd and renamed into place only when every tensor is complete (nothing is left on failure).

The layout is gguf.GGUFWriter's (version 3, little-endian, ``general.architecture`` first), byte for byte; a
key-value read from a little-endian file is copied as its bytes (``GgufKV.raw``), not packed again value by value.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..io.gguf_file import VALUE_FORMATS, GgufKV
from .targets.local import WRITEBACK, start_writeback

_STRING, _ARRAY = 8, 9  # GGUFValueType


@dataclass
class GgufTensorOut:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    qtype: Any  # gguf.GGMLQuantizationType
    chunks: Callable[[], Iterable[bytes | memoryview]]  # the stored bytes, in order, produced when written
    meta: dict

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.qtype]
        n = 1
        for d in self.shape:
            n *= d
        return n // block * size


def write_gguf(path: Path, arch: str, kv: Iterable[GgufKV], tensors: list[GgufTensorOut],
               on_tensor: Callable[[GgufTensorOut, int], None] | None = None) -> tuple[int, dict[str, str]]:
    """Write ``path`` (key-values in order, then ``tensors``): the file's size and each tensor's BLAKE3 digest of
    its data bytes (hashed as written)."""
    try:
        return _write(path, arch, kv, tensors, on_tensor)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror or e}", path=str(path)) from None


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _value(value: Any, vtype: int, sub_type: int | None) -> bytes:
    """A value's bytes after its type, as GGUFWriter packs it."""
    if vtype == _STRING:
        return _string(value)
    if vtype != _ARRAY:
        return struct.pack("<" + VALUE_FORMATS[vtype], value)
    if not value:
        raise ValueError("an empty GGUF metadata array")
    head = struct.pack("<IQ", int(sub_type), len(value))
    if sub_type == _STRING:
        return head + b"".join(_string(v) for v in value)
    return head + struct.pack(f"<{len(value)}{VALUE_FORMATS[int(sub_type)]}", *value)


def _header(arch: str, kv: Iterable[GgufKV], tensors: list[GgufTensorOut]) -> tuple[bytes, int]:
    """Everything before the first tensor's data (unpadded), and the data alignment."""
    entries = [_string("general.architecture") + struct.pack("<I", _STRING) + _string(arch)]
    align = 32
    for e in kv:
        if e.key == "general.architecture":  # written first, from ``arch`` (the caller checked they agree)
            if e.value != arch:
                raise ValueError(f"general.architecture {e.value!r} is not {arch!r}")
            continue
        if e.key == "general.alignment":
            align = int(e.value)
        entries.append(e.raw if e.raw is not None else
                       _string(e.key) + struct.pack("<I", int(e.vtype)) + _value(e.value, int(e.vtype), e.sub_type))
    infos, offset = [], 0
    for t in tensors:
        infos.append(_string(t.name) + struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape), *reversed(t.shape),
                                                   int(t.qtype), offset))
        offset += -(-t.nbytes // align) * align
    from gguf import GGUF_MAGIC, GGUF_VERSION

    return b"".join([struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(tensors), len(entries)), *entries,
                     *infos]), align


def _pad(n: int, align: int) -> bytes:
    return bytes(-n % align)


def _write(path, arch, kv, tensors, on_tensor) -> tuple[int, dict[str, str]]:
    import blake3

    header, align = _header(arch, kv, tensors)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        # a chunk is hashed on a second thread while it is written (blake3 and the write release the GIL)
        with open(tmp, "wb") as fout, ThreadPoolExecutor(1, thread_name_prefix="ckpt-gguf-hash") as hasher:
            end = fout.write(header + _pad(len(header), align))
            started = 0  # the disk writes each stretch while the next is converted (the fsync waits for the rest)
            digests: dict[str, str] = {}
            for t in tensors:
                written = 0
                h = blake3.blake3()
                for chunk in t.chunks():
                    hashed = hasher.submit(h.update, chunk)
                    written += fout.write(chunk)
                    hashed.result()
                    if end + written - started >= WRITEBACK:
                        fout.flush()
                        start_writeback(fout.fileno(), started, end + written - started)
                        started = end + written
                digests[t.name] = h.hexdigest()
                if written != t.nbytes:
                    raise OutputError(f"tensor {t.name}: {written} bytes produced, {t.nbytes} declared",
                                      path=str(path), key=t.name)
                end += written + fout.write(_pad(t.nbytes, align))
                if on_tensor is not None:
                    on_tensor(t, written)
            fout.flush()
            os.fsync(fout.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
        return size, digests
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
