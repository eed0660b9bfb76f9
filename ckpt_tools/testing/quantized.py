"""Tiny quantized checkpoints made from the BF16 fixtures, stored as the real quantizers store them.

``make_quantized_checkpoint(family, out, QuantOptions(scheme=...))`` writes the family's BF16 fixture,
quantizes its Linear weights with the scheme's producer (``quantizers``) and writes the quantization
config the tool writes. Quantized, as real recipes do: every Linear weight of trunk and MTP except the
LM head and its copies, routers, vision towers, modules whose width the scheme's group does not divide,
and what the scheme keeps in BF16; routers and skipped modules are excluded the way each tool writes it.

``QuantOptions`` builds the failure modes seen in public trackers: MTP dropped (the config still
declaring it, or its count 0), stored BF16 but only partly excluded (``mtp_exclude="blocks"``,
``"no-fusion"``), excluded under the engines' fused names or only a fused group's first shard, stored
quantized but excluded, tensors removed after quantization (``drop_keys``). Defaults: quantized MTP not
excluded, BF16 MTP excluded by exact names, dropped MTP not mentioned.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..io.config import ConfigView
from ..model.quant.codec import checkpoint_codec
from ..model.tables.loader import get_table
from ..model.tables.resolve import Resolved, resolve
from . import quantizers as q
from .fixtures import FixtureOptions, checkpoint_specs, make_checkpoint, zero_mtp_count

MTP_MODES = ("quantized", "bf16", "dropped")
EXCLUDE_STYLES = ("none", "exact", "pattern", "blocks", "no-fusion", "fused", "partial")
FUSION_ROLES = ("fusion", "fusion_embed", "fusion_hidden")
# vLLM / SGLang packed module names (packed_modules_mapping / stacked_params_mapping) -> checkpoint shards
ENGINE_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "fused_wqa_wkv": ("wq_a", "wkv"),
}
_PER_EXPERT = re.compile(r"^(?P<group>.+\.experts)\.\d+\.[^.]+$")


@dataclass(frozen=True)
class Scheme:
    name: str
    producer: str  # compressed-tensors | modelopt | fp8-block | fp8-fp4
    algo: str  # compressed-tensors preset, ModelOpt quant_algo, or the DeepSeek variant
    group_size: int | None = None  # override of the preset's group size
    keep_bf16: tuple[str, ...] = ()  # fnmatch patterns of module names the tool leaves in BF16
    doc: str = ""


SCHEMES = {s.name: s for s in (
    Scheme("ct-fp8-tensor", "compressed-tensors", "FP8", doc="float-quantized, per-tensor weights, static input_scale"),
    Scheme("ct-fp8-channel", "compressed-tensors", "FP8_DYNAMIC", doc="float-quantized, per-channel weights"),
    Scheme("ct-fp8-block", "compressed-tensors", "FP8_BLOCK", doc="float-quantized, 128x128 block weights"),
    Scheme("ct-w4a16", "compressed-tensors", "W4A16", doc="pack-quantized int4, symmetric, group 128"),
    Scheme("ct-w4a16-g32", "compressed-tensors", "W4A16", 32, doc="pack-quantized int4, symmetric, group 32"),
    Scheme("ct-w4a16-asym", "compressed-tensors", "W4A16_ASYM", doc="pack-quantized int4, zero point, group 128"),
    Scheme("ct-w4a16-asym-g32", "compressed-tensors", "W4A16_ASYM", 32,
           doc="pack-quantized int4, zero point, group 32"),
    Scheme("ct-w8a16", "compressed-tensors", "W8A16", doc="pack-quantized int8, group 128"),
    Scheme("ct-w8a8", "compressed-tensors", "W8A8", doc="int-quantized int8 per channel, dynamic int8 activations"),
    Scheme("ct-nvfp4", "compressed-tensors", "NVFP4", doc="nvfp4-pack-quantized W4A4"),
    Scheme("ct-nvfp4a16", "compressed-tensors", "NVFP4A16", doc="nvfp4-pack-quantized weight-only"),
    Scheme("ct-mxfp4", "compressed-tensors", "MXFP4", doc="mxfp4-pack-quantized"),
    Scheme("modelopt-fp8", "modelopt", "FP8", doc="ModelOpt FP8 per-tensor with input_scale"),
    Scheme("modelopt-nvfp4", "modelopt", "NVFP4", doc="ModelOpt NVFP4 (weight_scale + weight_scale_2)"),
    Scheme("modelopt-mixed", "modelopt", "MIXED_PRECISION",
           doc="ModelOpt MIXED_PRECISION: routed experts NVFP4, other Linears FP8, per-module quantized_layers"),
    Scheme("fp8-block-ue8m0", "fp8-block", "ue8m0",
           doc="DeepSeek block FP8, F32 weight_scale_inv of powers of two, scale_fmt ue8m0 (V3.1 / V3.2)"),
    Scheme("fp8-ue8m0-fp4-experts", "fp8-fp4", "ue8m0", keep_bf16=("*.compressor.*", "*.weights_proj"),
           doc="DeepSeek V4 release: F8_E4M3 + F8_E8M0 128x128 .scale; routed experts FP4 in I8 + per-32 .scale"),
)}


@dataclass(frozen=True)
class QuantOptions:
    scheme: str
    mtp: str = "quantized"  # quantized | bf16 | dropped
    mtp_count: str = "kept"  # for dropped MTP: kept | zero
    mtp_exclude: str | None = None  # one of EXCLUDE_STYLES; None: the mode's default
    drop_keys: tuple[str, ...] = ()  # fnmatch patterns of output keys to leave out (e.g. a scale)

    def exclude_style(self) -> str:
        return self.mtp_exclude or {"quantized": "none", "bf16": "exact", "dropped": "none"}[self.mtp]

    def check(self) -> Scheme:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}; known: {', '.join(SCHEMES)}")
        if self.mtp not in MTP_MODES or self.mtp_count not in ("kept", "zero"):
            raise ValueError(f"mtp must be one of {MTP_MODES} and mtp_count kept or zero")
        if self.exclude_style() not in EXCLUDE_STYLES:
            raise ValueError(f"mtp_exclude must be one of {EXCLUDE_STYLES}")
        return SCHEMES[self.scheme]


@dataclass(frozen=True)
class Linear:
    """One Linear module of the fixture and how the quantizer stores it."""

    name: str
    weight: torch.Tensor
    mtp: bool
    fusion: bool
    expert: bool
    eligible: bool  # the scheme quantizes it when MTP is stored like the trunk
    quantized: bool

    def governed(self, quant: QuantOptions) -> bool:
        """An MTP module whose exclusion entries ``mtp_exclude`` writes (dropped MTP: none of its modules is listed)."""
        return self.mtp and (self.eligible or quant.mtp == "dropped")


@dataclass
class _Build:
    tensors: dict[str, torch.Tensor]
    config: dict
    extra_json: dict[str, dict] = field(default_factory=dict)  # file name -> content (hf_quant_config.json)


# ---------------------------------------------------------------------------


def make_quantized_checkpoint(family: str, out_dir: str | Path, quant: QuantOptions,
                              options: FixtureOptions | None = None) -> Path:
    """Write a quantized fixture of ``family`` into ``out_dir`` and return its path."""
    scheme = quant.check()
    opts = options or FixtureOptions()
    if opts.fp8 or opts.drop_mtp:
        raise ValueError("quantized fixtures start from the BF16 fixture with MTP: use QuantOptions.mtp, "
                         "not fp8 / drop_mtp")
    if opts.expert_layout not in (None, "per-expert"):
        raise ValueError("quantizers save experts per expert; a quantized fixture takes no other expert layout")
    opts = replace(opts, expert_layout="per-expert")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckpt-qsrc-") as tmp:
        src = make_checkpoint(family, tmp, opts)
        tensors, shard_of = _read_source(src)
        config = json.loads((src / "config.json").read_text())
        for p in src.iterdir():
            if p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(p, out / p.name)
    table = get_table(family)
    res = resolve(table, ConfigView(config))
    specs, mtp_keys = checkpoint_specs(res, opts)
    linears = _linears(specs, mtp_keys, tensors, scheme, quant)
    build = _PRODUCERS[scheme.producer](scheme, linears, tensors, config, res, quant)
    dropped = mtp_keys if quant.mtp == "dropped" else set()
    final = {k: v for k, v in build.tensors.items()
             if _source_key(k, tensors) not in dropped and not any(fnmatch.fnmatchcase(k, p) for p in quant.drop_keys)}
    if quant.mtp == "dropped" and quant.mtp_count == "zero":
        build.config = zero_mtp_count(table, ConfigView(build.config)).raw
    _write(out, final, shard_of, tensors, build)
    return out


def _read_source(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    shard_of: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            tensors[k] = v
            shard_of[k] = f.name
    return tensors, shard_of


def _linears(specs, mtp_keys: set[str], tensors, scheme: Scheme, quant: QuantOptions) -> list[Linear]:
    """Every Linear module (2-D ``.weight`` of a linear or router), and whether the scheme quantizes it."""
    out = []
    for s in specs:
        if not s.key.endswith(".weight") or len(s.shape) != 2 or s.kind not in ("linear", "router"):
            continue
        name = s.key[: -len(".weight")]
        expert = s.role == "expert"
        if scheme.producer == "fp8-block":
            eligible = s.quant
        else:
            group = _group(scheme, expert)
            eligible = (s.kind == "linear" and s.role not in ("shared", "head")
                        and not any(fnmatch.fnmatchcase(name, p) for p in scheme.keep_bf16)
                        and (group is None or s.shape[1] % group == 0))
        mtp = s.key in mtp_keys
        quantized = eligible and not (mtp and quant.mtp == "bf16")
        out.append(Linear(name, tensors[s.key], mtp, s.role in FUSION_ROLES, expert, eligible, quantized))
    return out


def _group(scheme: Scheme, expert: bool) -> int | None:
    """The input-width divisor a module needs to be quantized by ``scheme`` (None: any width)."""
    if scheme.producer == "compressed-tensors":
        return q.ct_group(scheme.algo, scheme.group_size)
    if scheme.producer == "modelopt":
        return 16 if _modelopt_algo(scheme, expert) == "NVFP4" else None
    return 32 if scheme.producer == "fp8-fp4" and expert else None


def _modelopt_algo(scheme: Scheme, expert: bool) -> str:
    """MIXED_PRECISION as ModelOpt's mixed recipes ship it: routed experts NVFP4, the other Linears FP8."""
    return scheme.algo if scheme.algo != "MIXED_PRECISION" else ("NVFP4" if expert else "FP8")


