"""Generate tiny checkpoints from a table's ``fixture`` config.

Real key names, shapes in the real relation to the config (tiny dimensions), several
shards with the MTP layer split across a shard boundary, experts in the layout the
release ships, and optionally block-FP8 weights with ``weight_scale_inv``. Shards are
written with ``safetensors.torch.save_file`` - not with our writer - so that tests
compare our code against an independent producer.

Values are a function of (seed, key) only.
"""

from __future__ import annotations

import copy
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..io.config import ConfigView
from ..model.expert_layouts import ExpertLayout
from ..model.quant.codec import checkpoint_codec
from ..model.tables.loader import get_table
from ..model.tables.resolve import Resolved, Spec, expert_specs, resolve, trunk_specs

FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


@dataclass
class FixtureOptions:
    fp8: bool = False  # block-FP8 weights (F8_E4M3 + F32 weight_scale_inv) where the table says quant
    with_optional: bool = True  # include optional tensors (e.g. per-layer embed/head copies)
    expert_layout: str | None = None  # override the shipped layout of every expert group
    num_shards: int = 4
    seed: int = 0
    config_overrides: dict = field(default_factory=dict)
    mtp_sidecar: str | None = None  # put every MTP tensor into this file (e.g. "mtp.safetensors")
    drop_mtp: bool = False  # a trunk: no MTP tensors and the MTP count set to 0
    extra_files: bool = True  # tokenizer / generation config files to be carried


def natural_key(key: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def fixture_config(family: str, overrides: dict | None = None, fp8: bool = False) -> dict:
    table = get_table(family)
    cfg = copy.deepcopy(table.fixture)
    if not cfg:
        raise ValueError(f"table {family} has no fixture config")
    if overrides:
        cfg = ConfigView(cfg).with_values(overrides).raw
    if fp8:
        cfg["quantization_config"] = dict(FP8_QUANT_CONFIG)  # top level in every release
    return cfg


def spec_values(spec: Spec, seed: int, zero_centred: bool):
    """float32 values for a spec: distinct per key, plausible per kind."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.key.encode())])
    shape = spec.shape
    if spec.kind == "norm":
        base = 0.0 if zero_centred else 1.0
        return (base + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    if spec.kind == "bias" or spec.init == "zeros":
        return (0.01 * rng.standard_normal(shape)).astype(np.float32)
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)


def _to_torch(values: np.ndarray, dtype: str):
    import torch

    from ..dtypes import torch_dtype

    return torch.from_numpy(values).to(torch_dtype(dtype))


def quantize_fp8_block(values: np.ndarray, block=(128, 128)):
    """Block-FP8 (F8_E4M3 tensor, F32 scale_inv) of float32 ``values``: the block codec's encoder."""
    import torch

    from ..model.quant.codec import CODECS
    from ..model.quant.encode_core import EncodeArgs

    out = CODECS["fp8-block"].encode(torch.from_numpy(values).to(torch.float32),
                                     EncodeArgs({"block": list(block)}, suffixes={"scale": "scale"}))
    return out["weight"], out["scale"]


def checkpoint_specs(res: Resolved, opts: FixtureOptions) -> tuple[list[Spec], set[str]]:
    """All tensors of the fixture in natural order, and the set of MTP keys."""
    layout = ExpertLayout.parse(opts.expert_layout) if opts.expert_layout else None
    trunk, groups = trunk_specs(res)
    specs: list[Spec] = list(res.shared.values()) + trunk
    for g in groups:
        specs += expert_specs(g, layout, res.dtype)
    mtp: list[Spec] = []
    if not opts.drop_mtp:
        layouts = {g.prefix: layout for g in res.experts()} if layout else None
        mtp = [s for s in res.mtp_specs(layouts) if opts.with_optional or not s.optional]
    specs.sort(key=lambda s: natural_key(s.key))
    return specs + mtp, {s.key for s in mtp}


def make_checkpoint(family: str, out_dir: str | Path, options: FixtureOptions | None = None, **kw) -> Path:
    """Write a fixture checkpoint of ``family`` into ``out_dir`` and return its path."""
    import torch
    from safetensors.torch import save_file

    opts = options or FixtureOptions(**kw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = get_table(family)
    if opts.fp8 and table.quantization is None:
        raise ValueError(f"table {family} declares no block quantization; an FP8 fixture would be fiction")
    cfg = fixture_config(family, opts.config_overrides, opts.fp8)
    view = ConfigView(cfg)
    res = resolve(table, view)
    if opts.drop_mtp:
        cfg = zero_mtp_count(table, view).raw
    specs, mtp_keys = checkpoint_specs(res, opts)

    tensors: dict[str, torch.Tensor] = {}
    order: list[str] = []
    zero_centred = table.norm == "zero_centred"
    # no checkpoint to ask yet: the block format of the scheme the family table hints (model.quant.codec)
    fmt = checkpoint_codec(hint=table.quantization) if opts.fp8 else None
    for s in specs:
        values = spec_values(_copied(s, res), opts.seed, zero_centred)
        if fmt is not None and s.quant:
            q, scale = quantize_fp8_block(values, fmt.block)
            skey = fmt.scale_key(s.key)
            assert tuple(scale.shape) == fmt.scale_of(s.key, s.shape, {})[1]
            tensors[s.key], tensors[skey] = q, scale
            order += [s.key, skey]
            if s.key in mtp_keys:
                mtp_keys.add(skey)
        else:
            tensors[s.key] = _to_torch(values, s.dtype)
            order.append(s.key)

    shards = _split(order, tensors, mtp_keys, opts)
    weight_map: dict[str, str] = {}
    total = 0
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = name
            total += tensors[k].numel() * tensors[k].element_size()
    if len(shards) > 1 or opts.mtp_sidecar:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if opts.extra_files:
        (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 16}) + "\n")
        (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}) + "\n")
        (out / "README.md").write_text(f"# tiny {family} fixture\n")
    return out


