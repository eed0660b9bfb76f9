"""What a comparison of two tensors found (``TensorDiff``), as diff, stitch and graft report it.

Apart from ``compare`` (which computes the statistics with numpy), so that a report listing keys added or
replaced (graft's dry run) imports no arithmetic library.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...jsonutil import json_float


@dataclass
class TensorDiff:
    key: str
    status: str  # unchanged | replaced | added | removed | dtype-changed | shape-changed
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: list | None = None
    shape_b: list | None = None
    max_abs: float | None = None  # NaN when a position holds NaN, inf when one side is infinite
    rel_l2: float | None = None  # over the positions where both sides are finite
    cosine: float | None = None  # idem
    norm_a: float | None = None  # L2 norms over those positions
    norm_b: float | None = None
    nonfinite: int = 0  # NaN / Inf count on the B side (the written side in stitch)
    nan_count: int = 0  # positions where either side is NaN
    inf_count: int = 0  # positions where either side is infinite (and neither is NaN)
    divergent: str | None = None  # stitch: why this replaced tensor looks like another tensor, not a finetune
    unjudged: str | None = None  # stitch: why the divergence check could not judge this tensor

    def to_json(self) -> dict:
        """Strict JSON: a NaN statistic is null (its positions are in nan_count), infinities are "inf" / "-inf"."""
        out = {}
        for k, v in asdict(self).items():
            if v is None or (k in _COUNTS and v == 0):
                continue
            out[k] = json_float(v) if isinstance(v, float) else v
        return out


_COUNTS = ("nonfinite", "nan_count", "inf_count")

