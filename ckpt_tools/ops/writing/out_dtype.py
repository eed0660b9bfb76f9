"""The dtype a writing verb writes: ``--dtype`` / ``--dequant`` parsed (``dtype_arg``), what a tensor the table
pins keeps (``requested_for``), applied to a tensor and its FP8 scale (``finish_tensor``), and named as a config
names it (``DTYPE_NAMES``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...dtypes import FLOAT_DTYPES, lookup
from ...errors import InputError, UsageError
from ...model.quant.codec import Codec
from ...numeric import transforms
from ...stream.plan import OutputTensor

if TYPE_CHECKING:
    from ...model.tables.resolve import Spec

DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def dtype_arg(value: str | None, flag: str) -> str | None:
    if value is None or value == "keep":
        return None
    try:
        name = lookup(value).name
    except KeyError:
        raise UsageError(f"{flag} {value!r}: use bf16, fp16 or fp32") from None
    if name not in FLOAT_DTYPES:
        raise UsageError(f"{flag} {value!r}: use bf16, fp16 or fp32")
    return name


def pinned(spec: Spec | None) -> bool:
    """The table names this tensor's dtype (``dtype:`` in mappings/architectures, e.g. DeepSeek's F32
    ``e_score_correction_bias``; ``Spec.pinned``): no dtype option of any verb changes it."""
    return spec is not None and spec.pinned


def requested_for(spec: Spec | None, requested: str | None) -> str | None:
    """The float dtype a tensor of table entry ``spec`` is cast to when the verb is asked for ``requested``
    (``extract --dtype``, ``init-draft --dtype``, ``graft --mtp-dtype``, ``stitch --dtype draft``): None for a
    pinned one, which the verb writes as the table or its input has it: the pin wins over every option."""
    return None if pinned(spec) else requested


def finish_tensor(t: OutputTensor, scale: OutputTensor | None, cast_to, dequant_to, fmt: Codec
                  ) -> list[OutputTensor]:
    """``t`` (and its ``scale`` companion in block format ``fmt``) as written: dequantized into one tensor (the
    format's decoder), cast, or as they are."""
    if fmt.stores(t.dtype):
        if dequant_to is not None:
            if scale is None:
                raise InputError(f"FP8 weight {t.key} has no block scale to dequantize with", rule="fp8-scale")
            return [fmt.decode(t, scale, dequant_to)]
        if cast_to is not None:
            raise UsageError(f"{t.key} is FP8: --dtype cannot cast block-quantized weights; add --dequant {cast_to}")
        return [t] + ([scale] if scale is not None else [])
    if cast_to is not None and t.dtype in FLOAT_DTYPES:
        t = transforms.cast(t, cast_to)
    return [t] + ([scale] if scale is not None else [])
