"""Resolve a table against a config: the concrete MTP (and trunk) tensors it implies."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigView
from ..dtypes import DTYPES, lookup
from ..errors import InputError, TableError
from ..expert_layouts import ExpertGroup, ExpertLayout, scale_key, scale_shape
from ..expr import ExprError, evaluate, render
from .schema import PartRef, Table, TensorDef


@dataclass(frozen=True)
class Spec:
    """One expected tensor."""

    key: str
    shape: tuple[int, ...]
    role: str  # a glue role, "block", "expert", "shared" or "trunk"
    depth: int | None = None  # MTP depth; None when shared by every depth or outside MTP
    sub: str | None = None  # block tensors: key relative to their block prefix
    block: int = 0  # sub-block index within an MTP step
    kind: str = "linear"
    dtype: str = "BF16"
    quant: bool = False
    optional: bool = False
    tag: str | None = None
    copy_of: str | None = None
    init: str | None = None


@dataclass
class MtpLayer:
    depth: int
    prefix: str
    block_prefixes: list[str]
    glue: dict[str, Spec]
    block: list[Spec]
    experts: list[ExpertGroup]


@dataclass
class Resolved:
    table: Table
    config: ConfigView
    env: dict
    dtype: str
    mtp_count: int
    layers: list[MtpLayer] = field(default_factory=list)
    shared: dict[str, Spec] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.table.family

    @property
    def block_size(self) -> tuple[int, int]:
        q = self.table.quantization
        return (q.block[0], q.block[1]) if q else (128, 128)

    @property
    def scale_suffix(self) -> str:
        q = self.table.quantization
        return q.scale_suffix if q else "weight_scale_inv"

    def glue_specs(self) -> list[Spec]:
        seen: dict[str, Spec] = {}
        for layer in self.layers:
            for s in layer.glue.values():
                seen.setdefault(s.key, s)
        return list(seen.values())

    def mtp_specs(self, layouts: dict[str, ExpertLayout] | None = None) -> list[Spec]:
        """All MTP tensors (glue, block, experts in their shipped or given layouts); no scales."""
        out = self.glue_specs()
        for layer in self.layers:
            out += layer.block
            for g in layer.experts:
                out += expert_specs(g, layouts.get(g.prefix) if layouts else None, self.dtype)
        return out

    def experts(self) -> list[ExpertGroup]:
        return [g for layer in self.layers for g in layer.experts]

    def mtp_prefixes(self) -> list[str]:
        return [layer.prefix for layer in self.layers]


def expert_specs(group: ExpertGroup, layout: ExpertLayout | None, dtype: str) -> list[Spec]:
    g = group if layout is None or layout == group.layout else group.with_layout(layout)
    return [
        Spec(t.key, t.shape, "expert", depth=g.depth, sub=None, kind="linear", dtype=dtype, quant=g.quant,
             tag=f"experts.{t.slot}")
        for t in g.tensors()
    ]


def scale_specs(specs: list[Spec], resolved: Resolved) -> list[Spec]:
    """The FP8 block-scale companion of each quantized spec."""
    return [
        Spec(scale_key(s.key, resolved.scale_suffix), scale_shape(s.shape, resolved.block_size), "scale",
             depth=s.depth, kind="other", dtype="F32", optional=s.optional)
        for s in specs
        if s.quant
    ]


def _config_env(table: Table, config: ConfigView) -> dict:
    env: dict = {}
    for name, var in table.config.items():
        for key in var.keys:
            found = config.find(key)
            if found is not None and found[0] is not None:
                env[name] = found[0]
                break
        else:
            if var.default is not None or not var.required:
                env[name] = var.default
            else:
                raise InputError(
                    f"config.json has none of {var.keys}, which table {table.family!r} needs for {name!r}",
                    rule="config-field",
                )
    return env


def _model_dtype(table: Table, config: ConfigView) -> str:
    for key in ("dtype", "torch_dtype"):
        v = config.get(key)
        if isinstance(v, str):
            try:
                d = lookup(v).name
            except KeyError:
                continue
            if d in ("BF16", "F16", "F32"):
                return d
    return table.dtype


def _cond(expr: str | None, env: dict, where: str) -> bool:
    if expr is None:
        return True
    try:
        return bool(evaluate(expr, env))
    except ExprError as e:
        raise TableError(f"{where}: {e}") from None


def _spec(t: TensorDef, env: dict, key: str, role: str, dtype: str, **kw) -> Spec:
    try:
        shape = tuple(int(evaluate(d, env)) for d in t.shape)
    except (ExprError, TypeError, ValueError) as e:
        raise TableError(f"shape of {t.key}: {e}") from None
    if t.dtype is not None and t.dtype not in DTYPES:
        raise TableError(f"tensor {t.key}: unknown dtype {t.dtype}")
    kw.setdefault("tag", t.tag)
    return Spec(
        key, shape, role, kind=t.kind, dtype=t.dtype or dtype, quant=t.quant, optional=t.optional,
        copy_of=t.copy_of, init=t.init, **kw,
    )


def _absolute(template: str, prefix: str, env: dict) -> str:
    """Render a key: relative to ``prefix``, or from the root when it starts with '/'."""
    if template.startswith("/"):
        return render(template[1:], env)
    return prefix + render(template, env)


def part_specs(
    table: Table, refs: list[PartRef], env: dict, prefix: str, dtype: str, role: str, **kw
) -> tuple[list[Spec], list[ExpertGroup]]:
    specs: list[Spec] = []
    groups: list[ExpertGroup] = []
    for ref in refs:
        if not _cond(ref.when, env, f"part {ref.part}"):
            continue
        for item in table.parts[ref.part]:
            if item.tensor is not None:
                t = item.tensor
                if not _cond(t.when, env, t.key):
                    continue
                sub = render(t.key, env)
                specs.append(_spec(t, env, prefix + sub, role, dtype, sub=sub, **kw))
            else:
                ex = item.experts
                assert ex is not None
                if not _cond(ex.when, env, ex.prefix):
                    continue
                try:
                    count, hidden, inter = (int(evaluate(getattr(ex, f), env)) for f in ("count", "hidden", "inter"))
                except (ExprError, TypeError, ValueError) as e:
                    raise TableError(f"experts {ex.prefix}: {e}") from None
                sub = render(ex.prefix, env)
                layout = ExpertLayout(ex.layout, up_first=ex.up_first, interleaved=ex.interleaved)
                names = tuple(sorted(ex.names.items())) if ex.names else None
                groups.append(
                    ExpertGroup(prefix + sub, count, hidden, inter, ex.gated, layout, ex.quant, names,
                                kw.get("depth"), sub)
                )
    return specs, groups


def resolve(table: Table, config: ConfigView, mtp_count: int | None = None) -> Resolved:
    """Concrete MTP tensors of ``table`` for ``config`` (``mtp_count`` overrides the config's count)."""
    env = _config_env(table, config)
    dtype = _model_dtype(table, config)
    try:
        count = int(evaluate(table.mtp.count, env)) if mtp_count is None else mtp_count
    except (ExprError, TypeError, ValueError) as e:
        raise TableError(f"{table.family}: mtp.count: {e}") from None
    res = Resolved(table, config, env, dtype, count)
    for name, t in table.shared.items():
        if _cond(t.when, env, f"shared.{name}"):
            res.shared[name] = _spec(t, env, render(t.key, env), "shared", dtype, tag=t.tag or name)
    for i in range(count):
        lenv = dict(env, i=i)
        for name, expr in table.mtp.layer_vars.items():
            lenv[name] = evaluate(expr, lenv)
        prefix = render(table.mtp.prefix, lenv)
        glue: dict[str, Spec] = {}
        for role, t in table.mtp.glue.items():
            if not _cond(t.when, lenv, f"glue {role}"):
                continue
            shared_by_depths = t.key.startswith("/") and "{" not in t.key
            key = _absolute(t.key, prefix, lenv)
            glue[role] = _spec(t, lenv, key, role, dtype, depth=None if shared_by_depths else i)
        block: list[Spec] = []
        experts: list[ExpertGroup] = []
        bprefixes = []
        for b, bdef in enumerate(table.mtp.blocks):
            bprefix = _absolute(bdef.prefix, prefix, lenv) if bdef.prefix else prefix
            bprefixes.append(bprefix)
            specs, groups = part_specs(table, bdef.parts, lenv, bprefix, dtype, "block", depth=i, block=b)
            block += specs
            experts += groups
        res.layers.append(MtpLayer(i, prefix, bprefixes, glue, block, experts))
    return res


def trunk_specs(res: Resolved) -> tuple[list[Spec], list[ExpertGroup]]:
    """Decoder layers of the main model (the fixture generator and --from-layer use these)."""
    table, env = res.table, res.env
    n = int(evaluate(table.trunk.count, env))
    specs: list[Spec] = []
    groups: list[ExpertGroup] = []
    for lidx in range(n):
        lenv = dict(env, l=lidx)
        prefix = render(table.trunk.prefix, lenv)
        s, g = part_specs(table, table.trunk.parts, lenv, prefix, res.dtype, "trunk")
        specs += s
        groups += g
    return specs, groups
