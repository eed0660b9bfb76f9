"""The MTP view of a checkpoint: which tensors its table expects, which are present.

Shared by inspect, validate, extract and stitch. Expert layouts are detected from the
header (a checkpoint may have been fused or unfused since release); FP8 weights bring
their block-scale companions into the MTP set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .checkpoint import Checkpoint
from .dtypes import FP8_DTYPES
from .errors import InputError
from .expert_layouts import LAYOUT_NAMES, ExpertGroup, ExpertLayout, scale_key, scale_shape
from .tables.loader import detect_table, get_table
from .tables.resolve import Resolved, Spec, resolve
from .tables.schema import Table


@dataclass
class MtpView:
    ckpt: Checkpoint
    resolved: Resolved
    layouts: dict[str, ExpertLayout]  # expert group prefix -> layout found on disk
    present: list[Spec] = field(default_factory=list)  # expected and found (scales included)
    missing: list[Spec] = field(default_factory=list)  # required but absent
    optional_absent: list[Spec] = field(default_factory=list)
    misshaped: list[tuple[Spec, tuple[int, ...]]] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # inside the MTP namespace, not expected
    beyond: list[str] = field(default_factory=list)  # MTP-looking tensors past the declared count
    missing_scales: list[str] = field(default_factory=list)  # FP8 weights without their scale

    @property
    def table(self) -> Table:
        return self.resolved.table

    @property
    def count(self) -> int:
        return self.resolved.mtp_count

    def keys(self) -> list[str]:
        return [s.key for s in self.present]

    def nbytes(self) -> int:
        return sum(self.ckpt.tensors[s.key].nbytes for s in self.present)

    def numel(self) -> int:
        return sum(self.ckpt.tensors[s.key].numel for s in self.present)

    def shards(self) -> list[str]:
        return sorted({self.ckpt.shard_of(k) for k in self.keys()})

    def groups(self) -> list[ExpertGroup]:
        return [g.with_layout(self.layouts[g.prefix]) if self.layouts[g.prefix] != g.layout else g
                for g in self.resolved.experts()]

    def complete(self) -> bool:
        return not (self.missing or self.misshaped or self.missing_scales)

    def require_complete(self) -> None:
        """Raise with every missing / mis-shaped tensor named (the rule: config declares MTP)."""
        problems = [f"missing {s.key} {list(s.shape)}" for s in self.missing]
        problems += [f"{s.key} has shape {list(a)}, table expects {list(s.shape)}" for s, a in self.misshaped]
        problems += [f"FP8 weight {k} has no {self.resolved.scale_suffix}" for k in self.missing_scales]
        if problems:
            head = f"{self.ckpt.root}: config declares {self.count} MTP layer(s) ({self.table.family}) but "
            raise InputError(head + f"{len(problems)} tensor problem(s): " + "; ".join(problems[:20])
                             + (" ..." if len(problems) > 20 else ""), rule="mtp-incomplete")


def detect_group_layout(group: ExpertGroup, keys) -> ExpertLayout:
    """The layout whose tensors are on disk; the shipped layout when nothing matches."""
    candidates = [group.layout] + [ExpertLayout(n) for n in LAYOUT_NAMES if n != group.layout.name]
    # fused and fused-transposed share key names: only shapes (refs in a mapping) tell them apart
    if hasattr(keys, "get"):
        for lay in candidates:
            g = group if lay == group.layout else group.with_layout(lay)
            if all(tuple(getattr(keys.get(t.key), "shape", ())) == t.shape for t in g.tensors()):
                return lay
    best, best_hits = group.layout, -1
    for lay in candidates:
        g = group if lay == group.layout else group.with_layout(lay)
        ts = g.tensors()
        hits = sum(1 for t in ts if t.key in keys)
        if hits == len(ts):
            return lay
        if hits > best_hits:
            best, best_hits = lay, hits
    return best if best_hits > 0 else group.layout


def choose_table(ckpt: Checkpoint, arch: str | None = None) -> Table:
    if arch:
        return get_table(arch)
    if not ckpt.config_present:
        raise InputError("config.json is missing; pass --arch NAME", rule="no-config", path=ckpt.root)
    return detect_table(ckpt.config)


def _namespace(res: Resolved) -> tuple[list[str], set[str]]:
    prefixes = [layer.prefix for layer in res.layers]
    for layer in res.layers:
        prefixes += [p for p in layer.block_prefixes if p not in prefixes]
    glue = {s.key for s in res.glue_specs()}
    return prefixes, glue


def _beyond(ckpt: Checkpoint, table: Table, count: int) -> list[str]:
    """Tensors that would belong to MTP depths >= count (or to shared glue when count is 0)."""
    probe = resolve(table, ckpt.config, mtp_count=count + 4)
    found: list[str] = []
    declared = resolve(table, ckpt.config, mtp_count=count)
    declared_glue = {s.key for s in declared.glue_specs()}
    glue = {s.key for s in probe.glue_specs()} - declared_glue
    prefixes = [p for layer in probe.layers[count:] for p in [layer.prefix, *layer.block_prefixes]]
    for key in ckpt.tensors:
        if key in glue or any(key.startswith(p) for p in prefixes):
            found.append(key)
    return sorted(found)


def open_mtp(ckpt: Checkpoint, table: Table | None = None, count: int | None = None) -> MtpView:
    """Classify the checkpoint's MTP tensors against ``table`` (detected when None)."""
    table = table or choose_table(ckpt)
    res = resolve(table, ckpt.config, mtp_count=count)
    keys = ckpt.tensors
    layouts = {g.prefix: detect_group_layout(g, keys) for g in res.experts()}
    view = MtpView(ckpt, res, layouts)
    expected = res.mtp_specs(layouts)
    expected_keys = set()
    for s in expected:
        expected_keys.add(s.key)
        ref = keys.get(s.key)
        if ref is None:
            (view.optional_absent if s.optional else view.missing).append(s)
            continue
        if tuple(ref.shape) != tuple(s.shape):
            view.misshaped.append((s, tuple(ref.shape)))
        view.present.append(s)
        if ref.dtype in FP8_DTYPES:
            skey = scale_key(s.key, res.scale_suffix)
            expected_keys.add(skey)
            sref = keys.get(skey)
            sshape = scale_shape(s.shape, res.block_size)
            scale = Spec(skey, sshape, "scale", depth=s.depth, kind="other", dtype="F32")
            if sref is None:
                view.missing_scales.append(s.key)
            else:
                if tuple(sref.shape) != sshape:
                    view.misshaped.append((scale, tuple(sref.shape)))
                view.present.append(scale)
    prefixes, glue = _namespace(res)
    for key in keys:
        if key in expected_keys:
            continue
        if key in glue or any(key.startswith(p) for p in prefixes):
            view.extra.append(key)
    view.extra.sort()
    view.beyond = _beyond(ckpt, table, res.mtp_count)
    return view
