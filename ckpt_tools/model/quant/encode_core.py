"""What every encoder shares: its arguments (``EncodeArgs``) and the per-tile arithmetic of the min-max observers
the producers run (tile min / max, the symmetric absmax, a grid expanded over the matrix). torch, CPU; imported
by the encoders only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EncodeArgs:
    """What an encoder needs besides the values: the module's declared params (strategy, group_size,
    block, algo), the dtype each stored tensor has (suffix -> safetensors dtype) and the model's dtype."""

    params: Mapping[str, Any] = field(default_factory=dict)
    dtypes: Mapping[str, str] = field(default_factory=dict)
    model_dtype: str = "BF16"
    # max |value| over the engines' fused group the module is a shard of (gate/up, q_a/kv_a; in the model
    # dtype, so exact as a float): producers give the shards one per-tensor scale from it, because vLLM
    # loads a fused layer with one (llm-compressor's fused global scale, ModelOpt's synced amax)
    group_absmax: float | None = None
    # role -> suffix of the storage format being written (the table's names: ``weight``, ``scale`` ...)
    suffixes: Mapping[str, str] = field(default_factory=dict)


def _tile_minmax(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile min and max of [rows, cols] (edge tiles partial), in x's dtype: [ceil(r/tr), ceil(c/tc)]."""
    import torch

    tr, tc = tile
    rows, cols = x.shape
    pr, pc = -rows % tr, -cols % tc
    if pr or pc:  # zero padding changes no tile's min(min, 0) / max(max, 0), which is all the scale reads
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    t = x.reshape(x.shape[0] // tr, tr, x.shape[1] // tc, tc)
    return t.amin(dim=(1, 3)), t.amax(dim=(1, 3))


def _absmax(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' symmetric range: max(|min(lo, 0)|, |max(hi, 0)|)."""
    import torch

    lo = torch.min(lo, torch.zeros_like(lo))
    hi = torch.max(hi, torch.zeros_like(hi))
    return torch.max(torch.abs(lo), torch.abs(hi))


def _expand(s: torch.Tensor, tile: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A per-tile grid repeated over [rows, cols] (edge tiles cropped)."""
    return s.repeat_interleave(tile[0], 0)[: shape[0]].repeat_interleave(tile[1], 1)[:, : shape[1]]
