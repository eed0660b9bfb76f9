"""Plans for `ckpt fuse-experts` / `ckpt unfuse-experts`: one expert layout in, another out.

Every expert group of the checkpoint (trunk MoE layers and MTP layers, or the MTP
layers only) is read in the layout found on disk and written in the requested one by
``ckpt_tools.model.experts``; every other tensor is a byte copy. The output config records
the layout (``ckpt_expert_layout``) and the manifest each group's source and target
layouts, so that the next run knows options (up-first, interleaved) that key names
cannot show.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field

from ... import __version__
from ...errors import InputError, PlanError, UsageError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint, source_name
from ...model.consistency import note_allowed
from ...model.expert_layouts import ExpertGroup, ExpertLayout
from ...model.experts import BlockDequant, convert_group, layout_from_label
from ...model.gate import require_consistent
from ...model.mtp import detect_group_layout
from ...model.quant.codec import Codec
from ...model.quant.dequant import checkpoint_lookup, module_outputs, weight_storage
from ...model.quant.storage import Storage
from ...model.tables.resolve import trunk_specs
from ...stream.fingerprint import record_inputs
from ...stream.plan import Compute, CopyBytes, OutputFile, OutputTensor, Plan, copy_of
from ..writing.carry import carried_files
from ..writing.out_dtype import dtype_arg, finish_tensor

CONFIG_FIELD = "ckpt_expert_layout"
SCOPE_FIELD = "ckpt_expert_layout_scope"  # "mtp" when only the MTP groups carry that layout
# fuse: one tensor per projection (or gate+up); unfuse: gate and up apart again
FUSE_TARGETS = ("fused", "stacked", "stacked-transposed", "fused-transposed")
UNFUSE_TARGETS = ("per-expert", "stacked", "stacked-transposed")
TARGETS = {"fuse-experts": FUSE_TARGETS, "unfuse-experts": UNFUSE_TARGETS}


def target_layout(text: str, verb: str) -> ExpertLayout:
    """``--to`` of ``verb`` (fuse-experts | unfuse-experts): a layout that direction writes, else a usage error."""
    try:
        layout = ExpertLayout.parse(text)
    except ValueError as e:
        raise UsageError(f"--to {text!r}: {e}") from None
    allowed = TARGETS[verb]
    if layout.name not in allowed:
        other = "unfuse-experts" if verb == "fuse-experts" else "fuse-experts"
        raise UsageError(f"{verb} --to {text!r}: {verb} writes {' | '.join(allowed)}; use `ckpt {other}` for "
                         f"{layout.name}")
    return layout


@dataclass
class ExpertsRequest:
    to: ExpertLayout
    only_mtp: bool = False
    arch: str | None = None
    max_shard_size: int = 5 * 10**9
    command: str = "ckpt fuse-experts"
    dequant: str | None = None  # bf16 | fp16 | fp32: FP8 block weights (experts and others) become this dtype
    allow_invalid: frozenset[str] = frozenset()  # consistency rules the user lets through (--allow-invalid)


@dataclass
class GroupPlan:
    prefix: str
    scope: str  # trunk | mtp
    source: ExpertLayout
    target: ExpertLayout
    count: int
    tensors: list[OutputTensor]
    source_keys: list[str]

    def ops(self) -> Counter:
        return Counter(t.recipe.op for t in self.tensors)

    def to_json(self) -> dict:
        return {
            "prefix": self.prefix, "scope": self.scope, "experts": self.count,
            "source_layout": self.source.label(), "layout": self.target.label(),
            "source_tensors": len(self.source_keys), "tensors": len(self.tensors),
            "ops": dict(sorted(self.ops().items())), "bytes": sum(t.nbytes for t in self.tensors),
        }


@dataclass
class ExpertsPlan:
    plan: Plan
    family: str
    groups: list[GroupPlan] = field(default_factory=list)
    draft: bool = False  # no trunk expert tensors: only the MTP groups were converted

    def summary(self) -> dict:
        shards = self.plan.shards()
        return {
            "command": self.plan.command,
            "family": self.family,
            "draft": self.draft,
            "groups": [g.to_json() for g in self.groups],
            "tensors": len(self.plan.tensors),
            "total_bytes": self.plan.total_bytes,
            "shards": {name: sum(t.nbytes for t in ts) for name, ts in shards.items()},
            "files": [f.name for f in self.plan.files],
        }


def recorded_layouts(ckpt: Checkpoint) -> tuple[dict[str, ExpertLayout], ExpertLayout | None, str | None]:
    """Layouts a previous run wrote down: per group (manifest), and for the checkpoint (config)."""
    per_group: dict[str, ExpertLayout] = {}
    groups = (ckpt.manifest or {}).get("expert_groups")
    if isinstance(groups, dict):  # extract's manifest: {prefix: {"layout": ...}}
        groups = [{"prefix": k, **v} for k, v in groups.items() if isinstance(v, dict)]
    if isinstance(groups, list):
        for g in groups:
            try:
                per_group[g["prefix"]] = layout_from_label(g["layout"])
            except (KeyError, TypeError, ValueError):
                continue
    label = ckpt.config.raw.get(CONFIG_FIELD)
    config_layout = None
    if label is not None:
        try:
            config_layout = layout_from_label(str(label))
        except ValueError as e:
            raise InputError(f"config.json {CONFIG_FIELD}={label!r}: {e}", rule="config-field",
                             path=ckpt.root) from None
    scope = ckpt.config.raw.get(SCOPE_FIELD)
    return per_group, config_layout, scope if isinstance(scope, str) else None


def in_layout(group: ExpertGroup, layout: ExpertLayout) -> ExpertGroup:
    """``group`` stored in ``layout``; the table's key names stay when the layout name is the shipped one."""
    if layout.name == group.layout.name:
        return dataclasses.replace(group, layout=layout)
    return group.with_layout(layout)


