"""Conversions between raw tensor bytes and numpy / torch arrays.

numpy has no bfloat16 or float8, so those travel as their unsigned integer views:
pure data movement (transposes, stacking) never needs to know the float format.
torch is imported only by the functions that do arithmetic.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .dtypes import torch_dtype

if TYPE_CHECKING:
    import numpy as np

# numpy is imported on first use: a plain byte-copying run (extract, stitch of unchanged
# bytes) never needs it, and importing it costs a noticeable part of such a run.

# numpy dtype with the same element size, used for data movement
_NP_STORAGE = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "I64": "int64",
    "U64": "uint64",
    **dict.fromkeys(("F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"), "uint8"),
}


def numpy_storage_dtype(dtype: str) -> np.dtype:
    import numpy as np

    try:
        return np.dtype(_NP_STORAGE[dtype])
    except KeyError:
        raise ValueError(f"{dtype} has no byte-addressable numpy view") from None


def bytes_to_numpy(buf, dtype: str, shape) -> np.ndarray:
    import numpy as np

    return np.frombuffer(buf, dtype=numpy_storage_dtype(dtype)).reshape(tuple(shape))


class Scratch:
    """Grow-only arrays reused by name: fresh multi-MB arrays per chunk cost page faults, not arithmetic."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def take(self, name: str, n: int, dtype) -> np.ndarray:
        """``n`` elements of the buffer ``name`` (valid until the next ``take`` of that name)."""
        import numpy as np

        buf = self._bufs.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            buf = self._bufs[name] = np.empty(max(n, 1), dtype=dtype)
        return buf[:n]


_HEAP_KEPT = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> None:
    """Let freed buffers up to 32 MB be reused, not handed back to the kernel (glibc's ``mallopt``; elsewhere
    nothing): a decoded tensor, its read bytes and numpy's temporaries are fresh arrays of a few MB each, and
    each one's pages faulted in again cost a fifth of an FP8 decode's CPU. Once per process, when decoding
    starts; only explicit settings stop glibc's own (which hands back every 128 KB at first)."""
    global _HEAP_KEPT
    if _HEAP_KEPT or not sys.platform.startswith("linux"):
        return
    _HEAP_KEPT = True
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest: allocations below it come from the heap
    mallopt(_M_TRIM_THRESHOLD, 64 << 20)  # twice that, as glibc's own growth sets it


def decode_floats(buf, dtype: str, scratch: Scratch | None = None) -> np.ndarray:
    """float32 values of a float tensor's raw bytes (bf16 widened by a 16-bit shift: exact);
    F16 / F64 stay in their own precision.

    With ``scratch`` the bf16 result lives in its buffer and is valid until its next use.
    """
    import numpy as np

    if dtype == "BF16":
        raw = np.frombuffer(buf, dtype=np.uint16)
        wide = scratch.take("bf16", raw.size, np.uint32) if scratch is not None else np.empty(raw.size, np.uint32)
        np.left_shift(raw, 16, out=wide, dtype=np.uint32)
        return wide.view(np.float32)
    if dtype in ("F16", "F32", "F64"):
        return np.frombuffer(buf, dtype={"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype])
    raise ValueError(f"{dtype} is not a float dtype numpy can decode")


COMPUTE_THREADS = 1  # torch threads for band-sized work (see torch_threads)
_THREADS_LOCK = threading.Lock()
_threads_held: list = [0, 0]  # [contexts open, torch's thread count before the first]


@contextmanager
def torch_threads(n: int = COMPUTE_THREADS, *, load: bool = False):
    """Run torch work with ``n`` intra-op threads while the context is open.

    torch's thread count is process-wide state: a thread takes the count the process has
    when it first runs a parallel op, so a worker that calls ``set_num_threads`` changes
    what every later thread starts with. The count is therefore set on the main thread
    only (elsewhere this is a no-op), once for the outermost of any number of open
    contexts (they may close in any order: generators), and restored when the last one
    closes; threads started inside take ``n``. Nothing happens when torch has not been
    imported, unless ``load`` (importing it costs seconds a byte-copying run never needs).
    Band-sized ops gain little from a second thread, and an OpenMP team with a descheduled
    member stalls every op: measured 25x slower with 2 threads than with 1 on a 2-core machine.
    """
    active = n > 0 and threading.current_thread() is threading.main_thread() and (load or "torch" in sys.modules)
    if active:
        import torch

        with _THREADS_LOCK:
            if _threads_held[0] == 0:
                _threads_held[1] = torch.get_num_threads()
                if _threads_held[1] != n:
                    torch.set_num_threads(n)
            _threads_held[0] += 1
    try:
        yield
    finally:
        if active:
            with _THREADS_LOCK:
                _threads_held[0] -= 1
                if _threads_held[0] == 0 and torch.get_num_threads() != _threads_held[1]:
                    torch.set_num_threads(_threads_held[1])


def bytes_to_torch(buf, dtype: str, shape):
    import torch

    if len(buf) == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype))
    return torch.frombuffer(buf, dtype=torch_dtype(dtype)).reshape(tuple(shape))


def as_bytes(x) -> memoryview:
    """A flat byte view of bytes-like objects, numpy arrays and torch tensors."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return memoryview(x).cast("B")
    import numpy as np

    if isinstance(x, np.ndarray):
        return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    # torch.Tensor: reinterpret as bytes without a copy when already contiguous
    t = x.detach().contiguous().reshape(-1)
    import torch

    return memoryview(t.view(torch.uint8).numpy())


def encode_floats(values: np.ndarray, out_dtype: str, out: np.ndarray | None = None,
                  scratch: Scratch | None = None) -> np.ndarray:
    """float32 values in ``out_dtype`` storage, rounded to nearest even like torch's casts (bf16 on the bits:
    a uint32 sum that wraps only for NaNs, each then written as torch's 0xFFFF). ``out``: the storage array
    to write (else a new one); ``scratch``: where the bf16 sum lives (else a new array)."""
    import numpy as np

    if out_dtype in ("F32", "F16"):
        with np.errstate(over="ignore"):  # overflow to +-inf, as torch does
            cast = values.astype(np.float32 if out_dtype == "F32" else np.float16, copy=False)
        if out is not None:
            out[...] = cast
        return cast if out is None else out
    v = values.astype(np.float32, copy=False)
    u = v.view(np.uint32)
    t = scratch.take("bf16-sum", u.size, np.uint32).reshape(u.shape) if scratch else np.empty(u.shape, np.uint32)
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    t += 0x7FFF
    t += u
    t >>= 16
    if out is None:
        out = t.astype(np.uint16)
    else:
        np.copyto(out, t, casting="unsafe")
    nan = np.isnan(v)
    if nan.any():
        out[nan] = 0xFFFF
    return out
