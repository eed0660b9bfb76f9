"""One GGUF file written with bounded memory: key-values and every tensor's info first (gguf.GGUFWriter), then
each tensor's data from an iterator of byte chunks, one tensor at a time, into a temporary file in the output
directory that is fsync'd and renamed into place only when every tensor is complete (nothing is left on failure).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OutputError


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


def write_gguf(path: Path, arch: str, kv: Iterable[tuple[str, Any, Any, Any]], tensors: list[GgufTensorOut],
               on_tensor: Callable[[GgufTensorOut, int], None] | None = None) -> tuple[int, dict[str, str]]:
    """Write ``path`` (key-values ``(key, value, vtype, sub_type)`` in order, then ``tensors``): the file's size
    and each tensor's BLAKE3 digest of its data bytes (hashed as written)."""
    try:
        return _write(path, arch, kv, tensors, on_tensor)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror or e}", path=str(path)) from None


def _write(path, arch, kv, tensors, on_tensor) -> tuple[int, dict[str, str]]:
    import blake3
    import numpy as np
    from gguf import GGUFWriter

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = GGUFWriter(tmp, arch)
    try:
        for key, value, vtype, sub_type in kv:
            if key == "general.architecture":  # the writer sets it from ``arch`` (the caller checked they agree)
                if value != arch:
                    raise ValueError(f"general.architecture {value!r} is not {arch!r}")
                continue
            if key == "general.alignment":
                w.data_alignment = int(value)
            w.add_key_value(key, value, vtype, sub_type=sub_type)
        for t in tensors:
            # a float32 placeholder dtype: with raw_dtype given, the writer takes the element shape as it is
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        digests: dict[str, str] = {}
        for t in tensors:
            w.write_padding(fout, fout.tell())
            written = 0
            h = blake3.blake3()
            for chunk in t.chunks():
                h.update(chunk)
                written += fout.write(chunk)
            digests[t.name] = h.hexdigest()
            if written != t.nbytes:
                raise OutputError(f"tensor {t.name}: {written} bytes produced, {t.nbytes} declared",
                                  path=str(path), key=t.name)
            w.write_padding(fout, t.nbytes)
            if on_tensor is not None:
                on_tensor(t, written)
        fout.flush()
        os.fsync(fout.fileno())
        w.close()
        size = tmp.stat().st_size
        os.replace(tmp, path)
        return size, digests
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
