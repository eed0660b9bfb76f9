"""FP4 experts into ggml's MXFP4 blocks by moving their stored codes and E8M0 exponents, never their values.

A release that stores routed experts as FP4 e2m1 codes (two a byte, the first low) with one E8M0 exponent per 32
holds exactly the numbers ggml's ``block_mxfp4`` holds, and llama.cpp's converter moves them: gguf's quantizer on
the decoded values would pick a smaller exponent for a block whose largest code is below 4, and write -0 as 0.
"""

from __future__ import annotations

from typing import Any

BLOCK = 32  # values per E8M0 exponent, in the source and in ggml's block


def repacks(qtype: Any) -> bool:
    """Whether a GGUF type is written from the source's stored codes rather than quantized from values."""
    return qtype.name == "MXFP4"


def stored_codes(source: list[str], raw: Any, values: int, cols: int):
    """The codes [rows, cols / 2] and exponents [rows, cols / 32] of a decoded FP4 tensor whose ``source`` keys
    (codes, then scale) are in ``raw``, holding ``values`` numbers; None when it is not stored that way."""
    import numpy as np

    refs = [raw.get(k) for k in source] if raw is not None and len(source) == 2 else [None]
    if None in refs or cols % BLOCK or refs[0].dtype not in ("I8", "U8") or refs[1].dtype not in ("F8_E8M0", "U8") \
            or refs[0].nbytes * 2 != values or refs[1].nbytes * BLOCK != values:
        return None
    return (np.frombuffer(refs[0].read(), np.uint8).reshape(-1, cols // 2),
            np.frombuffer(refs[1].read(), np.uint8).reshape(-1, cols // BLOCK))


def blocks(codes: Any, exponents: Any) -> Any:
    """ggml's block_mxfp4 of FP4 codes and their exponents: per block of 32, the exponent, then byte j holding
    code j (low) and code j + 16 (high)."""
    import numpy as np

    c = np.stack([codes & 15, codes >> 4], -1).reshape(*exponents.shape, BLOCK)
    out = np.empty((*exponents.shape, BLOCK // 2 + 1), np.uint8)
    out[..., 0] = exponents
    out[..., 1:] = c[..., :BLOCK // 2] | (c[..., BLOCK // 2:] << 4)
    return out
