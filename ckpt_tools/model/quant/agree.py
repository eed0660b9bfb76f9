"""Two places that declare one checkpoint's quantization say the same (rule ``quant-config-agree``).

ModelOpt writes its scheme twice: config.json ``quantization_config`` (read by vLLM, SGLang and transformers
whenever present) and ``hf_quant_config.json`` (read by older consumers, and by vLLM only when config.json has no
quantization section). When both are present, each is read by someone, so they must agree on what both state:
the scheme (e.g. ``quant_algo`` FP8 in one and NVFP4 in the other), every parameter the scheme tables read from
both (``quant_algo``, ``group_size``), the exclusion lists (as sets of entries), the per-module schemes of a
MIXED_PRECISION export and the KV-cache quantization (``kv_cache_quant_algo`` ``"FP8"`` is ModelOpt's
``kv_cache_scheme`` ``{type: float, num_bits: 8}``; absent and null both mean none). Which places exist and
which fields they hold come from the scheme tables' ``declared_in`` (mappings/quantization).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import InputError
from ..problem import Problem
from .config import dig, section
from .detect import Declaration, detect_scheme
from .tables import all_schemes

RULE = "quant-config-agree"
DESCRIPTION = ("the two places declaring the quantization (config.json quantization_config and "
               "hf_quant_config.json) disagree on the scheme, a parameter, the exclusions or the KV-cache scheme")


def _norm(v: Any) -> Any:
    """A value as the consumers compare it: strings upper-cased (vLLM upper-cases quant_algo), lists as sets."""
    if isinstance(v, str):
        return v.upper()
    if isinstance(v, list):
        return frozenset(_norm(x) if not isinstance(x, (list, dict)) else repr(x) for x in v)
    return v


def _kv(v: Any) -> Any:
    """A KV-cache declaration: ``"FP8"`` and ``{type: float, num_bits: 8}`` alike; absent, null and ``{}`` are none."""
    if v is None or v == {}:
        return None
    if isinstance(v, dict) and v.get("type") in ("float", "int") and isinstance(v.get("num_bits"), int):
        return f"{'FP' if v['type'] == 'float' else 'INT'}{v['num_bits']}"
    return _norm(v) if not isinstance(v, dict) else repr(sorted(v.items()))


def _shown(v: Any) -> str:
    import json

    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _facts(where: Any, sec: Mapping[str, Any], decl: Declaration | None, keys: list[str]
           ) -> dict[str, tuple[str, Any, Any]]:
    """fact -> (the field that states it, its value as consumers compare it, its raw value), for what this place
    states (a field it lacks states nothing, except the KV-cache field: absent means no KV-cache quantization).
    ``keys``: the fields any table matches this place by (``quant_method``, ``quant_algo``). A place no table
    claims states only its scheme: the other facts would be read by a table that does not describe it."""
    tables = tuple(sorted({g.table.scheme for g in (*decl.groups, *decl.modules.values())})) if decl else None
    out: dict[str, tuple[str, Any, Any]] = {"scheme": ("", tables, {k: sec[k] for k in keys if k in sec})}
    if decl is None:
        return out
    for name, p in where.params.items():
        key = next((k for k in p.keys if dig(sec, k) is not None), None)
        if key is not None:
            out[f"param {name}"] = (key, _norm(dig(sec, key)), dig(sec, key))
    for e in where.exclude:
        v = dig(sec, e.field)
        if isinstance(v, list):
            out["exclusions"] = (e.field, _norm(v), v)
    if where.per_module and isinstance(dig(sec, where.per_module), dict):
        entries = dig(sec, where.per_module)
        modules = {m: decl.modules[m].table.scheme if m in decl.modules else _shown(e) for m, e in entries.items()}
        out["modules"] = (where.per_module, tuple(sorted(modules.items())), f"{len(entries)} module entries")
    if where.kv_cache:
        v = dig(sec, where.kv_cache)
        out["kv_cache"] = (where.kv_cache, _kv(v), v)
    return out


def agree_problems(ckpt: Any) -> list[Problem]:
    """``quant-config-agree`` for ``ckpt``: every pair of places that both declare its quantization."""
    try:
        scheme = detect_scheme(ckpt)
    except InputError:  # unreadable side file or an unknown scheme: reported by their own rules
        return []
    if scheme is None:
        return []
    files = scheme.files
    declared = {(d.file, d.path): d for d in scheme.declarations}
    places: dict[tuple[str, str], tuple[Any, Mapping[str, Any]]] = {}
    match_keys: dict[tuple[str, str], list[str]] = {}
    for table in all_schemes().values():
        for where in table.declared_in:
            at = (where.file, where.section)
            sec = section(files, where.file, where.section)
            if sec is None:
                continue
            match_keys.setdefault(at, [])
            match_keys[at] += [k for k in where.match if k not in match_keys[at]]
            decl = declared.get(at)
            if decl is not None:
                places.setdefault(at, (decl.where, sec))  # the definition that claimed the place
            elif at not in places and any(k in sec for k in where.match):
                places[at] = (where, sec)  # present, claimed by no table: its scheme still says something
    if len(places) < 2:
        return []
    items = list(places.items())
    (first_at, (first_where, first_sec)) = items[0]
    first = _facts(first_where, first_sec, declared.get(first_at), match_keys[first_at])
    out = []
    for at, (where, sec) in items[1:]:
        other = _facts(where, sec, declared.get(at), match_keys[at])
        for fact in (f for f in first if f in other):
            (k1, v1, raw1), (k2, v2, raw2) = first[fact], other[fact]
            if v1 == v2:
                continue
            if fact == "scheme":  # the declaring fields that differ (quant_algo), each with the table it selects
                keys = [k for k in raw1 if k in raw2 and raw1[k] != raw2[k]] or list({**raw1, **raw2})
                a = ", ".join(f"{first_at[0]} {first_at[1]}.{k} = {_shown(raw1.get(k))}" for k in keys)
                b = ", ".join(f"{at[0]} {at[1]}.{k} = {_shown(raw2.get(k))}" for k in keys)
                a += f" ({' + '.join(v1) if v1 else 'no scheme table'})"
                b += f" ({' + '.join(v2) if v2 else 'no scheme table'})"
            else:
                a = f"{first_at[0]} {first_at[1]}.{k1} = {_shown(raw1)}"
                b = f"{at[0]} {at[1]}.{k2} = {_shown(raw2)}"
            out.append(Problem(RULE, f"{ckpt.root}/{at[0]}", None,
                               f"{a} but {b}: the two files disagree on {fact.removeprefix('param ')}, and "
                               "consumers read one or the other (vLLM config.json's when present); make them say "
                               "the same"))
    return out
