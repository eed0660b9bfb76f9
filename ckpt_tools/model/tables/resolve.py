"""Resolve a table against a config: the concrete MTP (and trunk) tensors it implies."""

from __future__ import annotations

import functools
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...dtypes import DTYPES, lookup
from ...errors import CkptError, InputError, TableError
from ...io.config import ConfigView
from ..expert_layouts import ExpertGroup, ExpertLayout
from ..expr import ExprError, evaluate, names_in, render, render_key, template_names

if TYPE_CHECKING:
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
    dtype_fixed: bool = False  # the release fixes ``dtype`` (rule stored-dtype)
    pinned: bool = False  # the table names ``dtype`` (an F32 router bias): every writer keeps it (out_dtype.pinned)


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
    probed: list[MtpLayer] = field(default_factory=list)  # undeclared depths (``resolve``'s probe)
    # the trunk's specs, computed once: the gate's rules, validate and the writers all ask for them
    trunk: tuple[list[Spec], list[ExpertGroup]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def family(self) -> str:
        return self.table.family

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

    def shared_source(self, role: str) -> Spec | None:
        """The shared tensor a per-layer ``role`` copy duplicates (a tied head is the embedding)."""
        return self.shared.get(role) or (self.shared.get("embed") if role == "head" else None)

    def mtp_prefixes(self) -> list[str]:
        return [layer.prefix for layer in self.layers]


def expert_specs(group: ExpertGroup, layout: ExpertLayout | None, dtype: str) -> list[Spec]:
    g = group if layout is None or layout == group.layout else group.with_layout(layout)
    return [
        Spec(t.key, t.shape, "expert", depth=g.depth, sub=None, kind="linear", dtype=dtype, quant=g.quant,
             tag=f"experts.{t.slot}")
        for t in g.tensors()
    ]


MAX_COUNT = 2**63 - 1  # a dimension beyond any safetensors shape is not a dimension
_SCALAR_TYPES = (str, int, float, bool)
_KIND_TEXT = {
    "count": "a non-negative integer", "int": "an integer", "number": "a finite number", "bool": "true or false",
    "str": "a string", "list": "a list of strings or numbers",
    "seq": "a string or a list of strings or numbers", "any": "anything",
}


def typed_value(kind: str, v: object) -> object:
    """``v`` as a value of ``kind`` (see ``VarDef``); ValueError saying what was expected if it is not one.

    ``count`` and ``int`` take JSON integers only: ``1.0`` is a float to every strict reader of the config
    (transformers' config dataclasses refuse it), so it is refused here, not read as 1."""
    ok = {
        "count": lambda: type(v) is int and 0 <= v <= MAX_COUNT,
        "int": lambda: type(v) is int and abs(v) <= MAX_COUNT,
        "number": lambda: _is_number(v),
        "bool": lambda: isinstance(v, bool) or (type(v) is int and v in (0, 1)),
        "str": lambda: isinstance(v, str),
        "list": lambda: isinstance(v, list) and all(x is None or isinstance(x, _SCALAR_TYPES) for x in v),
        "seq": lambda: isinstance(v, str) or (isinstance(v, list) and all(x is None or isinstance(x, _SCALAR_TYPES)
                                                                         for x in v)),
        "any": lambda: True,
    }[kind]()
    if not ok:
        float_int = kind in ("count", "int") and isinstance(v, float) and _is_number(v) and v.is_integer()
        raise ValueError(f"expected {_KIND_TEXT[kind]}" + (f" (a JSON integer such as {int(v)}, not the float {v!r})"
                                                           if float_int else ""))
    return v


def _config_env(table: Table, config: ConfigView) -> dict:
    """The table's variables from ``config``, each checked against its type before any expression sees it."""
    env: dict = {}
    for name, var in table.config.items():
        for key in var.keys:
            found = config.find(key)
            if found is not None and found[0] is not None:
                try:
                    env[name] = typed_value(var.kind, found[0])
                except ValueError as e:
                    raise InputError(f"field {config.path_of(key)!r} = {_short_json(found[0])}: table {table.family!r} "
                                     f"reads it as {name!r}, {e}", rule="config-field",
                                     path=config.name or "config.json") from None
                break
        else:
            if var.default is not None or not var.required:
                env[name] = var.default
            else:
                raise InputError(
                    f"config.json has none of {var.keys}, which table {table.family!r} needs for {name!r}",
                    rule="config-field", path=config.name,
                )
    return env


# Sanity bounds on counts read from a config (hostile configs must not make resolution loop for ever).
# Far above any real model: MTP depths <= 16, decoder layers <= ~200, routed experts <= ~1k.
MAX_MTP_LAYERS = 64
MAX_TRUNK_LAYERS = 2048
MAX_EXPERTS = 16384


class _EvalFailed(TableError):
    """An expression failed (or gave an unusable value). It stays a TableError unless config values took
    part: then ``_config_errors`` turns it into an InputError naming the config.json field."""

    def __init__(self, message: str, expr: str, env: dict, template: bool = False) -> None:
        super().__init__(message)
        self.detail, self.expr, self.env, self.template = message, expr, env, template

    def explain(self, table: Table, config: ConfigView) -> CkptError:
        try:
            names = template_names(self.expr) if self.template else names_in(self.expr)
        except ExprError:
            return self
        fields = []
        for name in sorted(n for n in names if n in table.config):
            keys = table.config[name].keys
            key = next((k for k in keys if (f := config.find(k)) is not None and f[0] is not None), None)
            fields.append((name, keys, key, self.env.get(name)))
        if not fields:
            return self  # a table problem, not the config's
        suspects = [f for f in fields if not _is_number(f[3])] or fields
        parts = [f"field {key!r} = {_short(value)}" if key else f"field {' / '.join(keys)} (absent)"
                 for _, keys, key, value in suspects]
        return InputError(f"config.json {', '.join(parts)}: unusable for table {table.family!r} "
                          f"(variable {', '.join(f[0] for f in suspects)}): {self.detail}", rule="config-field",
                          path=config.name)


def _is_number(v: object) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))  # ints of any size are finite


