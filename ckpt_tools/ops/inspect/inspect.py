"""`ckpt inspect`: what a checkpoint's MTP layers are made of, to the byte.

``inspect_checkpoint(path_or_ckpt, arch=None)`` returns an ``InspectReport`` built from the headers
only (``mtp.open_mtp``): family and table, MTP tensors by role and depth, totals, routed-expert groups
as stored, shards, dtypes, FP8 scales, the quantization audit per MTP module, and every problem the
consistency gate would refuse the checkpoint for, as findings: inspect never refuses a checkpoint it
can read and classify. ``InspectReport.to_json()`` is the ``ckpt inspect --json`` output; its keys are
in docs/verbs.md, "inspect --json".
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field, fields
from operator import attrgetter

from ...errors import InputError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint
from ...model.consistency import REPORT_ONLY, absent_notes, renamed_format
from ...model.gate import check
from ...model.mtp import MtpView
from ...model.quant.audit import Audit, audit, experts_stored
from ...model.quant.report import audit_json
from ...model.tables.roles import GLUE_ROLES

ROLE_ORDER = (*GLUE_ROLES, "block", "experts", "fp8_scales")
_ROLE_NAME = {"expert": "experts", "scale": "fp8_scales"}


def _stats() -> dict:
    return {"tensors": 0, "params": 0, "bytes": 0}


def _add(stats: dict, numel: int, nbytes: int) -> None:
    stats["tensors"] += 1
    stats["params"] += numel
    stats["bytes"] += nbytes


@dataclass
class InspectReport:
    path: str
    family: str
    title: str
    table_source: str
    norm: str
    concat_order: str
    dtype: str
    mtp_layers: int
    count_field: str | None
    quantization: dict | None
    mtp_quant: dict | None
    totals: dict
    roles: dict
    layers: list[dict]
    experts: list[dict]
    shards: list[dict]
    dtypes: dict
    fp8: dict
    tensors: list[dict]
    status: dict
    view: MtpView | None = field(default=None, repr=False)  # for callers that go on planning
    reader: str = "safetensors"
    reader_notes: list[str] = field(default_factory=list)
    allowed_invalid: list[dict] = field(default_factory=list)  # inspect refuses nothing: stays empty
    findings: list[dict] = field(default_factory=list)  # what the consistency gate refuses (Problem.to_json)
    notes: list[dict] = field(default_factory=list)  # validate's notes: worth knowing, not wrong

    @property
    def complete(self) -> bool:
        return bool(self.status["complete"])

    def to_json(self) -> dict:  # this class's fields in order, but the view; allowed_invalid last, when there are any
        skip = ("view", "allowed_invalid")
        out = {f.name: getattr(self, f.name) for f in fields(InspectReport) if f.name not in skip}
        return {**out, **({"allowed_invalid": self.allowed_invalid} if self.allowed_invalid else {})}


def _count_field(view: MtpView) -> str | None:
    table = view.table
    var = table.config.get(table.mtp.count_field or "")
    return next((k for k in var.keys if view.ckpt.config.has(k)), None) if var is not None else None


def _quantization(ckpt: Checkpoint, view: MtpView, result: Audit) -> dict | None:
    """What config.json says, and the scheme the tables detect (``quant.detect_scheme``)."""
    qc = ckpt.config.get("quantization_config")
    found = audit_json(result) if result.scheme is not None or result.unknown else None
    if not isinstance(qc, dict) and found is None:
        return None
    qc = qc if isinstance(qc, dict) else {}
    return {
        "quant_method": qc.get("quant_method"),
        "weight_block_size": qc.get("weight_block_size"),
        "scale_suffix": view.codec.scale_suffix,
        "scheme": found["scheme"] if found else None,
        "schemes": found["schemes"] if found else [],
        "declared_in": found["declared_in"] if found else [],
        **({"unknown": result.unknown} if result.unknown else {}),
    }


def inspect_view(view: MtpView, table_source: str = "detected") -> InspectReport:
    """The report for an already classified checkpoint."""
    ckpt = view.ckpt
    whole, whole_dtypes = _checkpoint_totals(ckpt)
    tally = _tally_mtp(view)
    quant = audit(view)  # per MTP module: stored as what, declared as what
    table = view.table
    return InspectReport(
        path=ckpt.root, family=table.family, title=table.title, table_source=table_source, norm=table.norm,
        concat_order=table.mtp.concat_order, dtype=view.resolved.dtype, mtp_layers=view.count,
        count_field=_count_field(view), quantization=_quantization(ckpt, view, quant),
        mtp_quant=audit_json(quant) if quant.modules or quant.scheme is not None or quant.unknown else None,
        totals={"checkpoint": whole, "mtp": tally.mtp}, roles=tally.ordered_roles(), layers=_layers(view, tally),
        experts=_experts(view, tally), shards=_shards(ckpt, tally), dtypes={"mtp": _sorted(tally.dtypes),
                                                                     "checkpoint": _sorted(whole_dtypes)},
        fp8=tally.fp8, tensors=tally.tensors, status=_status(view), view=view, reader=ckpt.reader,
        reader_notes=list(ckpt.reader_notes),
    )


def _checkpoint_totals(ckpt: Checkpoint) -> tuple[dict, dict[str, dict]]:
    """Tensors, params, bytes and shards of the whole checkpoint, and per dtype."""
    whole = _stats()
    by_dtype: dict[str, dict] = {}
    # by kind of tensor (a release's 92,000 tensors come in ~50 dtype x shape kinds), then summed per kind
    kinds = Counter(map(attrgetter("dtype", "shape", "nbytes"), ckpt.tensors.values()))
    for (dtype, shape, nbytes), n in kinds.items():  # in order of first appearance, as the dtypes were listed
        numel = math.prod(shape)
        for stats in (whole, by_dtype.setdefault(dtype, _stats())):
            stats["tensors"] += n
            stats["params"] += n * numel
            stats["bytes"] += n * nbytes
    whole["shards"] = len(ckpt.shard_keys)  # safetensors shards, or the files a draft reader read
    return whole, by_dtype


@dataclass
class _MtpTally:
    """The MTP tensors stored, summed by role, dtype, depth and shard, with one entry each."""

    mtp: dict = field(default_factory=_stats)
    roles: dict[str, dict] = field(default_factory=dict)
    dtypes: dict[str, dict] = field(default_factory=dict)
    by_depth: dict[int | None, dict] = field(default_factory=dict)
    by_shard: dict[str, dict] = field(default_factory=dict)
    tensors: list[dict] = field(default_factory=list)
    fp8: dict = field(default_factory=dict)
    block_scales: set[str] = field(default_factory=set)  # counted under fp8_scales, not with their weights' experts

    def add(self, role: str, depth: int | None, dtype: str, shard: str, numel: int, nbytes: int) -> None:
        _add(self.mtp, numel, nbytes)
        _add(self.roles.setdefault(role, {**_stats(), "keys": []}), numel, nbytes)
        _add(self.dtypes.setdefault(dtype, _stats()), numel, nbytes)
        _add(self.by_depth.setdefault(depth, _stats()), numel, nbytes)
        _add(self.by_shard.setdefault(shard, _stats()), numel, nbytes)

    def ordered_roles(self) -> dict[str, dict]:
        ordered = {r: self.roles[r] for r in ROLE_ORDER if r in self.roles}
        ordered.update({r: v for r, v in self.roles.items() if r not in ordered})
        return ordered


def _tally_mtp(view: MtpView) -> _MtpTally:
    """Every MTP tensor stored (a quantized weight counts every tensor it is stored as), one entry each."""
    ckpt = view.ckpt
    source_name = {id(src): name for name, src in ckpt.sources.items()}
    fmt = view.codec  # the checkpoint's block format (model.quant.codec)
    tally = _MtpTally(fp8={"weights": 0, "scales": 0, "scale_suffix": fmt.scale_suffix, "block": list(fmt.block)})
    for s, key in view.stored():
        ref = ckpt.tensors[key]
        st = view.quantized.get(s.key)
        block = st is not None and (st.scheme, st.format) == (fmt.scheme, fmt.format)  # the block format's tensors
        role = "fp8_scales" if block and key != s.key else _ROLE_NAME.get(s.role, s.role)
        numel, nbytes = ref.numel, ref.nbytes
        shard = source_name.get(id(ref.source)) or ckpt.shard_of(key)
        tally.add(role, s.depth, ref.dtype, shard, numel, nbytes)
        tally.roles[role]["keys"].append(key)
        entry = {"key": key, "role": role, "depth": s.depth, "dtype": ref.dtype, "shape": list(ref.shape),
                 "params": numel, "bytes": nbytes, "shard": shard}
        if block and key == s.key:  # a block-format weight: its one scale companion, counted under fp8
            entry["scale"] = st.tensors[fmt.scale_suffix]
            tally.fp8["weights"] += 1
        elif st is None and fmt.stores(ref.dtype):  # stacked experts: one tensor per group, its scale beside it
            entry["scale"] = fmt.scale_key(s.key)
            tally.fp8["weights"] += 1
        elif st is not None and not block:
            entry["stored_as"] = st.label
        if role == "fp8_scales":
            tally.fp8["scales"] += 1
            tally.block_scales.add(key)
        tally.tensors.append(entry)
    tally.mtp["shards"] = len(tally.by_shard)
    return tally


def _layers(view: MtpView, tally: _MtpTally) -> list[dict]:
    """Per MTP depth; the tensors every depth shares last (depth None)."""
    out = [{"depth": layer.depth, "prefix": layer.prefix, **tally.by_depth.get(layer.depth, _stats())}
           for layer in view.resolved.layers]
    if None in tally.by_depth:
        out.append({"depth": None, "prefix": None, **tally.by_depth[None]})
    return out


def _experts(view: MtpView, tally: _MtpTally) -> list[dict]:
    """Per routed-expert group, in the layout on disk: what is stored and how."""
    ckpt = view.ckpt
    stored_as: dict[str, list[str]] = {}  # logical key -> the tensors it is stored as (weight_packed + scales ...)
    for s, key in view.stored():
        if key not in tally.block_scales:
            stored_as.setdefault(s.key, []).append(key)
    out = []
    for g in view.groups():
        table_layout = next((x.layout for x in view.resolved.experts() if x.prefix == g.prefix), g.layout)
        st = _stats()
        for t in g.tensors():
            for key in stored_as.get(t.key, ()):
                ref = ckpt.tensors[key]
                _add(st, ref.numel, ref.nbytes)
        stored = experts_stored(view, g)  # from the stored dtypes and companions, not the table's quant flag
        out.append({
            "prefix": g.prefix, "depth": g.depth, "count": g.count, "hidden": g.hidden, "inter": g.inter,
            "gated": g.gated, "quant": stored is not None and stored.state == "quantized",
            "stored": stored.label if stored is not None else None,
            "layout_shipped": table_layout.label(), "layout": g.layout.label(), **st,
        })
    return out


def _shards(ckpt: Checkpoint, tally: _MtpTally) -> list[dict]:
    """The files holding MTP tensors: their MTP share and their whole."""
    out = []
    for name in sorted(tally.by_shard):
        keys = ckpt.shard_keys.get(name, [])
        h = ckpt.headers.get(name)
        out.append({
            "name": name,
            "mtp_tensors": tally.by_shard[name]["tensors"],
            "mtp_bytes": tally.by_shard[name]["bytes"],
            "tensors": len(keys),
            "bytes": h.data_bytes if h else sum(ckpt.tensors[k].nbytes for k in keys),
        })
    return out


def _status(view: MtpView) -> dict:
    """Complete or not, and what is missing, mis-shaped, extra or beyond the declared count."""
    return {
        "complete": view.complete(),
        "missing": [{"key": s.key, "role": _ROLE_NAME.get(s.role, s.role), "depth": s.depth, "shape": list(s.shape)}
                    for s in view.missing],
        "misshaped": [{"key": s.key, "expected": list(s.shape), "actual": list(a)} for s, a in view.misshaped],
        "missing_scales": list(view.missing_scales),
        "extra": list(view.extra),
        "beyond": list(view.beyond),
        "optional_absent": [s.key for s in view.optional_absent],
    }


def _sorted(d: dict[str, dict]) -> dict[str, dict]:
    return dict(sorted(d.items(), key=lambda kv: -kv[1]["bytes"]))


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def inspect_checkpoint(path_or_ckpt: str | os.PathLike | Checkpoint, arch: str | None = None,
                       allow: frozenset[str] = frozenset()) -> InspectReport:
    """Open (headers only) and describe the MTP layers of a checkpoint; ``arch`` overrides detection.

    Never refuses a checkpoint it can read and classify: what the consistency gate would refuse
    (``gate.check``: missing MTP or trunk tensors, quantization disagreements, index problems
    ...) is reported in ``findings``, validate's notes in ``notes``. ``allow`` (``--allow-invalid``)
    is accepted for the command line's sake and changes nothing: inspect lets everything through.
    InputError only for what cannot be read or classified (a hostile header, an unknown family, a
    config value of the wrong type, a draft in a renamed format).
    """
    if not isinstance(path_or_ckpt, Checkpoint):
        with Checkpoint.open(path_or_ckpt) as ckpt:
            return inspect_checkpoint(ckpt, arch, allow)
    _refuse_renamed(path_or_ckpt, arch)
    problems, view = check(path_or_ckpt, arch=arch)
    assert view is not None  # scope "auto" always classifies
    report = inspect_view(view, "arch" if arch else "detected")
    report.findings = [p.to_json() for p in problems if p.rule not in REPORT_ONLY]
    report.notes = [p.to_json() for p in absent_notes(view)]
    return report


def _refuse_renamed(ckpt: Checkpoint, arch: str | None) -> None:
    """A draft in a renamed format has no family table of its own: say what describes it instead."""
    fmt = renamed_format(ckpt)
    if fmt is None:
        return
    family = (ckpt.manifest or {}).get("family")
    about = f" (extracted from {family})" if family else ""
    raise InputError(f"a draft in the {fmt} format{about}: inspect describes checkpoints in a family's own names"
                     f"{' (--arch does not rename it)' if arch else ''}. `ckpt validate {ckpt.root}` checks it; "
                     f"`ckpt stitch {ckpt.root} VERIFIER -o OUT --dry-run` shows where each of its tensors goes",
                     rule="draft-format", path=ckpt.root)