def source_layout(group: ExpertGroup, keys, scope: str, recorded) -> ExpertLayout:
    """The layout on disk: the one a previous run recorded when the tensors fit it, else detected.

    Key names cannot show up-first or interleaved order, and non-gated fused groups with
    H == I look the same transposed or not: the record settles those.
    """
    per_group, config_layout, config_scope = recorded
    rec = per_group.get(group.prefix)
    if rec is None and config_layout is not None and config_scope in (None, "all", scope):
        rec = config_layout
    if rec is not None and (group.gated or not (rec.up_first or rec.interleaved)):
        g = in_layout(group, rec)
        if all(k.key in keys and tuple(keys[k.key].shape) == k.shape for k in g.tensors()):
            return rec
    return detect_group_layout(group, keys)


def _present(group: ExpertGroup, keys) -> bool:
    heads = (group.prefix + ".", group.prefix + "_")
    return any(k.startswith(heads) for k in keys)


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def plan_experts(ckpt: Checkpoint, req: ExpertsRequest) -> ExpertsPlan:
    gate = require_consistent(ckpt, arch=req.arch, allow=req.allow_invalid)
    table, res = gate.table, gate.view.resolved
    keys = ckpt.tensors
    fmt = gate.view.codec  # the scale companions, block and decoder of the checkpoint's scheme

    groups: list[tuple[str, ExpertGroup]] = [("mtp", g) for g in res.experts()]
    draft = False
    if not req.only_mtp:
        trunk = trunk_specs(res)[1]
        present = [g for g in trunk if _present(g, keys)]
        if trunk and not present and any(_present(g, keys) for _, g in groups):
            draft = True  # an MTP draft: the trunk's experts are not here
        else:
            groups = [("trunk", g) for g in trunk] + groups

    if not groups:
        where = "MTP layers" if req.only_mtp else "layers"
        raise InputError(f"no routed experts to convert: the {table.family} table declares no expert groups in the "
                         f"{where} of this checkpoint", rule="no-experts", path=ckpt.root)
    dequant_to = dtype_arg(req.dequant, "--dequant")
    dequantizer = BlockDequant(dequant_to, fmt) if dequant_to else None
    recorded = recorded_layouts(ckpt)
    plans: list[GroupPlan] = []
    errors: list[tuple[str, PlanError]] = []
    for scope, g in groups:
        src = in_layout(g, source_layout(g, keys, scope, recorded))
        dst = in_layout(g, req.to)
        try:
            outs = convert_group(src, keys, dst, fmt=fmt, dequant=dequantizer)
        except PlanError as e:
            errors.append((g.prefix, e))
            continue
        used = sorted({k for t in outs for k in t.meta.get("source", [])})
        plans.append(GroupPlan(g.prefix, scope, src.layout, dst.layout, g.count, outs, used))
    if errors:
        _raise_all(errors, ckpt.root)

    tensors = _ordered(ckpt, plans, Dequant.of(ckpt, dequant_to, fmt) if dequant_to else None)
    config = _config(ckpt, req)
    files = [OutputFile("config.json", content=config)] if config is not None else []
    files += carried_files(ckpt)
    manifest = note_allowed(_manifest(ckpt, table.family, req, plans, draft, dequant_to), gate)
    plan = record_inputs(Plan(req.command, tensors, files, max_shard_size=req.max_shard_size, manifest=manifest),
                         source=ckpt)
    return ExpertsPlan(plan, table.family, plans, draft)


def _manifest(ckpt: Checkpoint, family: str, req: ExpertsRequest, plans: list[GroupPlan], draft: bool,
              dequant_to: str | None) -> dict:
    conversion = {
        "expert_layout": req.to.label(),
        "scope": "mtp" if req.only_mtp or draft else "all",
        "source": {"path": source_name(ckpt)},
        "tool_version": __version__,
    }
    if dequant_to is not None:
        q = ckpt.config.get("quantization_config")
        conversion["dequantized_to"] = dequant_to
        conversion["source_quantization"] = q if isinstance(q, dict) else None
    previous = ckpt.manifest or {}
    if previous.get("kind") == "mtp-draft":
        # still a draft: what stitch needs (layers, family, format, source) carries over
        kept = {k: v for k, v in previous.items() if k not in ("tool", "version", "command", "tensors")}
        groups = dict(kept.get("expert_groups") or {}) if isinstance(kept.get("expert_groups"), dict) else {}
        for g in plans:
            groups[g.prefix] = {**groups.get(g.prefix, {}), "layout": g.target.label(), "experts": g.count}
        return {**kept, "expert_groups": groups, "expert_conversion": {**conversion,
                                                                       "groups": [g.to_json() for g in plans]}}
    return {"kind": "experts", "family": family, **conversion, "expert_groups": [g.to_json() for g in plans]}


