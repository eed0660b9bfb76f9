"""What a quantization configuration declares for one module, read as its consumers read it.

``declared(scheme, config, module, fused)`` is ``"quantized"``, ``"excluded"`` (not quantized:
excluded by name, or not targeted at all) or ``"conflict"`` (the places that declare the scheme,
or the shards of a fused layer, disagree: an engine refuses to load or picks one silently).
``declaration`` returns the same with the group that quantizes the module and the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .config import QuantFiles, dig, section
from .detect import Declaration, Group, QuantScheme
from .match import Fused, excluded, first_listed, match_any, match_one, ranked, shards_of

State = Literal["quantized", "excluded", "conflict"]


@dataclass(frozen=True)
class Declared:
    state: State
    group: Group | None  # the group (or per-module entry) that quantizes the module
    reason: str  # one line: which place, entry or pattern decided
    # another group declaring another scheme that vLLM picks for this module (its first target in config order)
    # where compressed-tensors picks ``group`` (its ranking): the two consumers read the module differently
    other: Group | None = None
    target: str | None = None  # the target that picked ``group`` (when ``other`` is set)


def _exclusions(decl: Declaration, sec: Mapping) -> list[tuple[str, list[str]]]:
    """(matcher, patterns) of each exclude field present in the section."""
    out = []
    for e in decl.where.exclude:
        value = dig(sec, e.field)
        if isinstance(value, list):
            out.append((e.matcher, [p for p in value if isinstance(p, str)]))
    return out


def _one(decl: Declaration, sec: Mapping, module: str, fused: Fused | None, kind: str) -> Declared:
    """What one place declares for ``module``."""
    where = decl.label
    for matcher, patterns in _exclusions(decl, sec):
        state = excluded(matcher, module, patterns, fused)
        if state is None:
            return Declared("conflict", None, f"{where}: the shards {shards_of(module, fused)} of {module} are "
                                              f"not all excluded by {matcher} patterns")
        if state:
            return Declared("excluded", None, f"{where}: excluded by its {matcher} exclusion list")
    if decl.where.per_module:
        entries = dig(sec, decl.where.per_module) or {}
        if module in entries:
            group = decl.modules.get(module)
            return Declared("quantized", group, f"{where}: {decl.where.per_module} lists it")
        shards = shards_of(module, fused)
        if shards:
            listed = {s in entries for s in shards}
            if listed == {True}:
                return Declared("quantized", decl.modules.get(shards[0]),
                                f"{where}: {decl.where.per_module} lists every shard")
            if len(listed) > 1:
                return Declared("conflict", None, f"{where}: {decl.where.per_module} lists some of the shards "
                                                  f"{shards} of {module}")
        return Declared("excluded", None, f"{where}: not in {decl.where.per_module}")
    by_target = _target_groups(decl, sec)
    target, conflict = _pick(module, by_target, fused, kind)
    if conflict is not None:
        return Declared("conflict", None, f"{where}: {conflict}")
    hit = by_target[target] if target is not None else next((g for g in decl.groups if g.targets is None), None)
    if hit is None:
        return Declared("excluded", None, f"{where}: no group targets it")
    other = None
    names = [t for t in ranked(module, by_target, kind) if t != kind] if target is not None else []
    if len(names) > 1 and not shards_of(module, fused):
        # vLLM takes the first name or regex target in config order (match.first_listed): another group only where
        # two of them name the module
        theirs = by_target[first_listed(module, by_target, kind) or target]
        if theirs is not hit and _meaning(theirs) != _meaning(hit):
            other = theirs
    return Declared("quantized", hit, f"{where}: group {hit.name} targets it" + (f" ({target})" if other else ""),
                    other, target)


_TARGETS: list[tuple[Declaration, Mapping, dict[str, Group]]] = []  # the last few maps (asked once per module)


def _target_groups(decl: Declaration, sec: Mapping) -> dict[str, Group]:
    """target -> group, in config order; a target a later group lists again is that group's, in its first place
    (both consumers build this map: compressed-tensors' ``target_to_scheme``, vLLM's ``target_scheme_map``)."""
    for d, s, out in _TARGETS:
        if d is decl and s is sec:
            return out
    out = _build_target_groups(decl, sec)
    _TARGETS[:] = [(decl, sec, out), *_TARGETS[:7]]
    return out


def _build_target_groups(decl: Declaration, sec: Mapping) -> dict[str, Group]:
    order = list(dig(sec, decl.where.groups) or {}) if decl.where.groups else []
    groups = sorted(decl.groups, key=lambda g: order.index(g.name) if g.name in order else len(order))
    return {t: g for g in groups for t in g.targets or () if isinstance(t, str)}


def _pick(module: str, by_target: Mapping[str, Group], fused: Fused | None, kind: str
          ) -> tuple[str | None, str | None]:
    """(the target that decides ``module``'s group, in compressed-tensors' order (``match.ranked``), or None;
    a conflict). A fused layer no target names is decided by its shards, which must agree (vLLM
    ``_match_fused_layer``)."""
    names = [t for t in ranked(module, by_target, kind) if t != kind]
    if names:
        return names[0], None
    shards = shards_of(module, fused)
    if shards:
        picks = [next((t for t in ranked(s, by_target, kind) if t != kind), None) for s in shards]
        if any(picks):
            groups = {by_target[t].name if t else None for t in picks}
            if len(groups) > 1:
                return None, (f"the shards {shards} of {module} are not all targeted by one group "
                              f"({', '.join(sorted(str(g) for g in groups))})")
            return picks[0], None
    return (kind if kind in by_target else None), None


def _meaning(g: Group) -> tuple:
    """What a group declares for loading, its targets aside (two groups alike in this read a module alike): its
    table, the params the table reads and its activation schemes; calibration settings (observers) aside."""
    return g.table.scheme, repr(sorted(g.params.items())), _loaded(g.entry.get("input_activations")), \
        _loaded(g.entry.get("output_activations"))


def _loaded(args: object) -> str:
    """A QuantizationArgs entry without what only calibration reads."""
    if not isinstance(args, Mapping):
        return repr(args)
    return repr(sorted((k, repr(v)) for k, v in args.items() if k not in ("observer", "observer_kwargs")))


Sections = list[tuple[Declaration, Mapping | None]]


def sections_of(scheme: QuantScheme, config: QuantFiles | None = None) -> Sections:
    """Each place ``scheme`` is declared in with its section in ``config`` (None: the files it was detected in; a
    section removed since: None). Read once for many ``declaration`` calls over the same files."""
    files = scheme.files if config is None else config
    return [(decl, section(files, decl.file, decl.path)) for decl in scheme.declarations]


def declaration(scheme: QuantScheme, config: QuantFiles | None, module: str, fused: Fused | None = None,
                kind: str = "Linear", sections: Sections | None = None) -> Declared:
    """What ``scheme`` declares for ``module`` (a checkpoint or engine module name, no ``.weight``).

    ``config``: the configuration files to read (file name -> JSON object), e.g. a repaired copy;
    None reads the files the scheme was detected in. ``fused``: the engine's fused layers
    (fused suffix -> shard suffixes), so a fused name is judged by its shards. ``kind``: the
    module's class for class-name targets (``Linear``). ``sections``: ``sections_of(scheme, config)``, when the
    caller asks for many modules of the same files.
    """
    results = []
    for decl, sec in sections if sections is not None else sections_of(scheme, config):
        if sec is None:  # the place was removed: it declares nothing any more
            continue
        results.append(_one(decl, sec, module, fused, kind))
    if not results:
        return Declared("excluded", None, "no quantization section declares it")
    states = {r.state for r in results}
    if len(states) > 1:
        detail = "; ".join(r.reason for r in results)
        return Declared("conflict", None, f"the configuration files disagree: {detail}")
    return results[0]


def declared(scheme: QuantScheme, config: QuantFiles | None, module: str, fused: Fused | None = None,
             kind: str = "Linear") -> State:
    """``"quantized"``, ``"excluded"`` or ``"conflict"``: see ``declaration``."""
    return declaration(scheme, config, module, fused, kind).state


class Declarer:
    """``declaration(scheme, config, module, sections=...)`` for many modules of the same files (no fused names),
    made once per combination of the answers its patterns give.

    What a place declares for a module depends on the module's name only through which exclusion lists name it,
    whether a per-module list holds it and which groups target it; the answer (state, group, reason) names no
    module. So each module costs one match per list (``match_any``: one combined matcher per list), and a
    configuration without lists (most releases) is judged once for all 46,000 modules of a release.
    """

    def __init__(self, scheme: QuantScheme, config: QuantFiles | None = None, kind: str = "Linear") -> None:
        self.scheme, self.config, self.kind = scheme, config, kind
        self.sections = sections_of(scheme, config)
        tests: list = []
        for decl, sec in self.sections:
            if sec is None:
                continue
            for matcher, patterns in _exclusions(decl, sec):
                if patterns:
                    tests.append(lambda m, a=matcher, p=tuple(patterns): match_any(a, m, p))
            if decl.where.per_module:
                entries = dig(sec, decl.where.per_module) or {}
                # a listed module's group is its own entry: listed modules are told apart by name
                tests.append(lambda m, e=entries: m if m in e else None)
                continue
            # which group decides depends on which targets match (match.ranked): the exact name listed, if any, and
            # each regex (a config lists few; it may list hundreds of exact names)
            names = dict.fromkeys(t for g in decl.groups for t in g.targets or () if isinstance(t, str) and t != kind)
            exact = frozenset(t for t in names if "re:" not in t)
            if exact:
                tests.append(lambda m, e=exact: m if m in e else None)
            tests += [lambda m, t=t: match_one("compressed-tensors", m, t) for t in names if "re:" in t]
        self._tests = tests
        self._cache: dict[tuple, Declared] = {}

    @property
    def constant(self) -> bool:
        """Every module gets the same answer (no list of the configuration names modules)."""
        return not self._tests

    def __call__(self, module: str) -> Declared:
        sig = tuple([t(module) for t in self._tests]) if self._tests else ()
        got = self._cache.get(sig)
        if got is None:
            got = self._cache[sig] = declaration(self.scheme, self.config, module, None, self.kind, self.sections)
        return got
