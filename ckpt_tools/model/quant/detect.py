"""Which quantization scheme a checkpoint's configuration declares (``detect_scheme``).

Every table's ``declared_in`` places are read; a place matches when its section's fields hold,
and (for per-group configs) each group is claimed by the table whose ``group_match`` it meets,
so one compressed-tensors config can mix schemes (an NVFP4 group and an FP8 group). Tables
whose configuration looks alike are told apart by ``evidence`` tensors (DeepSeek-V4's UE8M0
``.scale`` next to DeepSeek-V3's ``weight_scale_inv``). A configuration that declares
quantization that no table describes is an InputError (rule ``quant-unknown``): guessing would
mis-read every quantized tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import InputError
from .config import CONFIG, HF_QUANT, QuantFiles, dig, quant_files, section
from .tables import all_schemes

if TYPE_CHECKING:
    from .schema import ConfigDef, FormatDef, SchemeTable


@dataclass(frozen=True)
class Group:
    """One declared scheme: a config group, a per-module entry, or the whole section ("*")."""

    name: str
    table: SchemeTable
    entry: Mapping[str, Any]  # the group / module entry (the section itself for "*")
    params: Mapping[str, Any]
    targets: tuple[str, ...] | None = None  # None: every linear module


@dataclass(frozen=True)
class Declaration:
    """One place (file and section) that declares quantization, with what it declares."""

    where: ConfigDef  # of the table that claimed the section (the first when several share it)
    file: str
    path: str
    section: Mapping[str, Any]
    groups: tuple[Group, ...] = ()  # per-group schemes, or one "*" group
    modules: Mapping[str, Group] = field(default_factory=dict)  # per-module entries (ModelOpt MIXED_PRECISION)

    @property
    def label(self) -> str:
        return f"{self.file}:{self.path}" if self.path else self.file


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's configuration declares: the scheme tables involved and where they are declared."""

    declarations: tuple[Declaration, ...]
    files: Mapping[str, dict]  # the configuration files as read (file name -> object)

    @property
    def tables(self) -> list[SchemeTable]:
        seen: dict[str, SchemeTable] = {}
        for d in self.declarations:
            for g in (*d.groups, *d.modules.values()):
                seen.setdefault(g.table.scheme, g.table)
        return list(seen.values())

    @property
    def table(self) -> SchemeTable:
        """The primary scheme (the first declared)."""
        return self.tables[0]

    @property
    def name(self) -> str:
        return "+".join(t.scheme for t in self.tables)

    def formats(self) -> list[tuple[SchemeTable, FormatDef]]:
        return [(t, f) for t in self.tables for f in t.storage]

    def default_params(self, table: SchemeTable) -> dict[str, Any]:
        """Params of the first group that uses ``table`` (for modules whose group is not known)."""
        return next((dict(g.params) for d in self.declarations for g in (*d.groups, *d.modules.values())
                     if g.table.scheme == table.scheme), {})


def _norm(v: Any) -> Any:
    return v.lower() if isinstance(v, str) else v


def _holds(rules: Mapping[str, list], lookup) -> bool:
    return all(_norm(lookup(key)) in {_norm(a) for a in accepted} for key, accepted in rules.items())