def _short(v: object, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _short_json(v: object, limit: int = 60) -> str:
    """A config value as config.json spells it (``true``, ``"1"``, ``1.0``)."""
    try:
        r = json.dumps(v, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):
        return _short(v, limit)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _config_errors(fn):
    """Turn evaluation failures that involve config values into InputError (rule config-field)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _EvalFailed as e:
            a = inspect.signature(fn).bind(*args, **kwargs).arguments
            res = a.get("res")
            table, config = (res.table, res.config) if res is not None else (a["table"], a["config"])
            raise e.explain(table, config) from None

    return wrapper


def _eval(expr, env: dict, where: str):
    try:
        return evaluate(expr, env)
    except ExprError as e:
        raise _EvalFailed(f"{where}: {e}", str(expr), env) from None


def _int(expr, env: dict, where: str, limit: int | None = None) -> int:
    """A dimension or count: a non-negative integer (an integral float such as 64.0 is accepted)."""
    v = _eval(expr, env, where)
    ok = _is_number(v) and v >= 0 and (isinstance(v, int) or float(v).is_integer())
    if not ok or (limit is not None and v > limit):
        want = f"an integer from 0 to {limit}" if limit is not None else "a non-negative integer"
        raise _EvalFailed(f"{where}: {expr!r} gives {_short(v)}, not {want}", str(expr), env)
    return int(v)


def _render(template: str, env: dict) -> str:
    try:
        return render(template, env)
    except ExprError as e:
        raise _EvalFailed(f"key {template!r}: {e}", template, env, template=True) from None


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
    return bool(_eval(expr, env, where))


def _spec(t: TensorDef, env: dict, key: str, role: str, dtype: str, **kw) -> Spec:
    shape = tuple(_int(d, env, f"shape of {t.key}") for d in t.shape)
    if t.dtype is not None and t.dtype not in DTYPES:
        raise TableError(f"tensor {t.key}: unknown dtype {t.dtype}")
    kw.setdefault("tag", t.tag)
    return Spec(
        key, shape, role, kind=t.kind, dtype=t.dtype or dtype, quant=t.quant, optional=t.optional,
        copy_of=t.copy_of, init=t.init, dtype_fixed=t.dtype_fixed, pinned=t.dtype is not None, **kw,
    )


def _absolute(template: str, prefix: str, env: dict) -> str:
    """``render_key``, its expression errors named as a table's."""
    try:
        return render_key(template, prefix, env)
    except ExprError as e:
        raise _EvalFailed(f"key {template!r}: {e}", template, env, template=True) from None


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
                # a leading '/' places the tensor from the root (one shared by every depth, listed with one)
                sub = _render(t.key.removeprefix("/"), env)
                key = sub if t.key.startswith("/") else prefix + sub
                specs.append(_spec(t, env, key, role, dtype, sub=sub, **kw))
            else:
                ex = item.experts
                assert ex is not None
                if not _cond(ex.when, env, ex.prefix):
                    continue
                count = _int(ex.count, env, f"experts {ex.prefix}: count", MAX_EXPERTS)
                hidden, inter = (_int(getattr(ex, f), env, f"experts {ex.prefix}: {f}") for f in ("hidden", "inter"))
                sub = _render(ex.prefix, env)
                layout = ExpertLayout(ex.layout, up_first=ex.up_first, interleaved=ex.interleaved)
                names = tuple(sorted(ex.names.items())) if ex.names else None
                groups.append(
                    ExpertGroup(prefix + sub, count, hidden, inter, ex.gated, layout, ex.quant, names,
                                kw.get("depth"), sub)
                )
    return specs, groups


@_config_errors
def resolve(table: Table, config: ConfigView, mtp_count: int | None = None, probe: int = 0) -> Resolved:
    """Concrete MTP tensors of ``table`` for ``config`` (``mtp_count`` overrides the config's count).

    ``probe`` more depths past the declared count go to ``probed``: ones the checkpoint does not declare,
    resolved only to find where such a depth would live (tensors past the declared count). The config
    describes nothing about them, so a per-depth variable that cannot be evaluated there (e.g. a per-depth
    list with one entry per declared depth) is None, a depth whose tensors still cannot be resolved keeps
    only its prefix, and one whose prefix cannot be rendered is left out. Declared depths fail as always.
    """
    env = _config_env(table, config)
    dtype = _model_dtype(table, config)
    count = _int(table.mtp.count, env, f"{table.family}: mtp.count", MAX_MTP_LAYERS) if mtp_count is None else mtp_count
    res = Resolved(table, config, env, dtype, count)
    for name, t in table.shared.items():
        if _cond(t.when, env, f"shared.{name}"):
            res.shared[name] = _spec(t, env, _render(t.key, env), "shared", dtype, tag=t.tag or name)
    res.layers = [_mtp_layer(table, env, i, dtype, lenient=False) for i in range(count)]
    for i in range(count, count + probe):
        try:
            res.probed.append(_mtp_layer(table, env, i, dtype, lenient=True))
        except _EvalFailed:
            try:
                res.probed.append(MtpLayer(i, _render(table.mtp.prefix, dict(env, i=i)), [], {}, [], []))
            except _EvalFailed:
                continue
    return res


def _mtp_layer(table: Table, env: dict, i: int, dtype: str, lenient: bool) -> MtpLayer:
    """MTP depth ``i``; ``lenient``: per-depth variables that fail to evaluate are None (an undeclared depth)."""
    lenv = dict(env, i=i)
    for name, expr in table.mtp.layer_vars.items():
        try:
            lenv[name] = _eval(expr, lenv, f"mtp.layer_vars.{name} (MTP depth {i})")
        except _EvalFailed:
            if not lenient:
                raise
            lenv[name] = None
    prefix = _render(table.mtp.prefix, lenv)
    glue: dict[str, Spec] = {}
    for role, t in table.mtp.glue.items():
        if not _cond(t.when, lenv, f"glue {role}"):
            continue
        shared_by_depths = t.key.startswith("/") and "{" not in t.key
        key = _absolute(t.key, prefix, lenv)
        glue[role] = _spec(t, lenv, key, role, dtype, depth=None if shared_by_depths else i)
    block: list[Spec] = []
    experts: list[ExpertGroup] = []
    bprefixes: list[str] = []
    for benv, bdef in _sub_blocks(table, lenv):
        b = len(bprefixes)
        bprefix = _absolute(bdef.prefix, prefix, benv) if bdef.prefix else prefix
        bprefixes.append(bprefix)
        specs, groups = part_specs(table, bdef.parts, benv, bprefix, dtype, "block", depth=i, block=b)
        block += specs
        experts += groups
    return MtpLayer(i, prefix, bprefixes, glue, block, experts)


def _sub_blocks(table: Table, lenv: dict):
    """(environment, block) for every sub-block of one MTP step, repeated blocks expanded."""
    for n, bdef in enumerate(table.mtp.blocks):
        if bdef.repeat is None:
            yield lenv, bdef
            continue
        seq = _eval(bdef.repeat, lenv, f"{table.family}: mtp.blocks[{n}].repeat")
        if not isinstance(seq, (str, list, tuple)):
            raise _EvalFailed(f"{table.family}: mtp.blocks[{n}].repeat must give a string or a list, "
                              f"got {type(seq).__name__}", str(bdef.repeat), lenv)
        if len(seq) > MAX_TRUNK_LAYERS:  # one sub-block per element: a hostile config must not loop for ever
            raise _EvalFailed(f"{table.family}: mtp.blocks[{n}].repeat gives {len(seq)} elements, more than "
                              f"{MAX_TRUNK_LAYERS}", str(bdef.repeat), lenv)
        for j, item in enumerate(seq):
            yield dict(lenv, j=j, item=item), bdef


@_config_errors
def trunk_prefixes(res: Resolved) -> list[str]:
    """The key prefix of every decoder layer of the main model, in layer order."""
    table, env = res.table, res.env
    n = _int(table.trunk.count, env, f"{table.family}: trunk.count", MAX_TRUNK_LAYERS)
    return [_render(table.trunk.prefix, dict(env, l=lidx)) for lidx in range(n)]


@_config_errors
def trunk_specs(res: Resolved) -> tuple[list[Spec], list[ExpertGroup]]:
    """Decoder layers of the main model (the fixture generator and --from-layer use these); computed once per
    resolution (not to be mutated)."""
    if res.trunk is not None:
        return res.trunk
    table, env = res.table, res.env
    specs: list[Spec] = []
    groups: list[ExpertGroup] = []
    for lidx, prefix in enumerate(trunk_prefixes(res)):
        lenv = dict(env, l=lidx)
        s, g = part_specs(table, table.trunk.parts, lenv, prefix, res.dtype, "trunk")
        specs += s
        groups += g
    res.trunk = (specs, groups)
    return res.trunk
