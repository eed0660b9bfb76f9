"""Repairing a quantization configuration so it declares every MTP module as stored.

``repair(rows, scheme, table, files, modules)`` turns the ``audit`` findings a configuration change can
fix into changes of the files the scheme is declared in: a module stored unquantized (and the fused
layers it is a shard of) gets exact exclusion entries in every exclusion list, in the form each list's
consumers match, and leaves per-module lists of quantized layers; a module stored quantized but
excluded loses its exact entry, or the pattern excluding it is replaced by exact entries for the
other modules it excluded. Findings only the weights can fix are returned as ``unfixable``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .audit import Audit, Finding, Row, StoredOf, audit, judge, module_rows, scheme_of, trunk_rows
from .config import QuantFiles, dig, quant_files
from .detect import QuantScheme, detect_in
from .exclude import Change, ConfigPatch, exclusion_entries
from .match import match_one

if TYPE_CHECKING:
    from ..mtp import MtpView
    from ..tables.schema import Table

MAX_ROUNDS = 4  # an entry dropped may uncover another that excludes the same module


@dataclass
class Repair:
    files: dict[str, dict] = field(default_factory=dict)  # the changed configuration files, repaired
    changes: list[Change] = field(default_factory=list)
    fixed: list[Finding] = field(default_factory=list)  # what the changes repair
    unfixable: list[Finding] = field(default_factory=list)
    after: Audit | None = None  # the audit of the repaired configuration

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def to_json(self) -> dict:
        return {"files": sorted(self.files), "changes": ConfigPatch(tuple(self.changes)).to_json(),
                "fixed": [{"key": f.key, "message": f.message} for f in self.fixed],
                "unfixable": [{"key": f.key, "message": f.message} for f in self.unfixable]}


def linear_modules(tensors: Mapping[str, Any]) -> set[str]:
    """Modules holding a matrix (a Linear, a router, an embedding): what an exclusion entry can name."""
    return {k.rpartition(".")[0] for k, ref in tensors.items() if len(ref.shape) >= 2 and "." in k}


def _unexclude(scheme: QuantScheme, names: list[str], modules: set[str]) -> tuple[list[Change], list[str]]:
    """Changes that stop excluding ``names``; the names a per-module list would have to name (unfixable)."""
    wanted = set(names)
    changes: list[Change] = []
    stuck: list[str] = []
    for decl in scheme.declarations:
        for e in decl.where.exclude:
            patterns = [p for p in (dig(decl.section, e.field) or []) if isinstance(p, str)]
            drop = [p for p in patterns if any(match_one(e.matcher, n, p) for n in names)]
            if not drop:
                continue
            # what else the dropped entries excluded stays excluded, by name
            others = sorted(m for m in modules - wanted if any(match_one(e.matcher, m, p) for p in drop)
                            and not any(match_one(e.matcher, m, p) for p in patterns if p not in drop))
            changes.append(Change(decl.file, decl.path, e.field, add=tuple(others), remove=tuple(drop)))
        if decl.where.per_module:
            listed = dig(decl.section, decl.where.per_module) or {}
            stuck += [n for n in names if n not in listed]
    return changes, stuck


def repair(rows: list[Row], scheme: QuantScheme | None, table: Table, files: QuantFiles,
           modules: Iterable[str], tensors: Mapping[str, Any] | None = None) -> Repair:
    """The configuration changes that make ``rows`` (the MTP modules as stored, ``audit.Row``) declared
    as stored. ``files``: the configuration files as they are; ``modules``: every module of the
    checkpoint an exclusion entry could name (``linear_modules``); ``tensors``: for scheme detection."""
    out = Repair()
    if scheme is None:
        out.unfixable = [f for f in judge(rows, None, table).findings]
        return out
    current = dict(files)
    modules = set(modules) | {m for m, *_ in rows}
    first = result = judge(rows, scheme, table, current)
    for _ in range(MAX_ROUNDS):
        todo = [f for f in result.findings if f.fix is not None]
        if not todo:
            break
        now = detect_in(current, tensors) or scheme  # as the files declare it now (entries added before)
        exclude = list(dict.fromkeys(n for f in todo if f.fix == "exclude" for n in f.names))
        include = list(dict.fromkeys(n for f in todo if f.fix == "include" for n in f.names))
        changes = list(exclusion_entries(now, exclude).changes) if exclude else []
        stuck: list[str] = []
        if include:
            more, stuck = _unexclude(now, include, modules)
            changes += more
        if not changes:
            break
        out.changes += changes
        current.update(ConfigPatch(tuple(changes)).apply(current))
        result = judge(rows, scheme, table, current)
        if stuck:
            break
    out.after = result
    left = {f.key for f in result.findings}
    out.fixed = [f for f in first.findings if f.key not in left]
    out.unfixable = list(result.findings)
    out.files = {name: current[name] for name in ConfigPatch(tuple(out.changes)).files}
    return out


def repair_view(view: MtpView) -> Repair:
    """``repair`` for the MTP and the trunk of an opened checkpoint, as they are stored."""
    ckpt = view.ckpt
    scheme = scheme_of(view)
    if scheme is None:
        return Repair(unfixable=list(audit(view).findings))
    rows = module_rows(view, scheme) + trunk_rows(view, scheme)
    return repair(rows, scheme, view.table, quant_files(ckpt), linear_modules(ckpt.tensors), ckpt.tensors)


def repair_written(view: MtpView, files: QuantFiles, tensors: Mapping[str, Any], modules: Iterable[str],
                   stored_of: StoredOf | None = None, changed_only: bool = False) -> Repair:
    """``repair`` for the MTP a verb is about to write: ``view``'s modules stored as ``stored_of`` says
    (None: as ``view``'s checkpoint stores them), judged against ``files`` (the output's configuration
    before repair) of a checkpoint holding ``tensors``. ``changed_only``: judge only the modules whose
    storage the verb changes (the others stay as the input declares them)."""
    scheme = detect_in(files, tensors)
    rows = module_rows(view, scheme, stored_of)
    if changed_only:
        now = {m: st.state for m, st, *_ in module_rows(view, scheme)}
        rows = [r for r in rows if now.get(r[0]) != r[1].state]
    return repair(rows, scheme, view.table, files, modules, tensors) if rows else Repair()
