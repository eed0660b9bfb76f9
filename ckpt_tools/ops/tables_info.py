"""`ckpt tables`: the known families, what they match, and the formats each can be extracted to."""

from __future__ import annotations

from ..errors import CkptError
from ..io.checkpoint import Checkpoint
from ..io.config import ConfigView
from ..model.formats import all_formats, check_expressible
from ..model.mtp import MtpView
from ..model.tables.loader import all_tables
from ..model.tables.resolve import resolve


def _virtual(table) -> MtpView | None:
    """An MTP view of the table's fixture config, as if every MTP tensor were present."""
    if not table.fixture:
        return None
    cfg = ConfigView(dict(table.fixture))
    ckpt = Checkpoint(table.family, cfg, {}, {}, None, [])
    res = resolve(table, cfg, mtp_count=max(1, _count(table, cfg)))
    view = MtpView(ckpt, res, {g.prefix: g.layout for g in res.experts()})
    view.present = res.mtp_specs()
    return view


def _count(table, cfg: ConfigView) -> int:
    try:
        return resolve(table, cfg).mtp_count
    except CkptError:
        return 1


def _probe_support(table) -> dict:
    """``probe``: whether our engine builds the family's MTP; ``probe_reference``: whether transformers' MtpModel
    does too (probe then checks the engine against it); ``probe_reason``: why not. ``probe_engines``: per serving
    engine, the class that would run the family's MTP (transformers: our table engine; vLLM: the table's class)."""
    from .probe_families import family_support  # imports transformers (and torch): only for --probe

    s = family_support(table)
    engines = {"transformers": "ckpt table engine" + (" + MtpModel" if s.reference else "") if s.engine else None,
               "vllm": f"{table.vllm.cls} ({table.vllm.check})" if table.vllm is not None else None}
    return {"probe": s.engine, "probe_reference": s.reference, **({"probe_reason": s.reason} if s.reason else {}),
            "probe_engines": engines}


def _vllm(table) -> dict | None:
    """vLLM's draft for the family, from the table's ``vllm`` section: its class and how far it was checked."""
    v = table.vllm
    if v is None:
        return None
    return {"architecture": v.architecture, "class": v.cls, "check": v.check,
            **({"depths": v.depths} if v.depths is not None else {}), **({"note": v.note} if v.note else {})}


def tables_info(probe: bool = False, family: str | None = None) -> list[dict]:
    """``probe``: also say whether `ckpt probe` supports each family (asks transformers: ~2.5 s, ~280 MB).
    ``family``: that family only (a UsageError naming the known ones when no table has that name)."""
    tables = all_tables()
    if family is not None and family not in tables:
        from ..errors import UsageError

        raise UsageError(f"unknown family {family!r}; known: {', '.join(sorted(tables))}", rule="unknown-family")
    rows = []
    for name, table in sorted(tables.items()):
        if family is not None and name != family:
            continue
        view = _virtual(table)
        formats = {}
        for fname, fmt in sorted(all_formats().items()):
            if view is None:
                formats[fname] = "no fixture config to check against"
                continue
            try:
                check_expressible(fmt, view, [0])
                formats[fname] = "ok"
            except CkptError as e:
                formats[fname] = str(e).split(": ", 1)[-1]
        rows.append({
            "family": name,
            "title": table.title,
            "kind": table.kind,
            "architectures": table.detect.architectures,
            "model_types": table.detect.model_types,
            "mtp_prefix": table.mtp.prefix,
            "norm": table.norm,
            "concat_order": table.mtp.concat_order,
            "formats": formats,
            # vLLM's MTP class for the family and the check level (served / loaded / names)
            "vllm": _vllm(table),
            # `ckpt probe`: our engine builds the MTP of the table's fixture config (and MtpModel too?)
            **(_probe_support(table) if probe else {}),
        })
    return rows