def _source_key(key: str, source: dict[str, torch.Tensor]) -> str:
    """The source tensor an output key belongs to: itself, or its module's weight."""
    if key in source:
        return key
    module = key.rpartition(".")[0]
    return f"{module}.weight" if f"{module}.weight" in source else key


# ---------------------------------------------------------------------------
# exclusion entries for the MTP modules


def _mtp_entries(style: str, linears: list[Linear], res: Resolved, pattern) -> list[str]:
    """The exclusion entries a tool writes for the MTP Linears in ``style``; ``pattern(prefix)`` spells a prefix."""
    mtp = [lin for lin in linears if lin.mtp and lin.eligible]
    names = [lin.name for lin in mtp]
    if style == "none":
        return []
    if style == "exact":
        return names
    if style == "no-fusion":
        return [lin.name for lin in mtp if not lin.fusion]
    if style in ("pattern", "blocks"):
        prefixes = [p.rstrip(".") for p in res.mtp_prefixes()]
        entries = [pattern(p) for p in prefixes]
        if style == "pattern":
            entries += [n for n in names if not any(n.startswith(p + ".") for p in prefixes)]
        return entries
    return _engine_names(names, partial=style == "partial")


def _engine_names(names: list[str], partial: bool) -> list[str]:
    """Names as the engines fuse them (``fused``), or only the first shard of each fused group (``partial``)."""
    have = set(names)
    out: list[str] = []
    for n in names:
        parent, _, leaf = n.rpartition(".")
        m = _PER_EXPERT.match(n)
        if m and not partial:
            entry = m.group("group")
        else:
            fused = next((f for f, shards in ENGINE_FUSED.items()
                          if leaf in shards and all(f"{parent}.{s}" in have for s in shards)), None)
            if fused is None:
                entry = n
            elif partial:
                entry = n if leaf == ENGINE_FUSED[fused][0] else None
            else:
                entry = f"{parent}.{fused}"
        if entry is not None and entry not in out:
            out.append(entry)
    return out


