"""Which scheme-table storage formats are *block formats* (``block_tile``), from the table alone.

A block format's weight holds one FP8 code per element, with exactly one companion tensor, its
scale, over a tile that is the same whatever the matrix shape, and nothing else (no global scale,
zero point or optional tensor): what the verbs can rename, slice per expert and restack byte for
byte (model.quant.codec). Kept apart from codec so that detection (detect.py) can use
it without importing the decoders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..expr import ExprError, evaluate

if TYPE_CHECKING:
    from .schema import FormatDef

FP8_CODES = ("fp8", "e4m3", "e5m2")


def block_tile(fmt: FormatDef, params: Mapping[str, Any]) -> tuple[int, int] | None:
    """``fmt``'s scale tile under ``params`` when it is a block format, else None."""
    d = fmt.decoder
    if (d.codes not in FP8_CODES or fmt.weight.pack != 1 or d.global_scale is not None or d.zero_point is not None
            or len(fmt.tensors) != 1 or fmt.tensors[0].suffix != d.scale.tensor or fmt.tensors[0].optional):
        return None
    tiles = []
    for rows, cols in ((7, 11), (4099, 8191)):  # a tile that follows the shape is no block
        try:
            tile = evaluate(d.scale.granularity, {**params, "rows": rows, "cols": cols})
        except ExprError:
            return None
        if not (isinstance(tile, (list, tuple)) and len(tile) == 2
                and all(isinstance(x, int) and x > 0 for x in tile)):
            return None
        tiles.append((int(tile[0]), int(tile[1])))
    return tiles[0] if tiles[0] == tiles[1] else None
