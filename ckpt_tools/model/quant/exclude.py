"""Exclusion entries: the configuration change that makes modules load unquantized.

``exclusion_entries(scheme, modules, fused)`` returns a ``ConfigPatch``: for every place the
scheme is declared in, each module's exact name (and the engine's fused name when the module is a
shard of a fused layer, e.g. ``...self_attn.qkv_proj`` for ``q_proj``) is appended to every
exclusion list present there, in the form that list's consumers match (a plain module name: an
exact entry for compressed-tensors / Quark / vLLM ``ignored_layers``, a glob without wildcards
for ModelOpt, a module-boundary pattern for transformers), and removed from per-module lists of
quantized layers (ModelOpt ``quantized_layers``). Entries a list already excludes are not added
again. ``patch.apply(files)`` gives the changed files; ``declared`` on them says ``excluded``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .config import CONFIG, QuantFiles, copy_files, dig
from .detect import QuantScheme
from .match import Fused, match_any


@dataclass(frozen=True)
class Change:
    file: str
    section: str  # dotted path of the section within the file
    field: str  # dotted path within the section
    add: tuple[str, ...] = ()  # entries appended to a list field
    remove: tuple[str, ...] = ()  # keys removed from a per-module mapping field, or entries from a list


@dataclass(frozen=True)
class ConfigPatch:
    changes: tuple[Change, ...] = field(default_factory=tuple)

    @property
    def files(self) -> list[str]:
        return sorted({c.file for c in self.changes})

    def apply(self, files: QuantFiles) -> dict[str, dict]:
        """Copies of the changed files with the changes applied (unchanged files are not returned)."""
        out = copy_files({name: files[name] for name in self.files})
        for c in self.changes:
            sec = _section_for_write(out[c.file], c.file, c.section)
            parent, leaf = _parent(sec, c.field)
            if c.add:
                current = parent.get(leaf)
                parent[leaf] = (list(current) if isinstance(current, list) else []) + list(c.add)
            if c.remove and isinstance(parent.get(leaf), dict):
                for k in c.remove:
                    parent[leaf].pop(k, None)
            elif c.remove and isinstance(parent.get(leaf), list):  # entries dropped from an exclusion list
                parent[leaf] = [x for x in parent[leaf] if x not in c.remove]
        return out

    def to_json(self) -> list[dict]:
        return [{"file": c.file, "section": c.section, "field": c.field, "add": list(c.add),
                 "remove": list(c.remove)} for c in self.changes]


def _section_for_write(obj: dict, file: str, dotted: str) -> dict:
    """The section object inside ``obj`` (config.json: in text_config when it lives there)."""
    if file == CONFIG and dotted:
        from ...io.config import ConfigView

        found = ConfigView(obj).find(dotted)
        if found is not None and isinstance(found[0], dict):
            return found[0]
    sec = dig(obj, dotted)
    if not isinstance(sec, dict):
        raise KeyError(f"{file}: no section {dotted!r}")
    return sec


def _parent(sec: dict, dotted: str) -> tuple[dict, str]:
    *path, leaf = dotted.split(".")
    for part in path:
        sec = sec.setdefault(part, {})
    return sec, leaf


def engine_names(modules: Iterable[str], fused: Fused | None) -> list[str]:
    """``modules`` plus the fused layers engines build from them (``q_proj`` -> ``qkv_proj``)."""
    out = list(dict.fromkeys(modules))
    for name in list(out):
        head, dot, last = name.rpartition(".")
        for fused_name, shards in (fused or {}).items():
            if last in shards:
                f = f"{head}{dot}{fused_name}"
                if f not in out:
                    out.append(f)
    return out


def subtree_entry(template: str, prefix: str) -> str:
    """One exclusion entry for every module under ``prefix`` (an ExcludeDef ``subtree`` template)."""
    prefix = prefix.rstrip(".")
    return template.replace("{re}", re.escape(prefix)).replace("{name}", prefix)


def exclusion_entries(scheme: QuantScheme, modules: Iterable[str], fused: Fused | None = None,
                      subtrees: Iterable[str] = ()) -> ConfigPatch:
    r"""The patch that makes every module of ``modules`` excluded in every place ``scheme`` is declared.

    ``subtrees``: module prefixes (e.g. MTP layer prefixes) excluded whole with one entry each where the
    list's matcher has a subtree form (compressed-tensors / Quark ``re:^prefix\..*``, ModelOpt
    ``prefix.*``, transformers ``prefix``); an entry also covers the names engines give fused layers
    and expert containers under that prefix. Lists without a subtree form (vLLM ``ignored_layers``)
    get the exact names of ``modules`` only, so pass every module there too.
    """
    names = engine_names(modules, fused)
    prefixes = [p.rstrip(".") for p in subtrees]
    changes: list[Change] = []
    for decl in scheme.declarations:
        sec = decl.section
        present = [e for e in decl.where.exclude if isinstance(dig(sec, e.field), list)]
        targets = present or [e for e in decl.where.exclude if e.create]
        for e in targets:
            patterns = [p for p in (dig(sec, e.field) or []) if isinstance(p, str)]
            add: list[str] = []
            if e.subtree is not None:
                add += [x for p in prefixes if (x := subtree_entry(e.subtree, p)) not in patterns]
            covered = patterns + add
            # a fused name is written even when its shards are excluded: SGLang matches the layer name only
            add += [n for n in names if not match_any(e.matcher, n, covered)]
            if add:
                changes.append(Change(decl.file, decl.path, e.field, add=tuple(add)))
        if decl.where.per_module:
            listed = dig(sec, decl.where.per_module) or {}
            remove = tuple(n for n in names if n in listed)
            if remove:
                changes.append(Change(decl.file, decl.path, decl.where.per_module, remove=remove))
    return ConfigPatch(tuple(changes))