def _re_prefix(prefix: str) -> str:
    return "re:^" + re.escape(prefix) + r"\..*"


def _glob_prefix(prefix: str) -> str:
    return prefix + "*"


# ---------------------------------------------------------------------------
# producers


def _ct(scheme: Scheme, linears, tensors, config, res, quant) -> _Build:
    ct_scheme = q.ct_scheme(scheme.algo, scheme.group_size)
    weights = {lin.name: lin.weight for lin in linears}
    keep = [lin.name for lin in linears if not lin.quantized]
    compressed, compressor = q.ct_compress(weights, ct_scheme, keep)
    out = dict(tensors)
    for lin in linears:
        if lin.quantized:
            del out[f"{lin.name}.weight"]
            out.update({k: v for k, v in compressed.items() if k.startswith(lin.name + ".")})
    qc = compressor.quantization_config
    governed = {lin.name for lin in linears if lin.governed(quant)}
    qc.ignore = [n for n in qc.ignore if n not in governed] + _mtp_entries(
        quant.exclude_style(), linears, res, _re_prefix)
    with tempfile.TemporaryDirectory() as tmp:  # the library writes quantization_config into config.json
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        compressor.update_config(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text())
    return _Build(out, config)


def _modelopt(scheme: Scheme, linears, tensors, config, res, quant) -> _Build:
    algo_of = {lin.name: _modelopt_algo(scheme, lin.expert) for lin in linears if lin.quantized}
    out = dict(tensors)
    for algo, make in (("FP8", q.modelopt_fp8), ("NVFP4", q.modelopt_nvfp4)):
        chosen = {lin.name: lin.weight for lin in linears if algo_of.get(lin.name) == algo}
        if chosen:
            for name in chosen:
                del out[f"{name}.weight"]
            out.update(make(chosen))
    style = quant.exclude_style()
    entries = _mtp_entries(style, linears, res, _glob_prefix)
    quantization: dict = {"quant_algo": scheme.algo, "kv_cache_quant_algo": None}
    if scheme.algo == "MIXED_PRECISION":
        # an MTP module is declared by being listed; the style's entries say which are left out
        covered = {lin.name for lin in linears if lin.governed(quant)
                   and any(fnmatch.fnmatchcase(lin.name, e) for e in entries)}
        layers = {}
        for lin in linears:
            algo = algo_of.get(lin.name)
            if lin.governed(quant) and quant.mtp != "dropped":
                algo = None if lin.name in covered else _modelopt_algo(scheme, lin.expert)
            if algo:
                layers[lin.name] = {"quant_algo": algo, "group_size": 16} if algo == "NVFP4" else {"quant_algo": algo}
        quantization["quantized_layers"] = dict(sorted(layers.items()))
        if style in ("pattern", "blocks"):  # ModelOpt's _add_mtp_exclusions: a prefix wildcard per MTP layer
            quantization["exclude_modules"] = [e for e in entries if e.endswith("*")]
    else:
        if scheme.algo == "NVFP4":
            quantization["group_size"] = 16
        trunk = sorted(lin.name for lin in linears if not lin.quantized and not lin.governed(quant))
        quantization["exclude_modules"] = trunk + entries
    hf_quant = {"producer": {"name": "modelopt", "version": "0.39.0"}, "quantization": quantization}
    config = dict(config)
    config["quantization_config"] = _modelopt_config_json(hf_quant)
    return _Build(out, config, {"hf_quant_config.json": hf_quant})


