"""Conversions between raw tensor bytes and numpy / torch arrays.

numpy has no bfloat16 or float8, so those travel as their unsigned integer views:
pure data movement (transposes, stacking) never needs to know the float format.
torch is imported only by the functions that do arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .dtypes import DTYPES, torch_dtype

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


def nbytes_of(dtype: str, shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return DTYPES[dtype].nbytes(n)
