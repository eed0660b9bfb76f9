"""Synthetic checkpoints of a requested size, with the real key layout of a family.

Keys and shapes come from the family's table (through the fixture generator's
``checkpoint_specs``); the fixture config is scaled up: dimensions by a factor, then
the layer count and the expert count are solved so that the checkpoint is about the
requested size and about 10% of its bytes are MTP tensors (real releases have less,
e.g. ~2% for DeepSeek-V3; 10% keeps the MTP work measurable at 1 GB while extract must
still leave 90% of the bytes alone).

Bytes are cheap pseudo-random values streamed by our own writer (``Compute`` recipes
over a pre-generated pool): BF16 with exponents of typical weights, FP8-E4M3 without
NaN encodings, positive F32 scales. A 4 GB checkpoint is written in seconds.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckpt_tools.dtypes import DTYPES
from ckpt_tools.io.artefacts import MANIFEST_NAME
from ckpt_tools.io.config import ConfigView
from ckpt_tools.model.expr import render
from ckpt_tools.model.quant.codec import checkpoint_codec
from ckpt_tools.model.tables.loader import get_table
from ckpt_tools.model.tables.resolve import Spec, resolve
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.plan import Compute, OutputFile, OutputTensor, Plan
from ckpt_tools.testing.fixtures import FixtureOptions, checkpoint_specs, fixture_config, natural_key

# Table config variables that are widths (scaled with the hidden size); the layer and
# expert counts are solved; the vocabulary follows the hidden size at a real ratio.
WIDTH_VARS = ("hidden", "head_dim", "inter", "moe_inter", "shared_inter", "lin_k_dim", "lin_v_dim",
              "q_lora", "kv_lora", "qk_nope", "qk_rope", "v_head")
VOCAB_PER_HIDDEN = 32  # 32768 tokens at hidden 1024 (real models: 18..75)
HIDDEN_CHOICES = (2048, 1024, 512, 256, 128, 64)
MAX_LAYERS = 32
MTP_SHARE = 0.10
POOL_BYTES = 32 << 20
CHUNK = 8 << 20


@dataclass
class Sizing:
    family: str
    target: int
    hidden: int
    layers: int
    experts: int
    overrides: dict
    total: int = 0  # bf16 bytes of tensor data
    mtp: int = 0

    @property
    def mtp_share(self) -> float:
        return self.mtp / self.total if self.total else 0.0


def _var_key(table, name: str) -> str | None:
    var = table.config.get(name)
    return var.keys[0] if var else None


def _overrides(family: str, hidden: int, layers: int, experts: int) -> dict:
    table = get_table(family)
    base = ConfigView(fixture_config(family))
    factor = hidden / base.get(_var_key(table, "hidden"))
    out: dict = {}
    for name in WIDTH_VARS:
        key = _var_key(table, name)
        if key and isinstance(base.get(key), int):
            out[key] = max(1, int(round(base.get(key) * factor)))
    out[_var_key(table, "hidden")] = hidden
    out[_var_key(table, "vocab")] = hidden * VOCAB_PER_HIDDEN
    out[_var_key(table, "num_layers")] = layers
    out[_var_key(table, "experts")] = experts
    if table.config.get("num_mtp"):
        present = [k for k in table.config["num_mtp"].keys if base.has(k)]
        out[(present or table.config["num_mtp"].keys)[0]] = 1
    return out


def _specs(family: str, overrides: dict, opts: FixtureOptions | None = None):
    table = get_table(family)
    cfg = fixture_config(family, overrides, fp8=bool(opts and opts.fp8))
    res = resolve(table, ConfigView(cfg))
    specs, mtp = checkpoint_specs(res, opts or FixtureOptions())
    return table, cfg, res, specs, mtp


def _nbytes(spec: Spec) -> int:
    return DTYPES[spec.dtype].nbytes(math.prod(spec.shape))


@functools.lru_cache(maxsize=64)
def _byte_profile(family: str, hidden: int, experts: int, layers: int = MAX_LAYERS) -> tuple[int, list[int], int]:
    """(bytes outside layers, bytes of trunk layer l for l < layers, MTP bytes)."""
    table, _, res, specs, mtp = _specs(family, _overrides(family, hidden, layers, experts))
    prefixes = [render(table.trunk.prefix, dict(res.env, l=i)) for i in range(layers)]
    per_layer = [0] * layers
    other = mtp_bytes = 0
    for s in specs:
        n = _nbytes(s)
        if s.key in mtp:
            mtp_bytes += n
            continue
        for i, p in enumerate(prefixes):
            if s.key.startswith(p):
                per_layer[i] += n
                break
        else:
            other += n
    return other, tuple(per_layer), mtp_bytes


def solve(family: str, target: int, max_hidden: int = 1024) -> Sizing:
    """Hidden size, layer and expert counts for ~``target`` bytes with ~10% MTP bytes.

    The hidden size is the largest (up to ``max_hidden``) whose embedding and head stay
    under 15% of the bytes; so 1 GB and 4 GB share their tensor shapes and differ in
    layer and expert counts, which is what "memory is flat in checkpoint size" means.
    Bytes are linear in the expert count, so two profiles (4 and 8 experts) give every
    (layers, experts) total exactly.
    """
    choices = [h for h in HIDDEN_CHOICES if h <= max_hidden] or [min(HIDDEN_CHOICES)]
    for hidden in choices:
        if _byte_profile(family, hidden, 4, layers=1)[0] <= 0.15 * target:
            break
    o4, l4, m4 = _byte_profile(family, hidden, 4)
    o8, l8, m8 = _byte_profile(family, hidden, 8)
    best: tuple[float, Sizing] | None = None
    for layers in range(1, MAX_LAYERS + 1):
        a4 = o4 + sum(l4[:layers]) + m4
        a8 = o8 + sum(l8[:layers]) + m8
        slope = (a8 - a4) / 4
        experts = max(4, int(round((target - (a4 - 4 * slope)) / slope / 4)) * 4) if slope > 0 else 4
        total = a4 + (experts - 4) * slope
        mtp = m4 + (experts - 4) * (m8 - m4) / 4
        score = abs(math.log(total / target)) + 2 * abs(mtp / total - MTP_SHARE)
        if best is None or score < best[0]:
            best = (score, Sizing(family, target, hidden, layers, experts, {}, int(total), int(mtp)))
    assert best is not None
    s = best[1]
    s.overrides = _overrides(family, s.hidden, s.layers, s.experts)
    return s


# -- bytes ----------------------------------------------------------------------------


class _Pools:
    """Pseudo-random byte pools per dtype; a tensor is a window into its pool."""

    def __init__(self, seed: int, finetuned: bool = False) -> None:
        rng = np.random.default_rng(seed)
        u16 = rng.integers(0, 1 << 16, POOL_BYTES // 2, dtype=np.uint16)
        # keep sign and mantissa, exponent 120..121: |x| in [2^-7, 2^-5), like trained weights
        bf16 = (u16 & np.uint16(0x80FF)) | np.uint16(0x3C00)
        u8 = rng.integers(0, 256, POOL_BYTES, dtype=np.uint8)
        f8 = u8 & np.uint8(0xBF)  # exponent < 0b1111: never the NaN encodings 0x7f / 0xff
        f32 = rng.uniform(1e-4, 4e-3, POOL_BYTES // 4).astype(np.float32)
        if finetuned:  # the same values, each moved a little (low mantissa bits): what finetuning does
            tweak = np.random.default_rng(seed + 1)
            bf16 = bf16 ^ tweak.integers(0, 8, bf16.size, dtype=np.uint16)
            f8 = f8 ^ tweak.integers(0, 2, f8.size, dtype=np.uint8)
            f32 = f32 * (1 + 0.01 * tweak.standard_normal(f32.size)).astype(np.float32)
        self.pools = {2: bf16.tobytes(), 1: f8.tobytes(), 4: f32.tobytes()}
        # one-byte scales (NVFP4's F8_E4M3 group scales) are positive and finite, as rule quant-scale-value
        # requires: exponent 0b0100..0b0111, sign clear (never 0, never negative, never 0x7f)
        self.scales8 = ((u8 & np.uint8(0x1F)) | np.uint8(0x20)).tobytes()

    def produce(self, key: str, dtype: str, nbytes: int):
        item = max(1, DTYPES[dtype].bits // 8)
        scale8 = item == 1 and "scale" in key.rpartition(".")[2]
        pool = self.scales8 if scale8 else self.pools.get(item) or self.pools[2]
        mv = memoryview(pool)
        pos = (zlib.crc32(key.encode()) % (len(pool) // item)) * item

        def gen():
            left, p = nbytes, pos
            while left:
                n = min(left, CHUNK, len(pool) - p)
                yield mv[p:p + n]
                left -= n
                p = (p + n) % len(pool)

        return gen


# -- checkpoints -----------------------------------------------------------------------


@dataclass
class Synthetic:
    """A generated checkpoint and what the harness needs to know about it."""

    path: Path
    family: str
    variant: str
    sizing: Sizing
    mtp_keys: list[str] = field(default_factory=list)  # including FP8 scales
    total_bytes: int = 0
    shards: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"path": str(self.path), "family": self.family, "variant": self.variant,
                "total_bytes": self.total_bytes, "mtp_keys": len(self.mtp_keys), "shards": len(self.shards),
                "hidden": self.sizing.hidden, "layers": self.sizing.layers, "experts": self.sizing.experts}


VARIANTS = {
    "bf16": FixtureOptions(),
    "fused": FixtureOptions(expert_layout="fused"),
    "fp8": FixtureOptions(fp8=True),
    "nvfp4": FixtureOptions(),  # compressed-tensors nvfp4-pack-quantized: every 2-D linear but the head
    "nvfp4-nomtp": FixtureOptions(),  # the same, as a quantizer that dropped MTP leaves it (count kept): graft's target
}
NVFP4_GROUP = 16
# what llm-compressor's NVFP4 preset writes (targets Linear, lm_head ignored); see mappings/quantization/ct-nvfp4.yaml
NVFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized", "weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP, "symmetric": True,
        "dynamic": False}}},
    "ignore": ["lm_head"],
}


def _nvfp4(s: Spec) -> list[tuple[str, str, tuple[int, ...]]] | None:
    """The tensors compressed-tensors stores an NVFP4 linear as (None: the spec stays as it is)."""
    if s.kind != "linear" or len(s.shape) != 2 or s.shape[1] % NVFP4_GROUP or s.role == "head" \
            or not s.key.endswith(".weight"):
        return None
    m, (rows, cols) = s.key[: -len(".weight")], s.shape
    return [(f"{m}.weight_packed", "U8", (rows, cols // 2)),
            (f"{m}.weight_scale", "F8_E4M3", (rows, cols // NVFP4_GROUP)), (f"{m}.weight_global_scale", "F32", (1,))]


def _split(order: list[tuple[str, int]], mtp: set[str], n: int) -> dict[str, int]:
    """Key -> shard number: trunk evenly over n - 1 shards, the MTP tensors straddling the last boundary."""
    trunk = [(k, b) for k, b in order if k not in mtp]
    tail = [(k, b) for k, b in order if k in mtp]
    total = sum(b for _, b in trunk) or 1
    where: dict[str, int] = {}
    acc = 0
    heads = max(1, n - 1)
    for k, b in trunk:
        where[k] = min(heads - 1, acc * heads // total)
        acc += b
    half = len(tail) // 2
    for j, (k, _) in enumerate(tail):
        where[k] = heads - 1 if j < half or n == 1 else heads
    return where


def generate(family: str, sizing: Sizing, variant: str, out: Path, *, shards: int = 8, seed: int = 0,
             only: set[str] | None = None, finetuned: bool = False) -> Synthetic:
    """Write a synthetic checkpoint (or, with ``only``, just those keys as a native draft;
    ``finetuned``: the same seed's values, each moved a little). ``VARIANT@ckpt``: that variant as ckpt writes
    it, with its manifest (digests and file_stats: what graft and stitch take over instead of hashing)."""
    variant, _, written_by = variant.partition("@")
    opts = VARIANTS[variant]
    table, cfg, res, specs, mtp = _specs(family, sizing.overrides, opts)
    pools = _Pools(seed, finetuned)
    items: list[tuple[str, str, tuple[int, ...]]] = []
    mtp_keys: set[str] = set(mtp)
    nvfp4 = variant.startswith("nvfp4")
    if nvfp4:
        cfg = dict(cfg, quantization_config=NVFP4_CONFIG)
    fmt = checkpoint_codec(hint=res.table.quantization)  # the family's hinted block format (no checkpoint yet)
    for s in specs:
        packed = _nvfp4(s) if nvfp4 else None
        if packed is not None:
            items += packed
            if s.key in mtp:
                mtp_keys |= {k for k, _, _ in packed}
                mtp_keys.discard(s.key)
            continue
        if opts.fp8 and s.quant:
            items.append((s.key, "F8_E4M3", s.shape))
            sk = fmt.scale_key(s.key)
            items.append((sk, "F32", fmt.scale_of(s.key, tuple(s.shape), {})[1]))
            if s.key in mtp:
                mtp_keys.add(sk)
        else:
            items.append((s.key, s.dtype, s.shape))
    if only is not None:
        items = [it for it in items if it[0] in only]
    sizes = [(k, DTYPES[d].nbytes(math.prod(sh))) for k, d, sh in items]
    where = _split(sizes, mtp_keys, shards) if only is None else {k: 0 for k, _ in sizes}
    if variant.endswith("-nomtp"):  # the trunk's shards as they were, without the MTP tensors
        kept = [i for i, (k, _) in enumerate(sizes) if k not in mtp_keys]
        items, sizes = [items[i] for i in kept], [sizes[i] for i in kept]
        used = sorted({where[k] for k, _ in sizes})
        where = {k: used.index(where[k]) for k, _ in sizes}
    count = max(where.values()) + 1
    names = [f"model-{j + 1:05d}-of-{count:05d}.safetensors" for j in range(count)]
    if count == 1:
        names = ["model.safetensors"]  # the writer then writes no index, like save_pretrained
    tensors = [
        OutputTensor(k, d, tuple(sh), Compute(pools.produce(k, d, n), "synthetic"), shard=names[where[k]])
        for (k, d, sh), (_, n) in zip(items, sizes, strict=True)
    ]
    tensors.sort(key=lambda t: natural_key(t.key))
    files = [OutputFile("config.json", content=(json.dumps(cfg, indent=2) + "\n").encode()),
             OutputFile("generation_config.json", content=b'{"do_sample": false}\n'),
             OutputFile("tokenizer_config.json", content=b'{"model_max_length": 4096}\n')]
    plan = Plan(f"benchmarks synth {family} {variant}", tensors, files=files)
    execute(plan, out, overwrite=True, hash_tensors=written_by == "ckpt")
    if written_by != "ckpt":
        (Path(out) / MANIFEST_NAME).unlink(missing_ok=True)  # a release has no manifest of ours
    name = f"{variant}@{written_by}" if written_by else variant
    return Synthetic(Path(out), family, name, sizing, sorted(mtp_keys & {k for k, _ in sizes}),
                     sum(n for _, n in sizes), names)