def _modelopt_config_json(hf_quant: dict) -> dict:
    """The ``quantization_config`` ModelOpt embeds in config.json (its ``convert_hf_quant_config_format``)."""
    d = hf_quant["quantization"]
    algo = d["quant_algo"]

    def group(a: str, gs: int | None = None) -> dict:
        bits = 4 if a == "NVFP4" else 8
        g = {"input_activations": {"dynamic": False, "num_bits": bits, "type": "float"},
             "weights": {"dynamic": False, "num_bits": bits, "type": "float"}}
        if a == "NVFP4":
            for part in g.values():
                part["group_size"] = gs or 16
        return g

    out: dict = {}
    if algo == "MIXED_PRECISION":
        by_cfg: dict[tuple, list[str]] = defaultdict(list)
        for name, cfg in d["quantized_layers"].items():
            by_cfg[tuple(sorted(cfg.items()))].append(name)
        out["config_groups"] = {
            f"group_{i}": {**group(dict(k)["quant_algo"], dict(k).get("group_size")), "targets": sorted(names)}
            for i, (k, names) in enumerate(by_cfg.items())
        }
        out["quantized_layers"] = d["quantized_layers"]
    else:
        out["config_groups"] = {"group_0": {**group(algo, d.get("group_size")), "targets": ["Linear"]}}
    out["ignore"] = d.get("exclude_modules") or []
    out["quant_algo"] = algo
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out


