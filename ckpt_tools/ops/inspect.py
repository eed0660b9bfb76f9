"""`ckpt inspect`: what a checkpoint's MTP layers are made of, to the byte.

``inspect_checkpoint(path_or_ckpt, arch=None)`` returns an ``InspectReport``; the CLI
renders it with rich, ``ckpt demo`` and other commands reuse it. Built on
``mtp.open_mtp``: reads headers only.

``InspectReport.to_json()`` - the ``ckpt inspect --json`` output - has these stable keys:

- ``path``, ``family``, ``title``, ``table_source`` (``"detected"`` or ``"arch"``),
  ``norm`` (``plain`` | ``zero_centred``), ``concat_order`` (``embed_first`` | ``hidden_first``),
  ``dtype`` (the model dtype the table resolved), ``mtp_layers`` (declared count) and
  ``count_field`` (the config key declaring it, or null);
- ``quantization``: null (nothing declared), or ``{quant_method, weight_block_size, scale_suffix}`` from
  config.json plus ``scheme`` (the detected scheme, ``quant.detect_scheme``: table names joined by ``+``),
  ``schemes`` (``[{scheme, title}]``) and ``declared_in`` (``file:section`` of each place declaring it);
- ``mtp_quant``: null for an unquantized checkpoint, else the per-MTP-module audit (``quant.audit``,
  rule ``mtp-quant-config``) as ``quant.report.audit_json`` gives it: ``{scheme, schemes, declared_in,
  ok, unknown, modules, findings}``; each module ``{module, stored{state, label, scheme, dtype},
  declared{state, reason, group?, scheme?, entry?}, expert, exempt, fused, ok, problem}`` (``entry``: the
  exclusion entry that excludes it, ``{where: "file:field", pattern, exact}``, or null);
- ``totals``: ``{"checkpoint": T, "mtp": T}`` with ``T = {tensors, params, bytes, shards}``;
  params count every element of every tensor (FP8 scales included), bytes are tensor data
  bytes (numel x itemsize, headers excluded), shards the number of files involved;
- ``roles``: role -> ``{tensors, params, bytes, keys}`` for the MTP tensors present, roles in
  this order when present: embed_norm, hidden_norm, fusion, fusion_embed, fusion_hidden,
  final_norm, embed, head (per-layer copies), block, experts, fp8_scales;
- ``layers``: per depth ``{depth, prefix, tensors, params, bytes}``; tensors shared by every
  depth (``depth: null``) come last when the family has them;
- ``experts``: per routed-expert group ``{prefix, depth, count, hidden, inter, gated, quant, stored,
  layout_shipped, layout, tensors, params, bytes}``, all of it what is stored: ``layout`` the layout
  detected from the keys on disk, ``quant`` true when its stored tensors are quantized (their dtypes and
  scale companions, ``quant.audit.experts_stored``) and ``stored`` how (``"BF16"``, ``"F8_E4M3 block
  [128, 128]"``, a scheme table's label; null when none of its tensors is stored);
  ``layout_shipped`` is only the family table's default layout, no claim about this checkpoint; the
  sizes count the expert weights, their FP8 scales are under ``fp8_scales``;
- ``shards``: the files holding MTP tensors, ``{name, mtp_tensors, mtp_bytes, tensors, bytes}``;
- ``dtypes``: ``{"mtp": D, "checkpoint": D}`` with ``D = {dtype: {tensors, params, bytes}}``;
- ``fp8``: ``{weights, scales, scale_suffix, block}`` over the MTP tensors;
- ``tensors``: every MTP tensor present, ``{key, role, depth, dtype, shape, params, bytes, shard}``
  plus ``scale`` (the companion's key) on FP8 weights;
- ``status``: ``{complete, missing, misshaped, missing_scales, extra, beyond, optional_absent}``;
  missing entries are ``{key, role, depth, shape}``, misshaped ``{key, expected, actual}``, the
  others lists of keys;
- ``reader`` (``safetensors``, or the draft reader: ``torch``, ``dcp``) and ``reader_notes`` (what it
  unwrapped or ignored);
- ``findings``: every problem the consistency gate refuses this checkpoint for (the rules
  ``ckpt validate`` reports, ``consistency.RULES``: ``mtp-missing``, ``trunk-missing``,
  ``mtp-quant-config``, ``unindexed-shard`` ...), ``{rule, path, key, message}``; empty when other
  verbs accept it. inspect itself never refuses a checkpoint it can read and classify;
- ``notes``: what validate notes without calling it wrong (``copy-absent``, ``optional-absent``,
  ``mtp-none``), ``{rule, path, key, message}``;
- ``allowed_invalid``: never present (inspect lets every problem through; ``--allow-invalid`` changes
  nothing).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter

from ..errors import InputError
from ..gcpause import gc_paused
from ..io.checkpoint import Checkpoint
from ..model.consistency import REPORT_ONLY, absent_notes, renamed_format
from ..model.gate import check
from ..model.mtp import MtpView
from ..model.quant.audit import Audit, audit, experts_stored
from ..model.quant.report import audit_json
from ..model.tables.schema import GLUE_ROLES

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

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "family": self.family,
            "title": self.title,
            "table_source": self.table_source,
            "norm": self.norm,
            "concat_order": self.concat_order,
            "dtype": self.dtype,
            "mtp_layers": self.mtp_layers,
            "count_field": self.count_field,
            "quantization": self.quantization,
            "mtp_quant": self.mtp_quant,
            "totals": self.totals,
            "roles": self.roles,
            "layers": self.layers,
            "experts": self.experts,
            "shards": self.shards,
            "dtypes": self.dtypes,
            "fp8": self.fp8,
            "tensors": self.tensors,
            "status": self.status,
            "reader": self.reader,
            "reader_notes": self.reader_notes,
            "findings": self.findings,
            "notes": self.notes,
            **({"allowed_invalid": self.allowed_invalid} if self.allowed_invalid else {}),
        }


def _count_field(view: MtpView) -> str | None:
    table = view.table
    var = table.config.get(table.mtp.count_field or "")
    if var is None:
        return None
    for k in var.keys:
        if view.ckpt.config.has(k):
            return k
    return None


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
        "scale_suffix": view.block_format.scale_suffix,
        "scheme": found["scheme"] if found else None,
        "schemes": found["schemes"] if found else [],
        "declared_in": found["declared_in"] if found else [],
        **({"unknown": result.unknown} if result.unknown else {}),
    }


def inspect_view(view: MtpView, table_source: str = "detected") -> InspectReport:
    """The report for an already classified checkpoint."""
    ckpt = view.ckpt
    res = view.resolved
    source_name = {id(src): name for name, src in ckpt.sources.items()}

    whole = _stats()
    whole_dtypes: dict[str, dict] = {}
    # by kind of tensor (a release's 92,000 tensors come in ~50 dtype x shape kinds), then summed per kind
    kinds = Counter(map(attrgetter("dtype", "shape", "nbytes"), ckpt.tensors.values()))
    for (dtype, shape, nbytes), n in kinds.items():  # in order of first appearance, as the dtypes were listed
        numel = math.prod(shape)
        for stats in (whole, whole_dtypes.setdefault(dtype, _stats())):
            stats["tensors"] += n
            stats["params"] += n * numel
            stats["bytes"] += n * nbytes
    whole["shards"] = len(ckpt.shard_keys)  # safetensors shards, or the files a draft reader read

    mtp = _stats()
    roles: dict[str, dict] = {}
    mtp_dtypes: dict[str, dict] = {}
    by_depth: dict[int | None, dict] = {}
    by_shard: dict[str, dict] = {}
    tensors: list[dict] = []
    fmt = view.block_format  # the checkpoint's block format (model.quant.companions)
    fp8 = {"weights": 0, "scales": 0, "scale_suffix": fmt.scale_suffix, "block": list(fmt.block)}
    block_scales: set[str] = set()  # counted under fp8_scales, not with their weights' experts
    for s, key in view.stored():  # a quantized weight (quant scheme tables) counts every tensor it is stored as
        ref = ckpt.tensors[key]
        st = view.quantized.get(s.key)
        block = st is not None and (st.scheme, st.format) == (fmt.scheme, fmt.format)  # the block format's tensors
        role = "fp8_scales" if block and key != s.key else _ROLE_NAME.get(s.role, s.role)
        numel, nbytes = ref.numel, ref.nbytes
        _add(mtp, numel, nbytes)
        r = roles.setdefault(role, {**_stats(), "keys": []})
        _add(r, numel, nbytes)
        r["keys"].append(key)
        _add(mtp_dtypes.setdefault(ref.dtype, _stats()), numel, nbytes)
        _add(by_depth.setdefault(s.depth, _stats()), numel, nbytes)
        shard = source_name.get(id(ref.source)) or ckpt.shard_of(key)
        _add(by_shard.setdefault(shard, _stats()), numel, nbytes)
        entry = {"key": key, "role": role, "depth": s.depth, "dtype": ref.dtype, "shape": list(ref.shape),
                 "params": numel, "bytes": nbytes, "shard": shard}
        if block and key == s.key:  # a block-format weight: its one scale companion, counted under fp8
            entry["scale"] = st.tensors[fmt.scale_suffix]
            fp8["weights"] += 1
        elif st is None and fmt.stores(ref.dtype):  # stacked experts: one tensor per group, its scale beside it
            entry["scale"] = fmt.scale_key(s.key)
            fp8["weights"] += 1
        elif st is not None and not block:
            entry["stored_as"] = st.label
        if role == "fp8_scales":
            fp8["scales"] += 1
            block_scales.add(key)
        tensors.append(entry)
    mtp["shards"] = len(by_shard)

    layers = [
        {"depth": layer.depth, "prefix": layer.prefix, **by_depth.get(layer.depth, _stats())}
        for layer in res.layers
    ]
    if None in by_depth:
        layers.append({"depth": None, "prefix": None, **by_depth[None]})

    experts = []
    stored_as: dict[str, list[str]] = {}  # logical key -> the tensors it is stored as (weight_packed + scales ...)
    for s, key in view.stored():
        if key not in block_scales:
            stored_as.setdefault(s.key, []).append(key)
    for g in view.groups():  # in the layout on disk
        table_layout = next((x.layout for x in res.experts() if x.prefix == g.prefix), g.layout)
        st = _stats()
        for t in g.tensors():
            for key in stored_as.get(t.key, ()):
                ref = ckpt.tensors[key]
                _add(st, ref.numel, ref.nbytes)
        stored = experts_stored(view, g)  # from the stored dtypes and companions, not the table's quant flag
        experts.append({
            "prefix": g.prefix, "depth": g.depth, "count": g.count, "hidden": g.hidden, "inter": g.inter,
            "gated": g.gated, "quant": stored is not None and stored.state == "quantized",
            "stored": stored.label if stored is not None else None,
            "layout_shipped": table_layout.label(), "layout": g.layout.label(), **st,
        })

    shards = []
    for name in sorted(by_shard):
        keys = ckpt.shard_keys.get(name, [])
        h = ckpt.headers.get(name)
        shards.append({
            "name": name,
            "mtp_tensors": by_shard[name]["tensors"],
            "mtp_bytes": by_shard[name]["bytes"],
            "tensors": len(keys),
            "bytes": h.data_bytes if h else sum(ckpt.tensors[k].nbytes for k in keys),
        })

    status = {
        "complete": view.complete(),
        "missing": [{"key": s.key, "role": _ROLE_NAME.get(s.role, s.role), "depth": s.depth, "shape": list(s.shape)}
                    for s in view.missing],
        "misshaped": [{"key": s.key, "expected": list(s.shape), "actual": list(a)} for s, a in view.misshaped],
        "missing_scales": list(view.missing_scales),
        "extra": list(view.extra),
        "beyond": list(view.beyond),
        "optional_absent": [s.key for s in view.optional_absent],
    }
    quant = audit(view)  # per MTP module: stored as what, declared as what
    ordered_roles = {r: roles[r] for r in ROLE_ORDER if r in roles}
    ordered_roles.update({r: v for r, v in roles.items() if r not in ordered_roles})
    table = view.table
    return InspectReport(
        path=ckpt.root, family=table.family, title=table.title, table_source=table_source, norm=table.norm,
        concat_order=table.mtp.concat_order, dtype=res.dtype, mtp_layers=view.count,
        count_field=_count_field(view), quantization=_quantization(ckpt, view, quant),
        mtp_quant=audit_json(quant) if quant.modules or quant.scheme is not None or quant.unknown else None,
        totals={"checkpoint": whole, "mtp": mtp}, roles=ordered_roles, layers=layers, experts=experts,
        shards=shards, dtypes={"mtp": _sorted(mtp_dtypes), "checkpoint": _sorted(whole_dtypes)}, fp8=fp8,
        tensors=tensors, status=status, view=view, reader=ckpt.reader, reader_notes=list(ckpt.reader_notes),
    )


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
