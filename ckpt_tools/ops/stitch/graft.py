"""Plans for `ckpt graft SOURCE TARGET`: a converted checkpoint gets its MTP layers back from the release.

Quantizers drop MTP (or keep part of it, or misdeclare it); the original release still has it. OUT is
TARGET with SOURCE's MTP layers: the families match and SOURCE's MTP tensors have the names and shapes
TARGET's config gives them (``source-mismatch``); each MTP tensor is written as SOURCE stores it, or
cast / dequantized (``--mtp-dtype``), or encoded in TARGET's scheme (``--mtp-quant``); experts follow
TARGET's trunk layout; MTP tensors TARGET holds are dropped, every other shard copied or linked whole;
config.json declares SOURCE's MTP count and the quantization config is repaired so each engine loads
each MTP module as stored.

TARGET's MTP rules (mtp-missing, mtp-quant-config, ...) are what graft repairs, so the gate waives
them; every other inconsistency of either input is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ... import __version__
from ...dtypes import FLOAT_DTYPES
from ...errors import InputError, UsageError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint, revision_of, source_name
from ...model.consistency import MTP_RULES, count_field, note_allowed
from ...model.gate import require_consistent
from ...model.mtp import MtpView, choose_table
from ...model.quant.audit import Stored
from ...model.quant.scale_values import RULE as SCALE_VALUE_RULE
from ...model.quant.scale_values import checked_copies
from ...numeric import transforms
from ...stream.fingerprint import record_inputs
from ...stream.plan import CopyBytes, OutputTensor, Plan
from ..shared.tensor_diff import TensorDiff
from ..writing.add_mtp import mtp_into, require_indexed, virtual_view
from ..writing.carry import check_inputs
from ..writing.moves import Mover, Rename, Restack, Step
from ..writing.out_dtype import pinned as pinned_dtype
from ..writing.output_config import config_files, repair_config, set_count
from .report import StitchReport

if TYPE_CHECKING:
    from ...model.quant.storage import Storage
    from ...model.tables.resolve import Spec

MTP_DTYPES = {"bf16": "BF16", "fp32": "F32", "fp16": "F16"}
# graft drops every MTP-namespace tensor of the target and writes the source's: what is wrong there is repaired
GRAFT_REPAIRS = {**{rule: "graft replaces every MTP tensor of the target with the source's" for rule in MTP_RULES},
                 "mtp-quant-config": "graft writes the quantization config for the MTP it writes"}


@dataclass
class GraftRequest:
    link: str = "copy"
    mtp_dtype: str | None = None  # bf16 | fp32 | fp16: float values cast, quantized ones dequantized
    mtp_quant: str | None = None  # a scheme (mtp_quants()) for the weights the table marks quantizable
    arch: str | None = None
    max_shard_size: int = 5 * 10**9
    command: str = "ckpt graft"
    allow_invalid: frozenset[str] = frozenset()
    # the source's float MTP values read and checked before anything is written; a --dry-run reads headers only
    # (at release scale the check reads gigabytes), so it does not see non-finite values
    check_values: bool = True
    # --mtp-quant auto: the measured table and the choice (api.mtp_choice), recorded in the report and manifest
    measured: dict | None = None


@dataclass
class GraftReport(StitchReport):
    source: str = ""
    target: str = ""
    storage: str = "as the source stores it"
    count: dict = field(default_factory=dict)  # the config's MTP count: field, before, after
    mtp_quant_auto: dict | None = None  # GraftRequest.measured

    def to_json(self) -> dict:
        return {
            "mode": "graft",
            "family": self.family,
            "source": self.source,
            "target": self.target,
            "provenance": self.provenance,
            "mtp_storage": self.storage,
            "mtp_count": self.count,
            "totals": self.totals(),
            "tensors": [d.to_json() for d in self.diffs],
            "rewritten_shards": self.rewritten_shards,
            "new_shards": self.new_shards,
            "linked_files": self.linked_files,
            **({"quant_config": self.quant_config} if self.quant_config is not None else {}),
            **({"validation": self.validation} if self.validation is not None else {}),
            **({"mtp_quant_auto": self.mtp_quant_auto} if self.mtp_quant_auto is not None else {}),
            **({"link_digests": self.link_digests} if self.link_digests is not None else {}),
        }


@dataclass
class _Piece:
    """One MTP weight (or other tensor) as the source stores it, and how to read its values."""

    tensors: list[OutputTensor]  # as stored (weight first, then its companions)
    stored: Stored | None  # None: not a float / quantized weight (copied as it is)
    values: Callable[[str], OutputTensor] | None  # dtype -> the tensor's values in that dtype


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def plan_graft(source: Checkpoint, target: Checkpoint, req: GraftRequest) -> tuple[Plan, GraftReport]:
    if req.mtp_dtype is not None and req.mtp_dtype not in MTP_DTYPES:
        raise UsageError(f"--mtp-dtype {req.mtp_dtype!r}: use one of {', '.join(MTP_DTYPES)}")
    if req.mtp_quant is not None and req.mtp_quant not in mtp_quants():
        from ...model.quant import all_schemes

        why = ("its table names no encoder (no storage format graft can write)" if req.mtp_quant in all_schemes()
               else "no scheme table has that name")
        raise UsageError(f"--mtp-quant {req.mtp_quant!r}: {why}; use one of {', '.join(mtp_quants())}",
                         rule="mtp-quant-scheme")
    check_inputs(req.link, target, source, ("target", "source"))
    table = choose_table(target, req.arch)
    stable = choose_table(source, req.arch)
    if stable.family != table.family:
        raise InputError(f"the source {source.root} is a {stable.family} checkpoint, the target {target.root} a "
                         f"{table.family} one: an MTP layer belongs to the model it was trained with "
                         "(--arch FAMILY reads both with one table)", rule="wrong-family", path=source.root)
    provenance = f"asserted with --arch {req.arch}" if req.arch else f"both detected as {table.family}"
    tgate = require_consistent(target, table, allow=req.allow_invalid, waive=GRAFT_REPAIRS, scope="model",
                               role="target")
    require_indexed(tgate, target, "graft")
    sgate = require_consistent(source, table, allow=req.allow_invalid, role="source")
    sview, tview = sgate.view, tgate.view
    if sview.count == 0 or not sview.present:
        raise InputError(f"the source {source.root} has no MTP layers ({count_field(sview)} is {sview.count}, "
                         f"{len(sview.present)} MTP tensor(s)): graft takes them from a checkpoint that ships them, "
                         "such as the original release", rule="no-mtp", path=source.root)
    sview.require_complete()
    out_view = virtual_view(tview, sview.count)
    _same_dimensions(sview, out_view)
    declared = _require_declared(target, req.mtp_quant) if req.mtp_quant is not None else None
    pieces = _Grafter(sview, out_view, req, declared).build()
    out_view.present = [s for s in out_view.present if s.key in pieces or s.role == "scale"]

    report = GraftReport("graft", "native", table.family, provenance=provenance, source=source_name(source),
                         target=source_name(target), storage=_storage_label(req))
    report.count = {"field": count_field(tview), "before": tview.count, "after": sview.count}
    report.mtp_quant_auto = req.measured
    mtp = [t for p in pieces.values() for t in p.tensors]
    # every MTP-namespace tensor of the target goes (and any it holds under a name written again)
    drop = frozenset(tview.keys()) | set(tview.beyond) | set(tview.extra) | {t.key for t in mtp
                                                                               if t.key in target.tensors}
    _diffs(report, target, mtp, drop)

    config = set_count(out_view, target.config.raw, sview.count)
    stored = {k: p.stored for k, p in pieces.items() if p.stored is not None}
    try:
        repaired = repair_config(target, out_view, config, {}, stored=stored)
    except InputError as e:
        if e.rule != "mtp-quant-config" or req.mtp_dtype:
            raise
        raise InputError(f"{e.message}; --mtp-dtype bf16 writes the source's MTP values unquantized, which the "
                         "config can exclude", rule=e.rule, path=e.path) from None
    report.quant_config = repaired.to_json() if repaired.changed else None
    manifest = {
        "kind": "grafted",
        "target": {"path": source_name(target), "revision": revision_of(target)},
        "source": {"path": source_name(source), "revision": revision_of(source)},
        "family": table.family,
        "mtp_layers": sview.count,
        "mtp_storage": report.storage,
        "tool_version": __version__,
        **({"mtp_quant_auto": req.measured} if req.measured is not None else {}),
    }
    plan = mtp_into(target, sorted(mtp, key=lambda t: t.key), config_files(target, config, repaired), req.link,
                    req.max_shard_size, req.command, [], manifest, report, drop=drop)
    manifest["totals"] = report.totals()
    note_allowed(plan.manifest, tgate, sgate)
    # --resume proves the same source bytes: every source tensor the MTP is read from
    taken = sorted({k for t in mtp for k in _sources(t) if k in source.tensors})
    if req.check_values:
        _require_finite(source, sorted(set(taken) - _checked_as_copied(source, plan.tensors)))
    record_inputs(plan, target=target, source=(source, taken))
    if not any(p.rule == SCALE_VALUE_RULE for p in tgate.allowed):  # the gate read every scale of the target
        plan.checked_values = checked_copies(target, {str(f.source): f.name for f in plan.files
                                                      if f.tensors and f.source is not None})
    return plan, report


NONFINITE = "non-finite values in the source's MTP layers"


def _checked_as_copied(source: Checkpoint, tensors: list[OutputTensor]) -> set[str]:
    """The source's float tensors written as they are (one byte range each): their values are checked by the writer
    as it copies them (``compare.FiniteCheck``, one read), the shard holding them written first and nothing left
    in place when it refuses. Returns their keys."""
    from ..shared.compare import FiniteCheck

    covered = set()
    for t in tensors:
        ref = source.tensors.get(t.key) if _sources(t) == [t.key] else None
        if ref is None or ref.dtype not in FLOAT_DTYPES or t.dtype != ref.dtype or not isinstance(t.recipe, CopyBytes):
            continue
        seg = ref.segment()
        if t.recipe.segments != [seg]:
            continue
        t.check = lambda k=t.key, d=t.dtype, p=seg.source.name: FiniteCheck(k, d, p, NONFINITE)
        covered.add(t.key)
    return covered


def _require_finite(source: Checkpoint, keys: list[str]) -> None:
    """The source's float MTP values are finite, as stitch requires of a draft (rule ``nonfinite``): graft writes
    them, casts them or encodes them. Those copied as they are are checked as the writer copies them
    (``_checked_as_copied``); quantized ones as they are decoded (model.quant.finite)."""
    from ..shared.compare import count_nonfinite

    bad = []
    for k in keys:
        ref = source.tensors[k]
        if ref.dtype in FLOAT_DTYPES:
            n = count_nonfinite(CopyBytes([ref.segment()]), ref.dtype, ref.shape)
            if n:
                bad.append(f"{k} ({n} NaN/Inf)")
    if bad:
        raise InputError(f"{NONFINITE}: {', '.join(bad[:10])}"
                         + (f" ... and {len(bad) - 10} more" if len(bad) > 10 else ""), rule="nonfinite",
                         path=source.root)


def _storage_label(req: GraftRequest) -> str:
    parts = []
    if req.mtp_quant:
        parts.append(f"{req.mtp_quant} for the quantizable linear weights")
    if req.mtp_dtype:
        parts.append(f"{req.mtp_dtype} values" + (" for the rest" if req.mtp_quant else ""))
    return "; ".join(parts) or "as the source stores it"


def _sources(t: OutputTensor) -> list[str]:
    src = t.meta.get("source")
    return [s for s in src if isinstance(s, str)] if isinstance(src, list) else [t.key]


def _same_dimensions(sview: MtpView, out_view: MtpView) -> None:
    """SOURCE's MTP tensors have the names and shapes TARGET's config gives MTP layers of that count."""
    sres, tres = sview.resolved, out_view.resolved
    want = {s.key: tuple(s.shape) for s in [*tres.mtp_specs(), *tres.shared.values()]}
    have = {s.key: tuple(s.shape) for s in [*sres.mtp_specs(), *sres.shared.values()]}
    problems = [f"{k}: source {list(have[k])}, target {list(want[k])}" for k in sorted(have.keys() & want.keys())
                if have[k] != want[k]]
    problems += [f"{k} only in the source's MTP layers" for k in sorted(have.keys() - want.keys())]
    problems += [f"{k} only in the target's" for k in sorted(want.keys() - have.keys())]
    if problems:
        raise InputError(f"the source's MTP layers do not fit the target's trunk ({len(problems)} difference(s): "
                         + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
                         + "): another size of the model (hidden size, vocabulary, experts or layers differ)",
                         rule="source-mismatch", path=sview.ckpt.root)


def mtp_quants() -> tuple[str, ...]:
    """The schemes ``--mtp-quant`` writes: every scheme table a storage format of which names an encoder
    (model/quant/encode.py), registered ones included."""
    from ...model.quant import all_schemes

    return tuple(sorted(n for n, t in all_schemes().items() if any(f.encoder for f in t.storage)))


def mtp_in_scheme(ckpt: Checkpoint, scheme: str,
                  target: Checkpoint | None = None) -> dict[str, tuple[list[OutputTensor], Stored | None]]:
    """``ckpt``'s own MTP tensors as ``graft ckpt TARGET --mtp-quant scheme`` would write them (the parameters
    ``target`` declares; without one, the table's defaults), per weight (its logical key): (its tensors, weight
    first; how they are stored). The plan's recipes, run by no writer: ``ckpt probe --mtp-quant`` reads their
    bytes and decodes them in memory."""
    from ...model.mtp import open_mtp

    if scheme not in mtp_quants():
        raise UsageError(f"--mtp-quant {scheme!r}: no encoder; use one of {', '.join(mtp_quants())}",
                         rule="mtp-quant-scheme")
    declared = None if target is None else _require_declared(target, scheme)
    view = open_mtp(ckpt)
    pieces = _Grafter(view, view, GraftRequest(mtp_quant=scheme), declared).build()
    return {k: (p.tensors, p.stored) for k, p in pieces.items()}


def _require_declared(target: Checkpoint, scheme_name: str):
    """--mtp-quant SCHEME writes that scheme's storage: the target's config must declare it, and (a scheme written
    by its encoder) its trunk modules must not carry calibrated activation scales graft cannot compute."""
    from ...model.quant import detect_scheme, get_scheme

    scheme = detect_scheme(target)
    if scheme is None or scheme_name not in {t.scheme for t in scheme.tables}:
        what = "declares no quantization" if scheme is None else \
            "declares " + ", ".join(sorted(t.title for t in scheme.tables))
        raise InputError(f"--mtp-quant {scheme_name} writes {get_scheme(scheme_name).title}, but the target's "
                         f"quantization config {what}, which cannot declare it; --mtp-dtype bf16 or the source's "
                         "own storage (no option) fit it", rule="mtp-quant-config", path=target.root)
    acts = {t.suffix for f in get_scheme(scheme_name).storage for t in f.tensors if t.role == "input_scale"}
    held = sorted(k for k in target.tensors if k.rpartition(".")[2] in acts)
    if held:
        raise InputError(f"--mtp-quant {scheme_name}: the target's modules carry calibrated activation scales "
                         f"(e.g. {held[0]}), which come from running the model on data, not from the weights; "
                         "graft cannot compute them for the MTP (--mtp-dtype bf16 writes it unquantized)",
                         rule="mtp-quant-calibration", path=target.root)
    return scheme


class _Grafter:
    """The source's MTP tensors under the target's names and expert layout, stored as the request says."""

    def __init__(self, sview: MtpView, out_view: MtpView, req: GraftRequest, declared=None) -> None:
        self.sview, self.out_view, self.req, self.declared = sview, out_view, req, declared
        self.src = sview.ckpt
        self.pieces: dict[str, _Piece] = {}  # logical key (a weight's .weight) -> its tensors
        self.fused = None  # encode_plan.FusedGroups, once a weight is encoded

    def build(self) -> dict[str, _Piece]:
        """The source's MTP as steps: expert groups restacked where the target's trunk stores experts in another
        layout (engines expect it), every other tensor under its own name; a block scale travels with its weight."""
        steps: list[Step] = [Restack(sg, tg) for sg, tg in zip(self.sview.groups(), self.out_view.groups(),
                                                                strict=True) if sg.layout != tg.layout]
        restacked = {t.key for step in steps for t in step.src.tensors()}
        steps += [Rename(s.key, s.key, s, {"source": [s.key]}) for s in self.sview.present
                  if s.role != "scale" and s.key not in restacked]
        fmt = self.sview.codec
        Mover(self.src.tensors, fmt, fmt, self.sview.quantized, scale_role=False).run(steps, self)
        return self.pieces

    def take(self, t: OutputTensor, scale: OutputTensor | None, spec: Spec | None, step: Step) -> None:
        if spec is None:  # a restacked expert
            self._add(t.key, self._piece(t, scale), step.dst.quant, expert=True)
        else:
            self._add_spec(spec, self._piece(t, scale))

    def stored(self, step: Rename, st: Storage) -> None:
        """A scheme table's storage (packed, scales, global scales): its tensors as they are."""
        from ...model.quant.dequant import dequant_module, module_outputs

        key = step.src
        parts = module_outputs(self.src, st, key, None, {"source": [key]})
        self._add_spec(step.spec, _Piece(parts, Stored("quantized", st.label, st.scheme, st, st.dtype),
                                         lambda dtype: dequant_module(self.src, st, key, dtype)))

    def _add_spec(self, s: Spec, piece: _Piece) -> None:
        # a dtype the table pins (DeepSeek's F32 e_score_correction_bias) is kept whatever --mtp-dtype says
        self._add(s.key, piece, s.kind == "linear" and s.quant, pinned_dtype(s), s.role == "expert")

    def _piece(self, t: OutputTensor, scale: OutputTensor | None) -> _Piece:
        fmt = self.sview.codec
        if fmt.stores(t.dtype) and scale is not None:  # stacked experts in the source's block format
            st = fmt.storage(t.key, tuple(t.shape), {t.key: t, scale.key: scale})
            return _Piece([t, scale], Stored("quantized", st.label, fmt.scheme, st, t.dtype),
                          lambda dtype: fmt.decode(t, scale, dtype))
        if t.dtype in FLOAT_DTYPES:
            return _Piece([t], Stored("unquantized", t.dtype, dtype=t.dtype), lambda dtype: transforms.cast(t, dtype))
        return _Piece([t], None, None)

    def _add(self, key: str, piece: _Piece, quantizable: bool, pinned: bool = False, expert: bool = False) -> None:
        """``piece`` as the request stores it: FP8 block (quantizable linears), cast / dequantized, or as stored."""
        req = self.req
        if req.mtp_quant and quantizable and piece.values is not None and len(piece.tensors[0].shape) >= 2:
            piece = self._encoded(key, piece, expert)
        elif req.mtp_dtype and piece.values is not None and not (pinned and piece.stored.state == "unquantized"):
            dtype = MTP_DTYPES[req.mtp_dtype]
            t = piece.values(dtype)
            piece = _Piece([t], Stored("unquantized", dtype, dtype=dtype), piece.values)
        self.pieces[key] = piece

    def _encoded(self, key: str, piece: _Piece, expert: bool) -> _Piece:
        """The weight in the requested scheme's storage, written by the encoder its table names, with the
        parameters the target's config declares for the module (group size, strategy, block); the source's own
        tensors where it already stores the weight so (same table, format, parameters and dtypes)."""
        from ...model.expert_layouts import scale_key
        from ...model.quant import get_scheme
        from ...model.quant.block import block_tile
        from ...model.quant.codec import EncodeArgs, layout_of
        from ...model.quant.encode_plan import FusedGroups, encode_module
        from ...model.quant.storage import Storage, params_for

        name, w = self.req.mtp_quant or "", piece.tensors[0]
        table = get_scheme(name)
        module = key.removesuffix(".weight")
        params = params_for(self.declared, table, module)
        fmt = next((f for f in table.storage if f.encoder and _applies(f.when, params)), None)
        if fmt is None:
            raise UsageError(f"{key}: {table.title} with {dict(params)} has no storage format with an encoder",
                             rule="mtp-quant-scheme")
        shape = piece.stored.storage.shape if piece.stored is not None and piece.stored.storage else w.shape
        if len(shape) != 2 and block_tile(fmt, params) is None:  # a block format's scale grid stacks as its weight
            raise UsageError(f"{key}: --mtp-quant {name} writes one Linear per weight; the target's trunk stores "
                             f"these experts stacked {list(shape)} (a per-expert target, or --mtp-dtype bf16)",
                             rule="mtp-quant-stacked")
        label = fmt.label.format_map(dict(params))
        dtype = self.out_view.resolved.dtype
        suffixes = {"weight": fmt.weight.suffix, **{t.role: t.suffix for t in fmt.tensors}}
        written = layout_of(fmt.encoder or "", tuple(shape), EncodeArgs(params, {}, dtype, suffixes=suffixes))
        if _already(piece, name, fmt, params, written):
            return piece  # the source stores it in this very format: its bytes
        # a stacked experts tensor has no module: its companions are named off its key (gate_up_proj_scale_inv)
        keys = {sfx: f"{module}.{sfx}" if key.endswith(".weight") else key if sfx == fmt.weight.suffix
                else scale_key(key, sfx) for sfx in written}
        st = Storage(module, "quantized", fmt.weight.dtypes[0], name, fmt.name, label, keys, shape=tuple(shape),
                     params=params)
        values = w if piece.stored is not None and piece.stored.state == "unquantized" else piece.values(dtype)
        if self.fused is None:
            self.fused = FusedGroups(self.out_view.table.fused_modules, dtype)
        outs = list(encode_module(values, st, dtype, group=self.fused.join(module, values, st, expert)).values())
        outs[0].meta.setdefault("source", _sources(w))
        return _Piece(outs, Stored("quantized", label, name, st, fmt.weight.dtypes[0]), piece.values)