def _fp8_block(scheme: Scheme, linears, tensors, config, res, quant) -> _Build:
    if res.table.quantization is None:
        raise ValueError(f"table {res.family} declares no block quantization; a block-FP8 fixture would be fiction")
    out = dict(tensors)
    fmt = checkpoint_codec(hint=res.table.quantization)  # the family's hinted scheme (model.quant.codec)
    for lin in linears:
        if lin.quantized:
            out[f"{lin.name}.weight"], out[fmt.scale_key(f"{lin.name}.weight")] = q.fp8_block_ue8m0(lin.weight,
                                                                                               fmt.block)
    return _Build(out, _fp8_config(config, fmt.block, _fp8_exclusions(quant, linears, res)))


def _fp8_fp4(scheme: Scheme, linears, tensors, config, res, quant) -> _Build:
    out = dict(tensors)
    experts = {lin.name: lin.weight for lin in linears if lin.quantized and lin.expert}
    for name in experts:
        del out[f"{name}.weight"]
    out.update(q.fp4_experts(experts) if experts else {})
    for lin in linears:
        if lin.quantized and not lin.expert:
            w, s = q.fp8_block_ue8m0(lin.weight)
            out[f"{lin.name}.weight"], out[f"{lin.name}.scale"] = w, s.to(torch.float8_e8m0fnu)
    config = _fp8_config(config, (128, 128), _fp8_exclusions(quant, linears, res))
    config["expert_dtype"] = "fp4"
    return _Build(out, config)


def _fp8_exclusions(quant: QuantOptions, linears, res) -> list[str]:
    style = quant.exclude_style()
    if style in ("pattern", "blocks"):
        raise ValueError("block-FP8 configs list modules_to_not_convert by name; pattern exclusions are not theirs")
    return _mtp_entries(style, linears, res, _glob_prefix)


def _fp8_config(config: dict, block: tuple[int, int], exclusions: list[str]) -> dict:
    config = dict(config)
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
          "weight_block_size": list(block)}
    if exclusions:
        qc["modules_to_not_convert"] = exclusions
    config["quantization_config"] = qc
    return config


_PRODUCERS = {"compressed-tensors": _ct, "modelopt": _modelopt, "fp8-block": _fp8_block, "fp8-fp4": _fp8_fp4}


# ---------------------------------------------------------------------------


def _write(out: Path, final: dict[str, torch.Tensor], shard_of: dict[str, str], source, build: _Build) -> None:
    from safetensors.torch import save_file

    shards: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    last = sorted(set(shard_of.values()))[-1]
    for k, v in final.items():
        shards[shard_of.get(_source_key(k, source), last)][k] = v.contiguous()
    weight_map: dict[str, str] = {}
    total = 0
    for name, part in sorted(shards.items()):
        save_file(part, str(out / name), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    if len(set(shard_of.values())) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(build.config, indent=2) + "\n")
    for name, content in build.extra_json.items():
        (out / name).write_text(json.dumps(content, indent=4) + "\n")