def zero_mtp_count(table, view: ConfigView) -> ConfigView:
    """The config with its MTP count set to 0 (the first of the count's keys it has), as a trunk declares it."""
    if not table.mtp.count_field:
        return view
    var = table.config[table.mtp.count_field]
    present = [k for k in var.keys if view.has(k)]
    return view.with_values({k: 0 for k in present[:1] or var.keys[:1]})


def _copied(spec: Spec, res: Resolved) -> Spec:
    """A per-layer copy (``copy_of``) holds the same values as the shared tensor, as releases ship it."""
    shared = res.shared.get(spec.copy_of or "") or (res.shared.get("embed") if spec.copy_of == "head" else None)
    return shared if shared is not None and tuple(shared.shape) == tuple(spec.shape) else spec


def _split(order: list[str], tensors, mtp_keys: set[str], opts: FixtureOptions) -> dict[str, list[str]]:
    """Shard names -> keys. The MTP tensors straddle the last shard boundary."""
    n = max(1, opts.num_shards)
    trunk = [k for k in order if k not in mtp_keys]
    mtp = [k for k in order if k in mtp_keys]
    if n == 1:
        return {"model.safetensors": order} if not opts.mtp_sidecar else {"model.safetensors": trunk,
                                                                          opts.mtp_sidecar: mtp}
    if opts.mtp_sidecar:
        groups = _chunks(trunk, tensors, n - 1) + [mtp]
    elif mtp:
        half = len(mtp) // 2
        head = _chunks(trunk, tensors, n - 1)
        head[-1] = head[-1] + mtp[:half]
        groups = head + [mtp[half:]]
    else:
        groups = _chunks(trunk, tensors, n)
    groups = [g for g in groups if g]
    names = [f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors" for j in range(len(groups))]
    if opts.mtp_sidecar:
        names[-1] = opts.mtp_sidecar
    return dict(zip(names, groups, strict=True))


def _chunks(keys: list[str], tensors, n: int) -> list[list[str]]:
    sizes = [tensors[k].numel() * tensors[k].element_size() for k in keys]
    total = sum(sizes) or 1
    out: list[list[str]] = [[] for _ in range(n)]
    acc = 0
    for k, s in zip(keys, sizes, strict=True):
        j = min(n - 1, acc * n // total)
        out[j].append(k)
        acc += s
    return out