def _params(where: ConfigDef, *scopes: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, p in where.params.items():
        value = p.default
        for key in p.keys:
            found = next((v for s in scopes if (v := dig(s, key)) is not None), None)
            if found is not None:
                value = found
                break
            if p.null_is_value and any(_holds_null(s, key) for s in scopes):
                value = None
                break
        out[name] = value
    return out


def _holds_null(scope: Mapping[str, Any], dotted: str) -> bool:
    """``scope`` has ``dotted`` with an explicit null."""
    parent, _, leaf = dotted.rpartition(".")
    obj = dig(scope, parent)
    return isinstance(obj, dict) and leaf in obj and obj[leaf] is None


def _claim(table: SchemeTable, where: ConfigDef, sec: Mapping[str, Any]) -> tuple[list[Group], dict[str, Group]]:
    """The groups / module entries of ``sec`` this table describes."""
    if where.groups:
        groups = []
        for gname, g in (dig(sec, where.groups) or {}).items():
            if not isinstance(g, dict):
                continue

            def lookup(key, g=g):
                v = dig(g, key)
                return dig(sec, key) if v is None else v

            if _holds(where.group_match, lookup):
                targets = dig(g, where.targets) if where.targets else None
                groups.append(Group(str(gname), table, g, _params(where, g, sec),
                                    tuple(targets) if isinstance(targets, list) else None))
        return groups, {}
    if where.per_module:
        return [], {str(mname): Group(str(mname), table, m, _params(where, m, sec))
                    for mname, m in (dig(sec, where.per_module) or {}).items()
                    if isinstance(m, dict) and _holds(where.module_match, lambda k, m=m: dig(m, k))}
    return [Group("*", table, sec, _params(where, sec))], {}


def _evidence_holds(table: SchemeTable, tensors: Mapping[str, Any]) -> bool:
    """The table's ``evidence`` tensors are present, or its block format's scale companion sits next to an FP8
    weight (a DeepSeek-V4 layout whose `.scale` tensors are F32: the companion's name is the evidence)."""
    want = [(e.suffix, set(e.dtypes)) for e in table.evidence]
    suffixes = tuple(suffix for suffix, _ in want)
    # names first (one C call per key), dtypes only of the names that match
    if suffixes and any(k.endswith(suffix) and tensors[k].dtype in dtypes
                        for k in tensors if k.endswith(suffixes) for suffix, dtypes in want):
        return True
    from ..expert_layouts import scale_key
    from .block import block_tile

    defaults = {name: p.default for d in table.declared_in for name, p in d.params.items()}
    for fmt in table.storage:
        if block_tile(fmt, defaults) is None:
            continue
        suffix, scale_dtypes = fmt.tensors[0].suffix, set(fmt.tensors[0].dtypes)
        # the scales present, then their weights (a release holds ~46,000 weights and no or all scales)
        for s_key in (k for k in tensors if k.endswith(suffix) and tensors[k].dtype in scale_dtypes):
            w_key = _weight_of(s_key, suffix)
            ref = tensors.get(w_key) if w_key is not None else None
            if ref is not None and ref.dtype in fmt.weight.dtypes and scale_key(w_key, suffix) == s_key:
                return True
    return False


def _weight_of(scale: str, suffix: str) -> str | None:
    """The weight key whose ``scale_key(weight, suffix)`` may be ``scale`` (verified by the caller)."""
    if scale.endswith("." + suffix):
        return scale[: -len(suffix)] + "weight"
    tail = "_" + suffix.removeprefix("weight_")
    return scale[: -len(tail)] if scale.endswith(tail) else None


def _declared_sections(files: QuantFiles) -> list[str]:
    """Where the configuration declares some quantization at all (for the unknown-scheme error)."""
    out = []
    if section(files, CONFIG, "quantization_config") is not None:
        out.append(f"{CONFIG}:quantization_config")
    if HF_QUANT in files:
        out.append(HF_QUANT)
    return out


def _describe(files: QuantFiles) -> str:
    sec = section(files, CONFIG, "quantization_config") or {}
    hq = dig(files.get(HF_QUANT) or {}, "quantization") or {}
    bits = [f"{k} {v!r}" for k, v in (("quant_method", sec.get("quant_method")), ("format", sec.get("format")),
                                      ("quant_algo", sec.get("quant_algo") or hq.get("quant_algo")))
            if v is not None]
    return ", ".join(bits) or "an unrecognised quantization section"


def detect_in(files: QuantFiles, tensors: Mapping[str, Any] | None = None) -> QuantScheme | None:
    """``detect_scheme`` over configuration files already read (``tensors``: for evidence)."""
    tables = all_schemes()
    places: dict[tuple[str, str], list[tuple[SchemeTable, ConfigDef, Mapping]]] = {}
    for table in tables.values():
        for where in table.declared_in:
            sec = section(files, where.file, where.section)
            if sec is not None and _holds(where.match, lambda k, sec=sec: dig(sec, k)):
                places.setdefault((where.file, where.section), []).append((table, where, sec))
    declarations = []
    for (file, path), claims in places.items():
        with_evidence = [c for c in claims if c[0].evidence]
        if with_evidence and tensors is not None:
            proven = [c for c in with_evidence if _evidence_holds(c[0], tensors)]
            claims = proven or [c for c in claims if not c[0].evidence]
        elif with_evidence:
            claims = [c for c in claims if not c[0].evidence] or claims
        groups: list[Group] = []
        modules: dict[str, Group] = {}
        for table, where, sec in claims:
            g, m = _claim(table, where, sec)
            groups += [x for x in g if x.name not in {y.name for y in groups}]
            for k, v in m.items():
                modules.setdefault(k, v)
        sec = claims[0][2]
        where = claims[0][1]
        if where.groups:
            unclaimed = [k for k, v in (dig(sec, where.groups) or {}).items()
                         if isinstance(v, dict) and k not in {g.name for g in groups}]
            if unclaimed:
                g = dig(sec, where.groups)[unclaimed[0]]
                fmt = g.get("format") or sec.get("format")
                raise InputError(f"{file}:{path} group {unclaimed[0]!r} (format {fmt!r}, weights "
                                 f"{_short(g.get('weights'))}) is a quantization scheme no table in "
                                 "mappings/quantization describes", rule="quant-unknown")
        if where.per_module:
            unclaimed = [k for k, v in (dig(sec, where.per_module) or {}).items() if k not in modules]
            if unclaimed:
                entry = dig(sec, where.per_module)[unclaimed[0]]
                raise InputError(f"{file}:{path} {where.per_module}[{unclaimed[0]!r}] declares {_short(entry)}, "
                                 "a quantization scheme no table in mappings/quantization describes",
                                 rule="quant-unknown")
        if groups or modules or where.per_module:
            declarations.append(Declaration(where, file, path, sec, tuple(groups), modules))
    if not declarations:
        declared = _declared_sections(files)
        if declared:
            known = ", ".join(sorted(tables))
            raise InputError(f"{' and '.join(declared)} declare {_describe(files)}, which no quantization scheme "
                             f"table describes (known: {known}); add one under mappings/quantization, or from outside "
                             "the package with CKPT_QUANT_TABLES or register_scheme_dir (docs/quantization.md)",
                             rule="quant-unknown")
        return None
    return QuantScheme(tuple(declarations), dict(files))


def _short(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def detect_scheme(ckpt: Any) -> QuantScheme | None:
    """The quantization scheme ``ckpt``'s configuration declares, or None when it declares none.

    Reads config.json ``quantization_config`` (``text_config`` first) and ``hf_quant_config.json``.
    InputError (rule ``quant-unknown``) when quantization is declared but no table describes it.

    Asked by several rules of one gate (the evidence scans every key of a release), so the answer is kept on
    ``ckpt`` while its tensors and configuration and the tables in force stay the same objects.
    """
    from .tables import loaded_schemes

    at = (id(loaded_schemes()), id(ckpt.tensors), len(ckpt.tensors), id(ckpt.config), id(ckpt.config.raw))
    memo = getattr(ckpt, "_detected_scheme", None)
    if memo is None or memo[0] != at:
        try:
            memo = (at, detect_in(quant_files(ckpt), ckpt.tensors), None)
        except InputError as e:
            memo = (at, None, e)
        with contextlib.suppress(AttributeError):  # a checkpoint-like object that keeps no attributes: asked again
            ckpt._detected_scheme = memo
    if memo[2] is not None:
        raise memo[2]
    return memo[1]
