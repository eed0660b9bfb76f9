"""safetensors, the native format: the checkpoint layer opens it itself from its index and shard headers.

Registered so that detection asks it first: a directory with safetensors weights is read as such,
whatever other weights lie beside them.
"""

from __future__ import annotations

from pathlib import Path

from .registry import Reader


def detect(d: Path) -> str | None:
    return "safetensors files" if any(d.glob("*.safetensors")) else None


READER = Reader("safetensors", "safetensors", detect=detect, suffixes=(".safetensors",))