def _raise_all(errors: list[tuple[str, PlanError]], root: str) -> None:
    """One error for every group that failed: each distinct rule in full once, then the other groups."""
    if len(errors) == 1:
        e = errors[0][1]
        raise PlanError(str(e).removeprefix(f"[{e.rule}] "), rule=e.rule, path=e.path or root)
    by_rule: dict[str | None, list[tuple[str, PlanError]]] = {}
    for prefix, e in errors:
        by_rule.setdefault(e.rule, []).append((prefix, e))
    parts = []
    for same in by_rule.values():
        text = str(same[0][1])
        if len(same) > 1:
            others = [p for p, _ in same[1:]]
            listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            text += f" (the same for {listed})"
        parts.append(text)
    rules = list(by_rule)
    raise PlanError(f"{len(errors)} expert groups cannot be converted: " + " | ".join(parts),
                    rule=rules[0] if len(rules) == 1 else "expert-group", path=root)


@dataclass(frozen=True)
class Dequant:
    """--dequant for the tensors outside expert groups: each quantized weight (any scheme's format) absorbs its
    companions, as in extract."""

    dtype: str
    fmt: Codec
    stored: dict[str, Storage]  # quantized weight key -> how it is stored
    scales: frozenset[str]  # companions of quantized weights: written into their weights, not on their own

    @classmethod
    def of(cls, ckpt: Checkpoint, dtype: str, fmt: Codec) -> Dequant:
        lookup = checkpoint_lookup(ckpt)
        stored = {k: st for k in ckpt.tensors if (st := weight_storage(ckpt, k, fmt, lookup)) is not None}
        return cls(dtype, fmt, stored, frozenset(c for st in stored.values() for c in st.all_keys()[1:]))

    def apply(self, ckpt: Checkpoint, key: str, t: OutputTensor) -> list[OutputTensor]:
        st = self.stored.get(key)
        if key in self.scales or st is None:
            return [] if key in self.scales else [t]
        if (st.scheme, st.format) == (self.fmt.scheme, self.fmt.format):  # the checkpoint's codec: as extract
            return finish_tensor(t, copy_of(ckpt.tensors[self.fmt.scale_key(key)], None, {}), None, self.dtype,
                                 self.fmt)
        return module_outputs(ckpt, st, f"{st.module}.weight", self.dtype, t.meta)


def _ordered(ckpt: Checkpoint, plans: list[GroupPlan], dequant: Dequant | None = None) -> list[OutputTensor]:
    """Source order (shard, then offset); a group's tensors where its first source tensor was."""
    owner: dict[str, GroupPlan] = {k: g for g in plans for k in g.source_keys}
    out: list[OutputTensor] = []
    done: set[int] = set()
    for shard in sorted(ckpt.shard_keys):
        for k in ckpt.shard_keys[shard]:
            ref = ckpt.tensors.get(k)
            if ref is None or ckpt.index is not None and ckpt.index["weight_map"].get(k) != shard:
                continue  # not visible through the index: loaders never see it, so neither do we
            g = owner.get(k)
            if g is None:
                meta = _carried_meta(ckpt, k)
                t = copy_of(ref, k, meta)
                out += dequant.apply(ckpt, k, t) if dequant is not None else [t]
            elif id(g) not in done:
                done.add(id(g))
                out += g.tensors
    return out


def _carried_meta(ckpt: Checkpoint, key: str) -> dict:
    """Provenance the source manifest had for an unchanged tensor (role, original name, ...)."""
    entry = ((ckpt.manifest or {}).get("tensors") or {}).get(key)
    if not isinstance(entry, dict):
        return {}
    return {k: v for k, v in entry.items() if k not in ("file", "sha256", "dtype", "shape")}


def _config(ckpt: Checkpoint, req: ExpertsRequest) -> bytes | None:
    if not ckpt.config_present:
        return None
    raw = dict(ckpt.config.raw)
    raw[CONFIG_FIELD] = req.to.label()
    if req.dequant is not None:  # no FP8 weight is left: engines must not expect one
        raw.pop("quantization_config", None)
        if isinstance(raw.get("text_config"), dict):
            raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k != "quantization_config"}
    if req.only_mtp:
        raw[SCOPE_FIELD] = "mtp"
    else:
        raw.pop(SCOPE_FIELD, None)
    return (json.dumps(raw, indent=2, ensure_ascii=False) + "\n").encode()


def stats(xplan: ExpertsPlan) -> dict:
    """Bytes copied by range vs computed, for reports."""
    copied = sum(t.nbytes for t in xplan.plan.tensors if isinstance(t.recipe, CopyBytes))
    computed = sum(t.nbytes for t in xplan.plan.tensors if isinstance(t.recipe, Compute))
    return {"bytes_copied": copied, "bytes_computed": computed}
