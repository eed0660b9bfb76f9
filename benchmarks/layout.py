"""Where each tensor's bytes are: read straight from safetensors headers (no ckpt_tools code).

The floors are computed from this, independently of the code they judge.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Extent:
    file: str  # absolute path
    offset: int  # absolute offset in the file
    length: int
    dtype: str
    shape: tuple[int, ...]


def header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def extents(ckpt: Path) -> dict[str, Extent]:
    """Every tensor of a checkpoint directory (through its index when there is one)."""
    ckpt = Path(ckpt)
    if (ckpt / INDEX).exists():
        shards = sorted(set(json.loads((ckpt / INDEX).read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    out: dict[str, Extent] = {}
    for name in shards:
        path = (ckpt / name).resolve()
        h, start = header(path)
        for key, info in h.items():
            if key == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[key] = Extent(str(path), start + a, b - a, info["dtype"], tuple(info["shape"]))
    return out


def pieces(ext: list[Extent]) -> list[list]:
    """Copy pieces in file order, adjacent ranges merged (as a good copier would)."""
    out: list[list] = []
    for e in sorted(ext, key=lambda e: (e.file, e.offset)):
        if out and out[-1][0] == e.file and out[-1][1] + out[-1][2] == e.offset:
            out[-1][2] += e.length
        else:
            out.append([e.file, e.offset, e.length])
    return out


def first_bytes(ckpt: Path, n: int) -> list[list]:
    """Pieces covering the first ``n`` tensor-data bytes of a checkpoint's shards, in shard order."""
    ext = extents(ckpt)
    by_file: dict[str, list[int]] = {}
    for e in ext.values():
        lo, hi = by_file.get(e.file, [e.offset, e.offset + e.length])
        by_file[e.file] = [min(lo, e.offset), max(hi, e.offset + e.length)]
    out: list[list] = []
    for f in sorted(by_file):
        if n <= 0:
            break
        lo, hi = by_file[f]
        take = min(n, hi - lo)
        out.append([f, lo, take])
        n -= take
    if n > 0:
        raise ValueError(f"{ckpt} has fewer tensor bytes than requested")
    return out


def files(d: Path) -> list[Path]:
    return sorted(p for p in Path(d).iterdir() if p.is_file())


def tree_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file()) if Path(d).exists() else 0
