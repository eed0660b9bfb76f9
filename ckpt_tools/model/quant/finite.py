"""Decoded values are finite: a dequantized weight with NaN or Inf is refused, naming the tensor and the index.

The scale rule (``scale_values``) refuses non-finite and zero scales before anything is planned; what can
still decode to NaN / Inf is a NaN code in the weight itself (an FP8 ``0x7F`` byte) or a product past the
output dtype's range (F16). ``finite_bands`` checks each decoded band as it passes, on the raw bits (a value
is NaN or Inf exactly when its exponent bits are all ones): one mask and one reduction per band.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from ...errors import InputError

RULE = "nonfinite"
CHUNK = 1 << 16  # elements masked at once
# output dtype -> (unsigned view, the bits without the sign, the smallest non-finite pattern)
_BITS: dict[str, tuple[type, int, int]] = {
    "BF16": (np.uint16, 0x7FFF, 0x7F80),
    "F16": (np.uint16, 0x7FFF, 0x7C00),
    "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
    "F64": (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


def first_nonfinite(values: np.ndarray, dtype: str) -> int | None:
    """The flat index of the first NaN / Inf of ``values`` (``dtype`` storage), or None."""
    view, mask, top = _BITS[dtype]
    u = np.ascontiguousarray(values).view(view).reshape(-1)
    m = view(mask)
    tmp = np.empty(min(u.size, CHUNK), dtype=view)
    for a in range(0, u.size, CHUNK):  # chunks that stay in cache: half the time of one whole-array pass
        part = u[a:a + CHUNK]
        bits = tmp[:part.size]
        np.bitwise_and(part, m, out=bits)
        if int(bits.max()) >= top:
            return a + int(np.argmax(bits >= top))
    return None


def finite_bands(bands: Iterable[np.ndarray], key: str, shape: tuple[int, ...], dtype: str, what: str,
                 path: str | None = None, vouched: Callable[[np.ndarray], bool] | None = None
                 ) -> Iterator[np.ndarray]:
    """``bands`` (consecutive C-order parts of a ``shape`` tensor in ``dtype`` storage) passed through; the first
    NaN / Inf is an InputError (rule ``nonfinite``) naming ``key``, the index and ``what`` it was decoded from.
    ``vouched()``: True when the bands decoded so far are known finite (``decode.BandDecoder.vouches_finite``)."""
    if dtype not in _BITS:
        yield from bands
        return
    done = 0
    for band in bands:
        i = None if vouched is not None and vouched(band) else first_nonfinite(band, dtype)
        if i is not None:
            flat = done + i
            index = [int(x) for x in np.unravel_index(flat, shape)] if shape and math.prod(shape) else [flat]
            view, mask, top = _BITS[dtype]
            raw = int(np.ascontiguousarray(band).view(view).reshape(-1)[i])
            kind = "NaN" if (raw & mask) > top else ("-inf" if raw > mask else "inf")
            raise InputError(f"{key}: the value decoded from {what} at index {index} is {kind}; a dequantized weight "
                             "must be finite (a NaN code in the weight, or a product past the range of "
                             f"{dtype})", rule=RULE, path=path)
        done += band.size
        yield band