def _already(piece: _Piece, scheme: str, fmt, params, written) -> bool:
    """``piece`` is stored in ``scheme``'s format ``fmt`` with ``params``, its tensors the dtypes the encoder writes."""
    st = piece.stored.storage if piece.stored is not None else None
    if st is None or (st.scheme, st.format) != (scheme, fmt.name):
        return False
    dtypes = {sfx: t.dtype for sfx, t in zip(st.tensors, piece.tensors, strict=False)}
    same = {k: v for k, v in st.params.items() if k in params} == {k: params[k] for k in st.params if k in params}
    return same and all(dtypes.get(sfx) == dt for sfx, (dt, _) in written.items())


def _applies(when: str | None, params) -> bool:
    from ...model.expr import ExprError, evaluate

    try:
        return when is None or bool(evaluate(when, dict(params)))
    except ExprError:
        return False


def _diffs(report: GraftReport, target: Checkpoint, mtp: list[OutputTensor], drop: frozenset[str]) -> None:
    """Per key: added (the target lacked it), replaced (the target's own MTP tensor), removed (dropped)."""
    written = {t.key for t in mtp}
    for t in mtp:
        ref = target.tensors.get(t.key)
        if ref is None:
            report.diffs.append(TensorDiff(t.key, "added", None, t.dtype, None, list(t.shape)))
        else:
            report.diffs.append(TensorDiff(t.key, "replaced", ref.dtype, t.dtype, list(ref.shape), list(t.shape),
                                           unjudged="the source's MTP tensor replaces the target's"))
    for k in sorted(drop - written):
        ref = target.tensors[k]
        report.diffs.append(TensorDiff(k, "removed", ref.dtype, None, list(ref.shape), None))
    report.diffs.sort(key=lambda d: d.key)
