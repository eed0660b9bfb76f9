"""The stitch plan: a (finetuned) draft back into its verifier, exactly.

The draft's format gives the correspondence extract used, run backwards: each verifier MTP tensor is
rebuilt from the draft in the verifier's own name, layer index, expert layout and dtype. Before
anything is written the draft must prove its family (``provenance.prove_family``), follow the dtype
policy (``_Builder``: floats replace floats, a quantized verifier weight is written in its storage by
its scheme table's encoder, integer / bool / complex tensors are refused) and pass the comparison
(``compare.decide``, ``compare.judge``).

Replace mode rewrites only the shards holding changed tensors (names and tensor order kept); every
other file is copied or linked. Add mode puts the MTP tensors into new shards next to a verifier that
has none, and updates index and config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ... import __version__
from ...dtypes import FLOAT_DTYPES
from ...errors import InputError, PlanError, UsageError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint, raw_header, revision_of, source_name
from ...model.consistency import count_field, note_allowed
from ...model.formats import Correspondence, correspond, detect_format, get_format, wrappers_of
from ...model.gate import require_consistent
from ...model.mtp import MtpView, choose_table, detect_group_layout
from ...model.prefixes import Unwrapped, unwrap
from ...model.provenance import manifest_claims, manifest_mismatch, manifest_unlike, prove_family
from ...model.quant.codec import checkpoint_codec
from ...model.quant.dequant import format_of
from ...model.quant.encode_plan import FusedGroups, encodable, encode_module
from ...model.quant.storage import Storage
from ...model.tables.resolve import Spec
from ...numeric import transforms
from ...stream.fingerprint import record_inputs, tensor_digest
from ...stream.plan import OutputFile, OutputTensor, Plan, ShardLayout, copy_of
from ..writing.add_mtp import mtp_into, require_indexed, virtual_view
from ..writing.carry import carried_files, check_inputs, untouched_file
from ..writing.moves import Mover, Rename, Restack, Split, Step
from ..writing.out_dtype import requested_for
from ..writing.output_config import config_files, repair_config, set_count
from .compare import Candidates, Decision, decide, judge
from .report import StitchReport

if TYPE_CHECKING:
    from ...model.consistency import Gate
    from ...model.formats import Format
    from ...model.tables.schema import Table

# --mode add writes every MTP tensor and sets the count to the draft's; a verifier holding any is refused
ADD_REPAIRS = {"mtp-missing": "--mode add adds the MTP layers and sets the count to the draft's"}
STITCH_HINTS = {"mtp-missing": "if the verifier ships no MTP weights, `--mode add` adds the draft's layers (and sets "
                               "the count to the draft's)"}


@dataclass
class StitchRequest:
    format: str = "auto"
    mode: str = "auto"  # auto | replace | add
    link: str = "copy"
    allow_partial: bool = False
    dtype: str = "verifier"  # verifier | draft
    update_copies: bool = False
    keep_bf16: bool = False
    arch: str | None = None
    layers: list[int] | None = None  # verifier MTP depths the draft's layers map to
    max_shard_size: int = 5 * 10**9
    accept_divergent: bool = False
    strip_prefix: str | None = None  # --strip-prefix: a wrapper prefix no table knows, stripped from every draft key
    command: str = "ckpt stitch"
    allow_invalid: frozenset[str] = frozenset()  # consistency rules the user lets through (--allow-invalid)


# ---------------------------------------------------------------------------


def _draft_layers(draft: Checkpoint, fmt: Format, req: StitchRequest, count: int) -> list[int]:
    if req.layers is not None:
        return req.layers
    manifest = draft.manifest or {}
    if isinstance(manifest.get("layers"), list) and manifest.get("kind") == "mtp-draft":
        return [int(i) for i in manifest["layers"]]
    if fmt.max_layers == 1 or fmt.rename != "native":
        return [0]
    return list(range(count))


class _Builder:
    """Turns correspondence links into verifier-named candidate tensors built from the draft.

    The dtype policy lives here (``take``): only float tensors (F16 / BF16 / F32 / F64, or weights in
    the draft's block format, read as values with their scales) replace float tensors, whatever ``--dtype``;
    a non-float verifier tensor is replaced only by one of its own dtype. A verifier weight stored quantized
    (any scheme table's format, block FP8 included) is written in that storage by the encoder its table
    names; what it cannot write (no encoder, another scale dtype), ``--keep-bf16`` or ``--dtype draft`` with
    a float draft goes in unquantized instead, its companions dropped, and the config's ignore list says so.
    Violations are collected and raised together.
    """

    def __init__(self, draft: Checkpoint, view: MtpView, corr: Correspondence, req: StitchRequest, add: bool):
        self.draft, self.view, self.corr, self.req, self.add = draft, view, corr, req, add
        self.res = view.resolved
        # the block formats (model.quant.codec) of the verifier's weights and of the draft's; a draft that
        # neither declares nor stores one is read in the verifier's
        self.vfmt = view.codec
        found = checkpoint_codec(draft)
        self.dfmt = found if found.how in ("stored", "declared") else self.vfmt
        # the draft's tensors in the verifier's names, scales named as the verifier names them
        self.mover = Mover(draft.tensors, self.dfmt, self.vfmt)
        self.out = Candidates({}, {}, [], self.vfmt)  # what it builds, as compare.decide judges it
        self.candidates, self.removed = self.out.tensors, self.out.removed
        self.placed: dict[str, str] = {}  # a dropped stored tensor -> the candidate written in its place
        self.fused = FusedGroups(view.table.fused_modules, self.res.dtype)  # shards sharing one per-tensor scale
        self.refusals: dict[str, list[str]] = {}  # rule -> problems
        self.refused_keys: dict[str, str] = {}  # rule -> the first verifier key it refused (the error's key)

    def build(self) -> None:
        """The correspondence run backwards as steps: each draft tensor renamed (a fusion tensor split back into the
        family's halves), each expert group restacked from the layout it has on disk into the verifier's."""
        steps: list[Step] = []
        for link in self.corr.tensors:
            if link.columns:
                steps.append(Split(link.draft_key, list(link.columns), link.spec, link.shape))
            else:
                steps.append(Rename(link.draft_key, link.verifier_key, link.spec, {"source": [link.draft_key],
                                    "role": link.spec.role}, link.swap_halves, link.shape))
        for link in self.corr.experts:
            layout = detect_group_layout(link.draft, self.draft.tensors)
            steps.append(Restack(link.draft.with_layout(layout, prefix=link.draft.prefix), link.verifier))
        self.mover.run(steps, self)

    def take(self, t: OutputTensor, scale: OutputTensor | None, spec: Spec | None, step: Step) -> None:
        """Give ``t`` the verifier's storage and record it: encoded as the verifier stores the module (the encoder
        its scheme table names, block FP8 included), else its float dtype (cast), else (a non-float verifier
        tensor) the draft's bytes. What the verifier stores in a format with no encoder, or what
        ``--keep-bf16`` / ``--dtype draft`` asks, goes in as float values in place of the stored tensors, and
        the config excludes the module."""
        stored = self._stored(t, spec)
        vref = self.view.ckpt.tensors.get(t.key)  # the verifier's dtype: its tensor's, else the table's
        vt = vref.dtype if vref is not None else spec.dtype if spec is not None else self.res.dtype
        if stored is not None:
            vt = t.dtype if t.dtype in FLOAT_DTYPES else "BF16"
        elif self.add and self.vfmt.stores(vt):
            vt = "BF16"  # add mode writes the MTP layers unquantized (and the ignore list says so)
        if spec is not None:
            t.meta["kind"] = spec.kind  # the divergence check leaves norms alone
        if not self._admit(t, vt):
            return
        if stored is not None and self._encodes(stored, t):  # written in the verifier's own storage format
            values = self._values(t, scale, "F32")
            if values is not None and self._same_storage(t, scale, stored):
                self._keep(t, scale, stored, values)  # re-encoding could round a second time: bytes as they are
            elif values is not None:
                self._encode(values, stored, spec)
            return
        if vt not in FLOAT_DTYPES:  # a non-float verifier tensor: the draft's bytes, same dtype (admitted)
            self.candidates[t.key] = t
            return
        # --dtype draft: the draft's float dtype, but for a dtype the table pins (the verifier's, as the table says)
        target = (requested_for(spec, t.dtype) or vt) if self.req.dtype == "draft" and t.dtype in FLOAT_DTYPES else vt
        t = self._values(t, scale, target)
        if t is None:
            return
        if target != t.dtype:
            t = transforms.cast(t, target)
        if stored is not None:
            self.removed += [k for k in stored.all_keys() if k != t.key]
            if stored.all_keys()[0] != t.key:
                self.placed[stored.all_keys()[0]] = t.key
        self.candidates[t.key] = t

    def _stored(self, t: OutputTensor, spec: Spec | None) -> Storage | None:
        """How the verifier stores ``t``'s module when quantized (None: float, or add mode): its view's storage,
        or for a stacked experts tensor (no module of its own) its block format's (``Codec.storage``)."""
        if self.add:
            return None
        stored = self.view.quantized.get(t.key)
        vref = self.view.ckpt.tensors.get(t.key)
        if stored is None and vref is not None and self.vfmt.stores(vref.dtype):
            stored = self.vfmt.storage(t.key, tuple(vref.shape), self.view.ckpt.tensors)
        return stored

    def _values(self, t: OutputTensor, scale: OutputTensor | None, dtype: str) -> OutputTensor | None:
        """``t`` as float values: a weight in the draft's block format decoded with its scale as ``dtype`` (a scale
        the decoder refuses, by dtype or grid, is a refusal naming it); any other tensor as it is."""
        if not self.dfmt.stores(t.dtype):
            return t
        if scale is None:
            return None  # recorded as missing (``Mover.scale``): the draft does not fit
        try:
            return self.dfmt.decode(t, scale, dtype)
        except PlanError as e:
            self._refuse(e.rule or "fp8-scale", f"{e.message} (draft {_source_of(scale)})", scale.key)
            return None

    def _encodes(self, stored: Storage, t: OutputTensor) -> bool:
        """The verifier's storage format has an encoder and the request keeps the verifier's storage (not
        ``--keep-bf16``, nor ``--dtype draft`` with a float draft tensor)."""
        draft_float = self.req.dtype == "draft" and t.dtype in FLOAT_DTYPES
        return encodable(stored, self.res.dtype, self.view.ckpt.tensors) is not None and not self.req.keep_bf16 \
            and not draft_float

    def _encode(self, t: OutputTensor, stored: Storage, spec: Spec | None) -> None:
        """The draft's values encoded as the verifier stores the module (its scheme table's encoder);
        ``compare.decide`` keeps the verifier's tensors when the values are its decoded ones."""
        expert = spec is None or spec.role == "expert"
        group = self.fused.join(stored.module, t, stored, expert)
        outs = encode_module(t, stored, self.res.dtype, self.view.ckpt.tensors, group)
        wkey = stored.tensors[format_of(stored).weight.suffix]
        self.candidates.update(outs)
        self.out.values[wkey] = t
        self.out.encoded[wkey] = stored
        self.out.companions[wkey] = [k for k in outs if k != wkey]

    def _same_storage(self, t: OutputTensor, scale: OutputTensor | None, stored: Storage) -> bool:
        """The draft holds ``t`` in the verifier's block format, tile and dtypes (weight and scale, same shapes)."""
        if scale is None or not self.dfmt.stores(t.dtype) or self.dfmt != self.vfmt or not self.vfmt.keeps_bytes:
            return False
        if (stored.scheme, stored.format) != (self.vfmt.scheme, self.vfmt.format):
            return False
        refs = self.view.ckpt.tensors
        w, s = refs.get(stored.tensors.get(format_of(stored).weight.suffix)), refs.get(
            stored.tensors.get(self.vfmt.scale_suffix))
        return w is not None and s is not None and (t.dtype, tuple(t.shape), scale.dtype, tuple(scale.shape)) == (
            w.dtype, tuple(w.shape), s.dtype, tuple(s.shape))

    def _keep(self, t: OutputTensor, scale: OutputTensor, stored: Storage, values: OutputTensor) -> None:
        """The draft's weight and scale bytes as they are, under the verifier's names; compared through their
        values like an encoded weight (``compare.decide``)."""
        wkey = stored.tensors[format_of(stored).weight.suffix]
        scale.key = stored.tensors[self.vfmt.scale_suffix]
        self.candidates[wkey], self.candidates[scale.key] = t, scale
        self.out.values[wkey] = values
        self.out.encoded[wkey] = stored
        self.out.companions[wkey] = [scale.key]
        self.out.as_stored.add(wkey)

    def _admit(self, t: OutputTensor, vt: str) -> bool:
        """Floats replace floats; a non-float verifier tensor only its own dtype."""
        src = _source_of(t)
        if vt not in FLOAT_DTYPES and not self.vfmt.stores(vt):
            if t.dtype == vt:
                return True
            return self._refuse("draft-dtype", f"{src} is {t.dtype}; the verifier's {t.key} is {vt}, which only "
                                               "a tensor of that dtype may replace", t.key)
        if t.dtype in FLOAT_DTYPES or self.dfmt.stores(t.dtype):
            return True
        return self._refuse("draft-dtype", f"{src} is {t.dtype}, not a float dtype; it cannot replace the "
                                           f"verifier's {vt} {t.key}", t.key)

    def _refuse(self, rule: str, problem: str, key: str) -> bool:
        self.refusals.setdefault(rule, []).append(problem)
        self.refused_keys.setdefault(rule, key)
        return False

    def raise_refusals(self) -> None:
        for rule, problems in self.refusals.items():
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise InputError(f"draft {self.draft.root}: " + "; ".join(problems[:10]) + more, rule=rule,
                             key=self.refused_keys.get(rule))


def _source_of(t: OutputTensor) -> str:
    """The draft key(s) a candidate comes from, for messages."""
    src = t.meta.get("source") or [t.key]
    return ", ".join(src[:3]) + (" ..." if len(src) > 3 else "") if isinstance(src, list) else str(src)


def mapped_draft(draft: Checkpoint, verifier: Checkpoint, arch: str | None, command: str) -> list[OutputTensor]:
    """The draft's tensors in the verifier's MTP names, layouts and dtypes, as stitch would write them (divergence
    accepted): how probe measures a draft without writing it."""
    plan, _ = plan_stitch(draft, verifier, StitchRequest(accept_divergent=True, arch=arch, command=command))
    return plan.tensors


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def plan_stitch(draft: Checkpoint, verifier: Checkpoint, req: StitchRequest) -> tuple[Plan, StitchReport]:
    """The stitch of ``draft`` into ``verifier``, in named steps: both inputs gated, the mode chosen, the draft's
    tensors built in the verifier's names and storage, what the draft leaves out accounted for, every candidate
    compared with the verifier's tensor, then the plan of the mode."""
    setup = _gated(draft, verifier, req)
    mode, view, layers = _choose_mode(setup, req)
    builder, unwrapped = _build(setup, view, mode, layers, req)
    draft = unwrapped.ckpt  # from here on, the draft's keys are the format's names
    report = StitchReport(mode, setup.fmt.name, setup.table.family, provenance=setup.provenance,
                          draft=_how_read(unwrapped))
    _check_draft(draft, setup.fmt, builder, report, view, req.allow_partial)
    builder.raise_refusals()
    _account(builder, view, setup.vgate.view if mode == "replace" else None, report, req)
    _decide(builder, view, report)
    no_manifest = _manifest_evidence(setup, unwrapped, builder, report, req)
    report.exempt = judge(report.decisions, {k: t.meta.get("kind") for k, t in builder.candidates.items()}, draft,
                          req.accept_divergent, no_manifest)
    plan = (_replace_plan if mode == "replace" else _add_plan)(draft, verifier, view, builder, req, report, setup.fmt)
    note_allowed(plan.manifest, setup.draft_gate, setup.vgate)
    # --resume proves the same draft bytes (their digests taken as they were compared)
    record_inputs(plan, verifier=verifier, draft=(draft, builder.mover.used), known=builder.out.digests)
    return plan, report


@dataclass
class _Setup:
    """The gated inputs: the verifier's family table, the draft's format, how the family was proved."""

    draft: Checkpoint
    verifier: Checkpoint
    table: Table
    fmt: Format
    provenance: str
    draft_gate: Gate
    vgate: Gate


def _gated(draft: Checkpoint, verifier: Checkpoint, req: StitchRequest) -> _Setup:
    """The request checked, the family and the draft's format found, and both inputs through the consistency gate
    (the draft: its index and files; the verifier: every rule, as a whole model)."""
    if req.dtype not in ("verifier", "draft"):
        raise UsageError(f"--dtype {req.dtype!r}: use verifier or draft")
    check_inputs(req.link, verifier, draft)
    table = choose_table(verifier, req.arch)
    fmt = (detect_format(draft.config.raw, draft.manifest, draft.tensors, req.strip_prefix) if req.format == "auto"
           else get_format(req.format))
    provenance = f"asserted with --arch {req.arch}" if req.arch else prove_family(draft, fmt, table, verifier)
    if req.mode not in ("auto", "replace", "add"):
        raise UsageError(f"--mode {req.mode!r}: use replace, add or auto")
    draft_gate = require_consistent(draft, scope="files", allow=req.allow_invalid, role="draft")
    vgate = require_consistent(verifier, table, allow=req.allow_invalid, scope="model", role="verifier",
                               waive=ADD_REPAIRS if req.mode == "add" else None, hints=STITCH_HINTS)
    return _Setup(draft, verifier, table, fmt, provenance, draft_gate, vgate)


def _choose_mode(setup: _Setup, req: StitchRequest) -> tuple[str, MtpView, list[int]]:
    """(mode, the verifier's MTP view to write into, the verifier depths the draft's layers map to). Never a silent
    switch: auto mode only picks what the verifier's config and tensors agree on."""
    declared, draft, fmt = setup.vgate.view, setup.draft, setup.fmt
    mode = req.mode
    if mode == "auto":  # declared and absent gets here only with --allow-invalid mtp-missing: add them
        mode = "replace" if declared.count > 0 and declared.present else "add"
    if mode == "replace":
        if declared.count == 0:
            raise UsageError("the verifier declares no MTP layers; use --mode add")
        declared.require_complete()
        return mode, declared, _draft_layers(draft, fmt, req, declared.count)
    require_indexed(setup.vgate, setup.verifier, "add mode")
    held = [s.key for s in declared.present] + declared.beyond + declared.extra
    if held:
        raise InputError(f"the verifier already holds {len(held)} MTP tensor(s) (e.g. {held[0]}), which add "
                         "mode would leave beside the new ones: use --mode replace (with "
                         f"{count_field(declared)} set to the layers it holds), or drop them first with "
                         "`ckpt extract --drop-mtp`", rule="mtp-exists", path=setup.verifier.root)
    layers = _draft_layers(draft, fmt, req, _draft_count(draft, fmt, setup.table))
    count = max(layers) + 1 if layers else 0
    if layers != list(range(count)):
        raise UsageError(f"add mode needs MTP layers 0..k-1, the draft maps to {layers}")
    return mode, virtual_view(declared, count), layers


def _build(setup: _Setup, view: MtpView, mode: str, layers: list[int], req: StitchRequest
           ) -> tuple[_Builder, Unwrapped]:
    """Every verifier MTP tensor the draft supplies, built in the verifier's names and storage (``_Builder``);
    add mode also fills the per-layer copies the release requires from the verifier's own shared tensors."""
    # replace: per-layer embed/head copies stay the verifier's unless --update-copies;
    # add: whatever the format carries (native drafts bring them), the rest is filled below
    copies = None if mode == "add" else req.update_copies
    corr = correspond(setup.fmt, view, layers, with_embed=copies, with_head=copies)
    unwrapped = _unwrap(setup.draft, corr, req)
    draft = unwrapped.ckpt
    shared_keys = {s.key for s in view.resolved.shared.values()}
    corr.tensors = [t for t in corr.tensors if t.verifier_key not in shared_keys]
    fill: list[Spec] = []
    if mode == "add":
        absent = [t for t in corr.tensors if t.draft_key not in draft.tensors and (t.spec.optional or t.spec.copy_of)]
        corr.tensors = [t for t in corr.tensors if t not in absent]
        linked = {t.verifier_key for t in corr.tensors}
        fill = [s for s in view.present if s.copy_of and not s.optional and s.key not in linked]
    builder = _Builder(draft, view, corr, req, add=mode == "add")
    builder.build()
    for spec in fill:  # a required per-layer copy: the verifier's own shared tensor, byte for byte
        src = _shared_source(view, spec)
        builder.candidates[spec.key] = copy_of(src, spec.key, {"source": ["verifier:" + src.key], "role": spec.role})
    return builder, unwrapped


def _account(builder: _Builder, view: MtpView, declared: MtpView | None, report: StitchReport,
             req: StitchRequest) -> None:
    """What the draft leaves out of the verifier's MTP (``declared``: replace mode's view): per-layer copies kept
    or absent (never invented), and any other tensor refused unless --allow-partial keeps the verifier's."""
    mtp_keys = set(declared.keys()) if declared is not None else set()
    copies = mtp_keys & {s.key for s in view.present if s.role in ("embed", "head")}  # one pass, not one per key
    report.kept_copies = sorted(copies - set(builder.candidates))
    # never invented: a copy the verifier does not have is written only when the draft brings it (add mode)
    report.absent_copies = sorted(s.key for s in view.resolved.glue_specs()
                                  if s.copy_of and s.key not in builder.candidates and s.key not in copies)
    absent = sorted(mtp_keys - set(builder.candidates) - set(builder.removed) - copies)
    if absent:
        if not req.allow_partial:
            raise InputError(f"the draft does not supply {len(absent)} verifier MTP tensor(s): "
                             + ", ".join(absent[:15]) + (" ..." if len(absent) > 15 else "")
                             + " (pass --allow-partial to keep the verifier's)", rule="missing-tensor")
        report.kept_from_verifier = absent


def _unwrap(draft: Checkpoint, corr: Correspondence, req: StitchRequest) -> Unwrapped:
    """The draft with the wrapper prefix of its keys stripped (prefixes.py), judged against the format's names."""
    fmt = corr.fmt
    known = set(corr.draft_keys()) | set(fmt.ignore_keys) | {s.key for s in corr.view.resolved.shared.values()}
    known |= {t[1:] for t in (fmt.embed, fmt.head) if t and t.startswith("/")}
    wrappers, origin = wrappers_of(fmt)
    return unwrap(draft, known, wrappers=wrappers, explicit=req.strip_prefix, origin=origin)


def _how_read(unwrapped: Unwrapped) -> dict:
    """What the report and manifest say about reading the draft."""
    d = unwrapped.ckpt
    return {"reader": d.reader, "reader_notes": list(d.reader_notes), "prefix_stripped": unwrapped.to_json()}


def _shared_source(view: MtpView, spec: Spec):
    """The verifier tensor a per-layer copy duplicates (a tied head is the embedding)."""
    shared = view.resolved.shared
    for name in (spec.copy_of, "embed"):
        s = shared.get(name or "")
        if s is not None and s.key in view.ckpt.tensors:
            ref = view.ckpt.tensors[s.key]
            if tuple(ref.shape) == tuple(spec.shape):
                return ref
    raise InputError(f"{spec.key} copies the verifier's {spec.copy_of}, which the verifier does not have",
                     rule="missing-tensor")


def _draft_count(draft: Checkpoint, fmt: Format, table) -> int:
    if fmt.rename == "native":
        cv = draft.config
        var = table.mtp.count_field
        if var:
            for k in table.config[var].keys:
                v = cv.get(k)
                if isinstance(v, int) and v > 0:
                    return v
    return 1


def _check_draft(draft: Checkpoint, fmt: Format, builder: _Builder, report: StitchReport, view: MtpView,
                 allow_partial: bool) -> None:
    problems = []
    if builder.mover.missing and not allow_partial:  # with --allow-partial the verifier's tensors stay
        problems.append(f"missing from the draft: {', '.join(builder.mover.missing[:15])}"
                        + (" ..." if len(builder.mover.missing) > 15 else ""))
    if builder.mover.misshaped:
        problems.append(f"shape mismatch: {'; '.join(builder.mover.misshaped[:10])}")
    shared = {s.key for s in view.resolved.shared.values()}
    shared |= {t.lstrip("/") for t in (fmt.embed, fmt.head) if t and t.startswith("/")}
    extra = []
    for key in draft.tensors:
        if key in builder.mover.used:
            continue
        if key in fmt.ignore_keys:
            report.ignored_draft_keys[key] = f"format {fmt.name} lists it as never stitched"
        elif key in shared or _is_draft_copy(key, fmt, view):
            report.ignored_draft_keys[key] = "embedding / head (shared tensors and their copies are kept)"
        else:
            extra.append(key)
    if extra:
        problems.append(f"{len(extra)} draft tensor(s) have no place in the verifier: {', '.join(extra[:15])}"
                        + (" ..." if len(extra) > 15 else ""))
    if problems:
        hint = _quantized_draft_hint(draft, builder.mover.missing)
        raise InputError(f"draft {draft.root} ({fmt.name} format) does not fit {view.table.family} verifier: "
                         + " | ".join(problems) + hint, rule="draft-mismatch")


def _quantized_draft_hint(draft: Checkpoint, missing: list[str]) -> str:
    """Drafts are float tensors: say so when the missing weights are stored quantized in the draft
    (a native extract of a quantized checkpoint keeps its packed tensors)."""
    from ...model.quant import module_storage

    for key in missing[:3]:
        module = key.split(" ", 1)[0].removesuffix(".weight")
        st = module_storage(draft, None, module)
        if st.quantized:
            return (f" | the draft stores {module} quantized ({st.label}); stitch takes float weights: "
                    f"`ckpt extract --dequant bf16` of the quantized checkpoint writes a draft it takes")
    return ""


def _is_draft_copy(key: str, fmt: Format, view: MtpView) -> bool:
    """A per-layer embed/head copy carried by the draft while copies are not being updated."""
    for layer in view.resolved.layers:
        for role in ("embed", "head"):
            spec = layer.glue.get(role)
            if spec is None:
                continue
            if fmt.rename == "native" and key == spec.key:
                return True
            if fmt.rename == "reprefix" and key.endswith(spec.key[len(layer.prefix):]):
                return True
    return False


def _decide(builder: _Builder, view: MtpView, report: StitchReport) -> None:
    """Every candidate compared with the verifier's tensor; an identical one is written from the
    verifier's own bytes (cheap, and provably the same)."""
    report.decisions = decide(view, builder.out)  # the draft's tensors hashed as they are compared (digests)
    _encode_partners(report.decisions, builder)
    report.diffs = [d.stats for d in report.decisions]
    for d in report.decisions:
        vref = view.ckpt.tensors.get(d.key)
        if d.action == "identical" and vref is not None:
            builder.candidates[d.key] = copy_of(vref, None, builder.candidates[d.key].meta)


def _manifest_evidence(setup: _Setup, unwrapped: Unwrapped, builder: _Builder, report: StitchReport,
                       req: StitchRequest) -> str | None:
    """Why the draft's manifest is not evidence (None: it is, or it claims nothing). It must list the tensors taken
    with their names, dtypes and shapes, or the family is proved again without it (``report.provenance``); an
    ``init`` claim needs their digests too (those the comparison read whole are not read again; the rest hashed here
    go to the fingerprint), or judge exempts nothing. A family claim alone hashes nothing."""
    draft = unwrapped.ckpt
    if not manifest_claims(draft):
        return None
    unlike = manifest_unlike(draft, builder.mover.used, unwrapped.prefix)
    why = unlike
    if why is None and isinstance((draft.manifest or {}).get("init"), dict):
        why = manifest_mismatch(draft, builder.mover.used, builder.out.digests, tensor_digest, unwrapped.prefix)
    if why is None:
        return None
    report.manifest = why
    if unlike and not req.arch and (setup.draft.manifest or {}).get("family"):  # the family came from it
        report.provenance = prove_family(setup.draft, setup.fmt, setup.table, setup.verifier, no_manifest=unlike)
    return why


def _encode_partners(decisions: list[Decision], builder: _Builder) -> None:
    """The shards of an engine-fused layer share one per-tensor scale (``FusedGroups``): when one is encoded
    anew, its unchanged partners are encoded again too (from their values, which are the verifier's), so the
    written shards agree on that scale."""
    by_key = {d.key: d for d in decisions}
    for keys in builder.fused.partners():
        if not any(by_key[k].action == "requantize" for k in keys):
            continue
        for k in keys:
            if by_key[k].action != "identical":
                continue
            for key in (k, *builder.out.companions.get(k, ())):
                d = by_key[key]
                d.action, d.stats.status = "requantize", "replaced"
                d.reason = ("encoded again: a shard of its fused layer changed, and the shards share one "
                            "per-tensor scale") if key == k else f"scale of {k}, follows it (requantize)"


def _replace_plan(draft, verifier: Checkpoint, view: MtpView, builder: _Builder, req, report: StitchReport, fmt):
    changed = {d.key for d in report.diffs if d.status != "unchanged"}
    removed = set(builder.removed)
    wm = verifier.index["weight_map"] if verifier.index else None
    tensors: list[OutputTensor] = []
    files: list[OutputFile] = []
    layouts: dict[str, ShardLayout] = {}
    for shard, keys in verifier.shard_keys.items():
        listed = [k for k in keys if wm is None or wm.get(k) == shard]
        # a whole-file copy would carry keys the index does not list (--allow-invalid unindexed-key): rewrite
        if not any(k in changed for k in listed) and len(listed) == len(keys):
            files.append(untouched_file(verifier, shard, req.link, {k: verifier.tensors[k].nbytes for k in listed}))
            report.linked_files.append(shard)
            report.copied_tensors += sum(1 for k in listed if k not in builder.candidates)
            continue
        order = []
        for k in listed:
            if k in removed and k not in builder.placed:
                continue
            key = builder.placed.get(k, k)  # written unquantized where the verifier stored it quantized
            t = builder.candidates.get(key) if k in builder.placed or k in changed else None
            if t is not None:
                tensors.append(OutputTensor(key, t.dtype, t.shape, t.recipe, shard=shard, meta=t.meta))
            else:  # the verifier's own bytes, copied unchanged
                tensors.append(copy_of(verifier.tensors[k], None, {"copied_from": "verifier"}, shard))
                report.copied_tensors += k not in builder.candidates
            order.append(key)
        layouts[shard] = ShardLayout(order=order, header_bytes=raw_header(verifier, shard))
        report.rewritten_shards.append(shard)
    config = _stitched_files(verifier, view, builder, "replace", report)
    files = config + files + [f for f in carried_files(verifier) if f.name not in {c.name for c in config}]
    plan = Plan(req.command, tensors, files, inputs=_inputs(draft, verifier), max_shard_size=req.max_shard_size,
                manifest=_manifest(draft, verifier, report, fmt), shard_layouts=layouts)
    if verifier.index is None:
        plan.single_file_name = next(iter(verifier.shard_keys))
    return plan


def _add_plan(draft, verifier: Checkpoint, view: MtpView, builder: _Builder, req, report: StitchReport, fmt):
    mtp = [builder.candidates[k] for k in sorted(builder.candidates)]
    files = _stitched_files(verifier, view, builder, "add", report)
    return mtp_into(verifier, mtp, files, req.link, req.max_shard_size, req.command, _inputs(draft, verifier),
                    _manifest(draft, verifier, report, fmt), report)


def _stitched_files(verifier: Checkpoint, view: MtpView, builder: _Builder, mode: str, report: StitchReport
                    ) -> list[OutputFile]:
    """config.json (MTP count in add mode) and the quantization config repaired wherever the stitch
    writes an MTP module unquantized that the config declares quantized (``quant.repair``)."""
    config = set_count(view, verifier.config.raw, view.count) if mode == "add" else verifier.config.raw
    written = {k: t.dtype for k, t in builder.candidates.items() if t.dtype in FLOAT_DTYPES}
    # replace mode judges only the modules whose storage changes (written unquantized where the verifier
    # stores them quantized: --keep-bf16, --dtype draft, a scheme this tool does not write)
    repaired = repair_config(verifier, view, config, written, changed_only=mode != "add")
    report.quant_config = repaired.to_json() if repaired.changed else None
    return config_files(verifier, config, repaired)


def _manifest(draft: Checkpoint, verifier: Checkpoint, report: StitchReport, fmt: Format) -> dict:
    return {
        "kind": "stitched",
        "verifier": {"path": source_name(verifier), "revision": revision_of(verifier)},
        "draft": {"path": source_name(draft), "format": fmt.name, "revision": revision_of(draft),
                  "provenance": report.provenance, **report.draft},
        "family": report.family,
        "mode": report.mode,
        "totals": report.totals(),
        "tool_version": __version__,
    }


def _inputs(draft: Checkpoint, verifier: Checkpoint):
    return [c.local_dir for c in (draft, verifier) if c.local_dir is not None]
