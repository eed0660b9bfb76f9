"""The per-module audit as inspect, validate and `validate --fix-quant-config` show it.

``audit_json(result, files)`` turns an ``audit.Audit`` into plain JSON: per MTP module how it is
stored (``unquantized`` BF16, ``quantized`` as which table and format) versus what the
configuration declares (quantized by which group, excluded by which entry), and what disagrees.
``config_diff(before, after)`` lists the entries a configuration repair adds and removes, per file
and field, from the files themselves (so it shows what lands on disk, whatever the rounds did).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .audit import Audit, ModuleAudit
from .config import QuantFiles, dig
from .detect import QuantScheme
from .match import match_one

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def deciding_entry(scheme: QuantScheme | None, module: str) -> dict | None:
    """The first exclusion entry that names ``module``: ``{where: "file:field", pattern, exact}``; None when
    no list excludes it by an entry (not targeted, or absent from a per-module list)."""
    if scheme is None:
        return None
    for decl in scheme.declarations:
        for e in decl.where.exclude:
            patterns = dig(decl.section, e.field)
            for p in patterns if isinstance(patterns, list) else ():
                if isinstance(p, str) and match_one(e.matcher, module, p):
                    return {"where": f"{decl.file}:{e.field}", "pattern": p, "exact": p == module}
    return None


def module_json(m: ModuleAudit, scheme: QuantScheme | None) -> dict:
    d = m.declared
    declared: dict[str, Any] = {"state": d.state, "reason": d.reason}
    if d.group is not None:
        declared.update(group=d.group.name, scheme=d.group.table.scheme)
    if d.state == "excluded":
        declared["entry"] = deciding_entry(scheme, m.module)
    st = m.stored
    return {
        "module": m.module,
        "stored": {"state": st.state, "label": st.label, "scheme": st.scheme, "dtype": st.dtype},
        "declared": declared,
        "expert": m.expert,
        "exempt": m.exempt,
        "fused": list(m.fused),
        "ok": m.ok,
        "problem": m.problem,
    }


def audit_json(result: Audit) -> dict:
    """``{scheme, schemes, ok, unknown, modules, findings}`` of an audit."""
    scheme = result.scheme
    return {
        "scheme": scheme.name if scheme is not None else None,
        "schemes": [{"scheme": t.scheme, "title": t.title} for t in scheme.tables] if scheme is not None else [],
        "declared_in": [d.label for d in scheme.declarations] if scheme is not None else [],
        "ok": result.ok,
        "unknown": result.unknown,
        "modules": [module_json(m, scheme) for m in result.modules],
        "findings": [{"key": f.key, "message": f.message, "fix": f.fix, "names": list(f.names)}
                     for f in result.findings],
    }


def collapsed(modules: list[dict]) -> list[tuple[str, dict, int]]:
    """Rows for a human table: routed experts that agree (stored, declared, problem) become one row
    ``...experts.*.up_proj`` with their count; every other module stays its own row."""
    out: list[tuple[str, dict, int]] = []
    seen: dict[tuple, int] = {}
    for m in modules:
        name = m["module"]
        if m["expert"] and _EXPERT.search(name):
            pattern = _EXPERT.sub(".experts.*.", name, count=1)
            entry = m["declared"].get("entry") or {}
            how = entry.get("where"), entry.get("exact") or _EXPERT.sub(".experts.*.", entry.get("pattern") or "")
            key = (pattern, m["stored"]["label"], m["declared"]["state"], how, m["problem"])
            if key in seen:
                i = seen[key]
                out[i] = (out[i][0], out[i][1], out[i][2] + 1)
                continue
            seen[key] = len(out)
            out.append((pattern, m, 1))
            continue
        out.append((name, m, 1))
    return [(name if n > 1 else m["module"], m, n) for name, m, n in out]


def declared_text(declared: Mapping[str, Any]) -> str:
    """``quantized by group_0 (ct-fp8)`` / ``excluded by name (config.json:ignore)`` / ``excluded by
    config.json:ignore 're:mtp.*'`` / the state and its reason."""
    state, entry = declared["state"], declared.get("entry")
    if state == "quantized" and declared.get("group"):
        group = declared["group"]  # "*": the whole section declares one scheme
        return f"quantized ({declared['scheme']})" if group == "*" else f"quantized by {group} ({declared['scheme']})"
    if state == "excluded" and entry:
        return f"excluded by name ({entry['where']})" if entry["exact"] else \
            f"excluded by {entry['where']} {entry['pattern']!r}"
    return f"{state} ({declared['reason']})"


def config_diff(before: QuantFiles, after: Mapping[str, dict]) -> list[dict]:
    """``[{file, field, added, removed}]`` for every list or mapping that differs between ``before`` and
    ``after`` (files in ``after`` only; a mapping's keys are its entries, e.g. ``quantized_layers``)."""
    out: list[dict] = []
    for name in sorted(after):
        _diff(name, "", before.get(name) or {}, after[name], out)
    return out


def _diff(file: str, path: str, a: Any, b: Any, out: list[dict]) -> None:
    if a == b:
        return
    here = {"file": file, "field": path}
    if isinstance(a, dict) and isinstance(b, dict):
        keys_added, keys_removed = [], []
        for k in dict.fromkeys([*a, *b]):
            sub = f"{path}.{k}" if path else k
            if k in a and k in b:
                _diff(file, sub, a[k], b[k], out)
            elif isinstance(a.get(k, b.get(k)), list):  # a list created or dropped: its entries
                _diff(file, sub, a.get(k), b.get(k), out)
            else:  # a mapping's keys are its entries (ModelOpt quantized_layers)
                (keys_added if k in b else keys_removed).append(k)
        if keys_added or keys_removed:
            out.append({**here, "added": keys_added, "removed": keys_removed})
    elif isinstance(a, list | None) and isinstance(b, list | None):
        la, lb = a or [], b or []
        out.append({**here, "added": [x for x in lb if x not in la], "removed": [x for x in la if x not in lb]})
    else:
        out.append({**here, "added": [], "removed": [], "before": a, "after": b})
