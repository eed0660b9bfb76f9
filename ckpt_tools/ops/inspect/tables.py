"""`ckpt tables`: the known families, what they match, and the formats each can be extracted to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import CkptError
from ...io.checkpoint import Checkpoint
from ...io.config import ConfigView
from ...model.formats import all_formats, check_expressible
from ...model.mtp import MtpView
from ...model.tables.loader import all_tables
from ...model.tables.resolve import resolve


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


def _vllm(table) -> dict | None:
    """vLLM's draft for the family, from the table's ``vllm`` section: its class and how far it was checked."""
    v = table.vllm
    if v is None:
        return None
    return {"architecture": v.architecture, "class": v.cls, "check": v.check,
            **({"depths": v.depths} if v.depths is not None else {}), **({"note": v.note} if v.note else {})}


def _llama_cpp(table) -> dict | None:
    """llama.cpp's architecture for the family (GGUF sidecars), from the ``llama_cpp`` section, and its check."""
    lc = table.llama_cpp
    if lc is None:
        return None
    return {"arch": lc.arch, "tensor_arch": lc.tensor_arch, "check": lc.check,
            **({"package_lacks": list(lc.package_lacks)} if lc.package_lacks else {}),
            **({"names": list(lc.names)} if lc.names else {}),
            **({"tensor_map": True} if lc.tensor_map else {}),
            **({"note": lc.note} if lc.note else {})}


def tables_info(family: str | None = None, probe_support: Callable[[Any], dict] | None = None) -> list[dict]:
    """``family``: that family only (a UsageError naming the known ones when no table has that name).
    ``probe_support``: the fields saying whether `ckpt probe` supports a table's family (the probe room's
    ``probe_row``, passed in by the caller so that listing tables never imports probe)."""
    tables = all_tables()
    if family is not None and family not in tables:
        from ...errors import UsageError

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
            # llama.cpp's architecture for the family's GGUF sidecars and the check level (served / converter / names)
            "llama_cpp": _llama_cpp(table),
            # `ckpt probe`: our engine builds the MTP of the table's fixture config (and MtpModel too?)
            **(probe_support(table) if probe_support is not None else {}),
        })
    return rows
