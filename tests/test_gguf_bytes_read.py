"""`ckpt extract --format gguf` reads only what the sidecar holds (issue 41): the MTP layer's bytes and the shared
tensors (embedding, final norm, head), plus the files' headers and side files and the trunk's FP8 scales (every verb's
gate checks every scale's value), never the trunk's weights.

Bytes read are the process's own counters (/proc/self/io ``rchar``: every read-like syscall, threads included), as
the benchmark runner measures its children (benchmarks/launch.py), taken around a second extraction in this process
(the first imported every module, whose reads are not the extraction's). The source is block FP8 over 4 shards, as
the release is; its trunk layers are most of its bytes, so a reader that read whole shards would exceed the bound.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ckpt_tools import api
from ckpt_tools.testing.fixtures import FixtureOptions, make_checkpoint
from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

pytest.importorskip("gguf")
SHARED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
SCALE = "weight_scale_inv"


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("rchar:"))


def tensor_bytes(src: Path) -> tuple[dict[str, int], int]:
    """Data bytes per tensor key and the shards' header bytes (8 + the JSON header), from the files themselves."""
    sizes: dict[str, int] = {}
    headers = 0
    for shard in sorted(src.glob("*.safetensors")):
        with open(shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        headers += 8 + n
        for key, info in header.items():
            if key != "__metadata__":
                sizes[key] = info["data_offsets"][1] - info["data_offsets"][0]
    return sizes, headers


def test_extract_gguf_reads_only_the_mtp_layer_and_the_shared_tensors(tmp_path):
    opts = FixtureOptions(fp8=True, config_overrides={"num_hidden_layers": 24})
    src = make_checkpoint("deepseek_v3", tmp_path / "src", opts)
    (tmp_path / "trunk").mkdir()
    trunk = write_trunk_gguf(src, tmp_path / "trunk" / "trunk.gguf")
    config = json.loads((src / "config.json").read_text())
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    sizes, headers = tensor_bytes(src)
    needed = sum(n for k, n in sizes.items() if k.startswith(mtp_prefix) or k in SHARED)
    side = sum(p.stat().st_size for p in src.iterdir() if p.is_file() and p.suffix != ".safetensors")
    # the gate's quant-scale-value rule reads every FP8 scale of the source (1/16384 of the weights' bytes at
    # release scale, ~0.16 GB of DeepSeek-V3's): the trunk's scales are read, its weights never
    scales = sum(n for k, n in sizes.items() if k.endswith(SCALE) and not k.startswith(mtp_prefix))
    bound = needed + headers + side + scales
    total = sum(sizes.values())
    assert bound < total / 2  # far from reading every tensor

    api.extract_gguf(src, tmp_path / "warm", trunk)  # every module imported, every cache warm
    before = rchar()
    own = rchar() - before  # reading /proc/self/io is itself a read
    before = rchar()
    api.extract_gguf(src, tmp_path / "out", trunk)
    read = rchar() - before - own
    assert needed <= read <= bound, (read, needed, headers, side, scales, total)
