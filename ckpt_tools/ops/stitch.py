"""Plans for `ckpt stitch`: a (finetuned) draft back into its verifier, exactly.

The draft's format gives the same correspondence extract used, run backwards: each
verifier MTP tensor is rebuilt from the draft in the verifier's own name, layer index,
expert layout and dtype. Before anything is written every candidate is compared with
the verifier's tensor: byte-identical ones are copied from the verifier (so an untouched
round trip reproduces the verifier's files), the others are reported with statistics,
and NaN / Inf is an error.

Replace mode rewrites only the shards that hold changed tensors (keeping their names
and tensor order); every other file is copied or linked. Add mode puts the MTP tensors
into new shards next to a verifier that has none, and updates index and config.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import __version__, transforms
from ..checkpoint import Checkpoint, raw_header, revision_of, source_name
from ..compare import TensorDiff, compare, count_nonfinite
from ..config import ConfigView
from ..consistency import count_field, note_allowed, require_consistent
from ..dtypes import FLOAT_DTYPES, FP8_DTYPES
from ..errors import InputError, PlanError, UsageError
from ..expert_layouts import ExpertGroup, scale_key
from ..fingerprint import record_inputs
from ..formats import Correspondence, Format, correspond, detect_format, get_format
from ..mtp import MtpView, choose_table, detect_group_layout
from ..plan import CopyBytes, OutputFile, OutputTensor, Plan, ShardLayout
from ..tables.resolve import Spec, resolve, trunk_specs
from .extract import _set_count, carried_files

if TYPE_CHECKING:
    from ..safetensors_io import TensorRef

LINK_MODES = ("copy", "reflink", "hardlink", "remote")
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
    command: str = "ckpt stitch"
    allow_invalid: frozenset[str] = frozenset()  # consistency rules the user lets through (--allow-invalid)


class Statistics:
    """Difference statistics being computed on worker threads; ``wait`` fills the report's diffs."""

    def __init__(self, pool, futures: list) -> None:
        self.pool, self.futures = pool, futures

    def wait(self) -> None:
        try:
            for f in self.futures:
                f.result()  # re-raises a read error from the worker
        finally:
            self.pool.shutdown(wait=True)

    def cancel(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class StitchReport:
    mode: str
    format: str
    family: str
    diffs: list[TensorDiff] = field(default_factory=list)
    kept_from_verifier: list[str] = field(default_factory=list)  # --allow-partial
    kept_copies: list[str] = field(default_factory=list)  # per-layer embed/head copies left as they were
    ignored_draft_keys: dict[str, str] = field(default_factory=dict)  # key -> reason
    copied_tensors: int = 0  # verifier tensors outside MTP, byte copies
    rewritten_shards: list[str] = field(default_factory=list)
    new_shards: list[str] = field(default_factory=list)
    linked_files: list[str] = field(default_factory=list)
    validation: dict | None = None
    statistics: Statistics | None = field(default=None, repr=False, compare=False)  # still being computed

    def totals(self) -> dict:
        counts: dict[str, int] = {}
        for d in self.diffs:
            counts[d.status] = counts.get(d.status, 0) + 1
        counts["copied (outside MTP)"] = self.copied_tensors
        return counts

    def to_json(self) -> dict:
        if self.statistics is not None:
            self.statistics.wait()
        return {
            "mode": self.mode,
            "format": self.format,
            "family": self.family,
            "totals": self.totals(),
            "tensors": [d.to_json() for d in self.diffs],
            "kept_from_verifier": self.kept_from_verifier,
            "kept_copies": self.kept_copies,
            "ignored_draft_keys": self.ignored_draft_keys,
            "rewritten_shards": self.rewritten_shards,
            "new_shards": self.new_shards,
            "linked_files": self.linked_files,
            **({"validation": self.validation} if self.validation is not None else {}),
        }


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


def _virtual_view(verifier: Checkpoint, table, count: int) -> MtpView:
    """What the verifier's MTP would look like with ``count`` layers (add mode)."""
    res = resolve(table, verifier.config, mtp_count=count)
    # Experts follow the trunk's layout on disk (a trunk with fused experts gets fused MTP experts).
    trunk_layouts = [detect_group_layout(g, verifier.tensors) for g in trunk_specs(res)[1]]
    layouts = {g.prefix: (trunk_layouts[0] if trunk_layouts else g.layout) for g in res.experts()}
    view = MtpView(verifier, res, layouts)
    view.present = res.mtp_specs(layouts)
    return view


def _dtype_of(view: MtpView, key: str, spec: Spec | None) -> str:
    ref = view.ckpt.tensors.get(key)
    if ref is not None:
        return ref.dtype
    return spec.dtype if spec is not None else view.resolved.dtype


class _Builder:
    """Turns correspondence links into verifier-named candidate tensors built from the draft."""

    def __init__(self, draft: Checkpoint, view: MtpView, corr: Correspondence, req: StitchRequest, add: bool):
        self.draft, self.view, self.corr, self.req, self.add = draft, view, corr, req, add
        self.res = view.resolved
        self.candidates: dict[str, OutputTensor] = {}
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.misshaped: list[str] = []
        self.removed: list[str] = []  # verifier keys dropped (scales under --keep-bf16)
        self.kept_fp8: set[str] = set()  # FP8 verifier tensors whose dequantized value the draft left alone

    def build(self) -> None:
        for link in self.corr.tensors:
            dref = self.draft.tensors.get(link.draft_key)
            if dref is None:
                if link.spec.optional:
                    continue
                self.missing.append(f"{link.draft_key} (for {link.verifier_key})")
                continue
            if tuple(dref.shape) != tuple(link.shape):
                self.misshaped.append(f"{link.draft_key}: draft {list(dref.shape)}, verifier {link.verifier_key} "
                                      f"{list(link.shape)}")
                continue
            self.used.add(link.draft_key)
            if link.columns:  # one draft fusion tensor back into the family's halves
                if dref.dtype in FP8_DTYPES:
                    raise PlanError(f"{link.draft_key} is FP8; splitting it into {link.verifier_keys()} needs a "
                                    "BF16 draft", rule="fp8-scale")
                whole = OutputTensor(link.draft_key, dref.dtype, dref.shape, CopyBytes([dref.segment()]),
                                     meta={"source": [link.draft_key], "role": link.spec.role})
                pieces = transforms.split_columns(whole, [(s.key, s.shape[-1]) for s in link.columns])
                for piece, spec in zip(pieces, link.columns, strict=True):
                    piece.meta["role"] = spec.role
                    self._finish(piece, None, spec)
                continue
            t = OutputTensor(link.verifier_key, dref.dtype, dref.shape, CopyBytes([dref.segment()]),
                             meta={"source": [link.draft_key], "role": link.spec.role})
            scale = self._draft_scale(link.draft_key, link.verifier_key)
            if link.swap_halves:
                t = transforms.swap_halves(t)
            self._finish(t, scale, link.spec)
        for link in self.corr.experts:
            self._experts(link.draft, link.verifier)

    def _draft_scale(self, draft_key: str, verifier_key: str) -> OutputTensor | None:
        dref = self.draft.tensors[draft_key]
        if dref.dtype not in FP8_DTYPES:
            return None
        skey = scale_key(draft_key, self.res.scale_suffix)
        sref = self.draft.tensors.get(skey)
        if sref is None:
            self.missing.append(f"{skey} (block scale of FP8 {draft_key})")
            return None
        self.used.add(skey)
        return OutputTensor(scale_key(verifier_key, self.res.scale_suffix), sref.dtype, sref.shape,
                            CopyBytes([sref.segment()]), meta={"source": [skey], "role": "scale"})

    def _experts(self, draft_group: ExpertGroup, verifier_group: ExpertGroup) -> None:
        layout = detect_group_layout(draft_group, self.draft.tensors)
        on_disk = draft_group.with_layout(layout, prefix=draft_group.prefix)
        keys = [t.key for t in on_disk.tensors()]
        absent = [k for k in keys if k not in self.draft.tensors]
        if absent:
            self.missing += [f"{k} (expert tensor)" for k in absent]
            return
        for et in on_disk.tensors():
            self.used.add(et.key)
            skey = scale_key(et.key, self.res.scale_suffix)
            if skey in self.draft.tensors:
                self.used.add(skey)
        from ..experts import convert_group

        outs = convert_group(on_disk, self.draft.tensors, verifier_group, scale_suffix=self.res.scale_suffix,
                             block=self.res.block_size)
        by_key = {t.key: t for t in outs}
        scales = {scale_key(t.key, self.res.scale_suffix) for t in outs if t.dtype in FP8_DTYPES}
        for t in outs:
            if t.key in scales:
                continue
            scale = by_key.get(scale_key(t.key, self.res.scale_suffix))
            self._finish(t, scale, None)

    def _finish(self, t: OutputTensor, scale: OutputTensor | None, spec: Spec | None) -> None:
        """Give ``t`` the verifier's dtype (cast, requantize, or keep FP8 bytes) and record it."""
        target = _dtype_of(self.view, t.key, spec)
        vscale_key = scale_key(t.key, self.res.scale_suffix)
        if self.req.dtype == "draft":
            target = t.dtype
        if target in FP8_DTYPES and not self.add:
            if self.req.keep_bf16:
                target = "BF16" if t.dtype in FP8_DTYPES else t.dtype
                if vscale_key in self.view.ckpt.tensors:
                    self.removed.append(vscale_key)
            elif t.dtype in FP8_DTYPES:
                self.candidates[t.key] = t  # FP8 draft into FP8 verifier: bytes and scale as they are
                if scale is not None:
                    self.candidates[scale.key] = scale
                return
            else:
                self._requantize(t)
                return
        if t.dtype in FP8_DTYPES:
            if scale is None:
                raise PlanError(f"FP8 draft tensor {t.key} has no scale to dequantize with", rule="fp8-scale")
            t = transforms.dequantize(t, scale, target if target in FLOAT_DTYPES else "BF16", self.res.block_size)
        elif target != t.dtype and target in FLOAT_DTYPES and t.dtype in FLOAT_DTYPES:
            t = transforms.cast(t, target)
        self.candidates[t.key] = t

    def _requantize(self, t: OutputTensor) -> None:
        """Draft values into an FP8 verifier tensor.

        When the draft equals the verifier's dequantized value (in the draft's dtype),
        the verifier's FP8 bytes and scale are kept exactly; otherwise the values are
        requantized (per-block amax / 448, round-to-nearest-even e4m3, saturating).
        """
        vref = self.view.ckpt.tensors[t.key]
        skey = scale_key(t.key, self.res.scale_suffix)
        sref = self.view.ckpt.tensors[skey]
        vq = OutputTensor(t.key, vref.dtype, vref.shape, CopyBytes([vref.segment()]))
        vs = OutputTensor(skey, sref.dtype, sref.shape, CopyBytes([sref.segment()]))
        if t.dtype in FLOAT_DTYPES:
            as_draft = transforms.dequantize(vq, vs, t.dtype, self.res.block_size)
            same = compare(t.key, t.dtype, t.shape, as_draft.recipe, t.dtype, t.shape, t.recipe, stats=False,
                           finite=False)
            if same.status == "unchanged":
                self.candidates[t.key] = OutputTensor(t.key, vref.dtype, vref.shape, vq.recipe, meta=t.meta)
                self.candidates[skey] = OutputTensor(skey, sref.dtype, sref.shape, vs.recipe,
                                                     meta={"role": "scale", "source": [skey]})
                self.kept_fp8.add(t.key)
                return
        w, s = transforms.requantize(t, self.res.block_size, skey)
        self.candidates[w.key] = w
        self.candidates[s.key] = s


def plan_stitch(draft: Checkpoint, verifier: Checkpoint, req: StitchRequest) -> tuple[Plan, StitchReport]:
    if req.link == "symlink":  # removed: links out of the output fail our own shard-path rule
        raise UsageError("--link symlink was removed: a symlinked output is not self-contained and every verb "
                         "refuses shards that resolve outside the checkpoint; use --link hardlink or --link reflink "
                         "(the same space saving)")
    if req.link not in LINK_MODES:
        raise UsageError(f"--link {req.link!r}: use one of {', '.join(LINK_MODES)}")
    if req.dtype not in ("verifier", "draft"):
        raise UsageError(f"--dtype {req.dtype!r}: use verifier or draft")
    if req.link == "remote" and verifier.local_dir is not None:
        raise UsageError("--link remote needs an hf:// verifier (its untouched shards stay on the Hub)")
    if draft.local_dir is not None and verifier.local_dir is not None and \
            draft.local_dir.resolve() == verifier.local_dir.resolve():
        raise UsageError("the draft and the verifier are the same directory")
    table = choose_table(verifier, req.arch)
    fmt = detect_format(draft.config.raw, draft.manifest) if req.format == "auto" else get_format(req.format)
    manifest = draft.manifest or {}
    if manifest.get("family") and manifest["family"] != table.family:
        raise InputError(f"the draft was extracted from a {manifest['family']} checkpoint; the verifier is "
                         f"{table.family}", rule="wrong-family")
    # mode selection: never a silent switch. Both inputs pass the consistency gate first (the draft: its
    # index and files; the verifier: every rule, as a whole model); auto mode only picks what the
    # verifier's config and tensors agree on.
    if req.mode not in ("auto", "replace", "add"):
        raise UsageError(f"--mode {req.mode!r}: use replace, add or auto")
    draft_gate = require_consistent(draft, scope="files", allow=req.allow_invalid, role="draft")
    vgate = require_consistent(verifier, table, allow=req.allow_invalid, scope="model", role="verifier",
                               waive=ADD_REPAIRS if req.mode == "add" else None, hints=STITCH_HINTS)
    declared = vgate.view
    mode = req.mode
    if mode == "auto":  # declared and absent gets here only with --allow-invalid mtp-missing: add them
        mode = "replace" if declared.count > 0 and declared.present else "add"
    if mode == "replace":
        if declared.count == 0:
            raise UsageError("the verifier declares no MTP layers; use --mode add")
        declared.require_complete()
        view = declared
        layers = _draft_layers(draft, fmt, req, view.count)
    elif mode == "add":
        if any(p.rule == "unindexed-key" for p in vgate.allowed):
            raise InputError("add mode copies the verifier's shards whole, so keys its index does not list would "
                             "stay in them; write a clean trunk first (`ckpt extract --drop-mtp --allow-invalid "
                             "unindexed-key`), then stitch into it", rule="unindexed-key", path=verifier.root)
        held = [s.key for s in declared.present] + declared.beyond + declared.extra
        if held:
            raise InputError(f"the verifier already holds {len(held)} MTP tensor(s) (e.g. {held[0]}), which add "
                             "mode would leave beside the new ones: use --mode replace (with "
                             f"{count_field(declared)} set to the layers it holds), or drop them first with "
                             "`ckpt extract --drop-mtp`", rule="mtp-exists", path=verifier.root)
        layers = _draft_layers(draft, fmt, req, _draft_count(draft, fmt, table))
        count = max(layers) + 1 if layers else 0
        if layers != list(range(count)):
            raise UsageError(f"add mode needs MTP layers 0..k-1, the draft maps to {layers}")
        view = _virtual_view(verifier, table, count)

    # replace: per-layer embed/head copies stay the verifier's unless --update-copies;
    # add: whatever the format carries (native drafts bring them), the rest is filled below
    copies = None if mode == "add" else req.update_copies
    corr = correspond(fmt, view, layers, with_embed=copies, with_head=copies)
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
        builder.candidates[spec.key] = OutputTensor(spec.key, src.dtype, src.shape, CopyBytes([src.segment()]),
                                                    meta={"source": ["verifier:" + src.key], "role": spec.role})
    report = StitchReport(mode, fmt.name, table.family)
    _check_draft(draft, fmt, builder, report, view, req.allow_partial)
    mtp_keys = set(declared.keys()) if mode == "replace" else set()
    copies = {k for k in mtp_keys if _is_copy(k, view)}
    report.kept_copies = sorted(copies - set(builder.candidates))
    absent = sorted(mtp_keys - set(builder.candidates) - set(builder.removed) - copies)
    if absent:
        if not req.allow_partial:
            raise InputError(f"the draft does not supply {len(absent)} verifier MTP tensor(s): "
                             + ", ".join(absent[:15]) + (" ..." if len(absent) > 15 else "")
                             + " (pass --allow-partial to keep the verifier's)", rule="missing-tensor")
        report.kept_from_verifier = absent
    _measure(builder, view, report, mode)
    plan = (_replace_plan if mode == "replace" else _add_plan)(draft, verifier, view, builder, req, report, fmt)
    note_allowed(plan.manifest, draft_gate, vgate)
    record_inputs(plan, verifier=verifier, draft=(draft, builder.used))  # --resume proves the same draft bytes
    return plan, report


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


def _is_copy(key: str, view: MtpView) -> bool:
    return any(s.key == key and s.role in ("embed", "head") for s in view.present)


def _check_draft(draft: Checkpoint, fmt: Format, builder: _Builder, report: StitchReport, view: MtpView,
                 allow_partial: bool) -> None:
    problems = []
    if builder.missing and not allow_partial:  # with --allow-partial the verifier's tensors stay
        problems.append(f"missing from the draft: {', '.join(builder.missing[:15])}"
                        + (" ..." if len(builder.missing) > 15 else ""))
    if builder.misshaped:
        problems.append(f"shape mismatch: {'; '.join(builder.misshaped[:10])}")
    shared = {s.key for s in view.resolved.shared.values()}
    shared |= {t.lstrip("/") for t in (fmt.embed, fmt.head) if t and t.startswith("/")}
    extra = []
    for key in draft.tensors:
        if key in builder.used:
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
        raise InputError(f"draft {draft.root} ({fmt.name} format) does not fit {view.table.family} verifier: "
                         + " | ".join(problems), rule="draft-mismatch")


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


def _measure(builder: _Builder, view: MtpView, report: StitchReport, mode: str) -> None:
    """Classify every candidate against the verifier's tensor before writing anything.

    This pass settles identity (bytes) and NaN/Inf in what would be written; the difference
    statistics of changed tensors are left to ``_start_statistics``, which runs while the
    writer copies. Tensors are compared on two threads: reads and numpy release the GIL.
    """
    from concurrent.futures import ThreadPoolExecutor

    ckpt = view.ckpt

    def one(item: tuple[str, OutputTensor]) -> TensorDiff:
        key, t = item
        vref = ckpt.tensors.get(key)
        if vref is None:
            return TensorDiff(key, "added", None, t.dtype, None, list(t.shape), nonfinite=_nonfinite(t))
        return compare(key, vref.dtype, vref.shape, CopyBytes([vref.segment()]), t.dtype, t.shape, t.recipe,
                       stats=False)

    with ThreadPoolExecutor(max_workers=2) as pool:
        diffs = list(pool.map(one, list(builder.candidates.items())))
    bad = []
    changed = []
    for d in diffs:
        t = builder.candidates[d.key]
        vref = ckpt.tensors.get(d.key)
        if d.status == "unchanged" and vref is not None:
            # byte-identical: write the verifier's own bytes (cheap, and provably the same)
            builder.candidates[d.key] = OutputTensor(d.key, vref.dtype, vref.shape, CopyBytes([vref.segment()]),
                                                     meta=t.meta)
        elif vref is not None and d.status in ("replaced", "dtype-changed"):
            changed.append((d, vref, t))
        if d.nonfinite:
            bad.append(f"{d.key} ({d.nonfinite} NaN/Inf)")
        report.diffs.append(d)
    for key in builder.removed:
        vref = ckpt.tensors[key]
        report.diffs.append(TensorDiff(key, "removed", vref.dtype, None, list(vref.shape), None))
    if bad:
        raise InputError(f"non-finite values in the draft: {', '.join(bad[:10])}", rule="nonfinite")
    report.diffs.sort(key=lambda d: d.key)
    report.statistics = _start_statistics(changed)


def _start_statistics(changed: list[tuple[TensorDiff, TensorRef, OutputTensor]]) -> Statistics:
    """max |delta|, relative L2 and cosine of every changed tensor, computed in the background."""
    from concurrent.futures import ThreadPoolExecutor

    def one(d: TensorDiff, vref: TensorRef, t: OutputTensor) -> None:
        full = compare(d.key, vref.dtype, vref.shape, CopyBytes([vref.segment()]), t.dtype, t.shape, t.recipe)
        d.max_abs, d.rel_l2, d.cosine = full.max_abs, full.rel_l2, full.cosine

    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-stats")
    return Statistics(pool, [pool.submit(one, *item) for item in changed])


def _nonfinite(t: OutputTensor) -> int:
    return count_nonfinite(t.recipe, t.dtype, t.shape)


def _changed(report: StitchReport) -> set[str]:
    return {d.key for d in report.diffs if d.status != "unchanged"}


def _replace_plan(draft, verifier: Checkpoint, view: MtpView, builder: _Builder, req, report: StitchReport, fmt):
    changed = _changed(report)
    removed = set(builder.removed)
    wm = verifier.index["weight_map"] if verifier.index else None
    tensors: list[OutputTensor] = []
    files: list[OutputFile] = []
    layouts: dict[str, ShardLayout] = {}
    for shard, keys in verifier.shard_keys.items():
        listed = [k for k in keys if wm is None or wm.get(k) == shard]
        # a whole-file copy would carry keys the index does not list (--allow-invalid unindexed-key): rewrite
        if not any(k in changed for k in listed) and len(listed) == len(keys):
            files.append(_untouched(verifier, shard, req.link, {k: verifier.tensors[k].nbytes for k in listed}))
            report.linked_files.append(shard)
            report.copied_tensors += sum(1 for k in listed if k not in builder.candidates)
            continue
        order = []
        for k in listed:
            if k in removed:
                continue
            if k in builder.candidates and k in changed:
                t = builder.candidates[k]
                tensors.append(OutputTensor(k, t.dtype, t.shape, t.recipe, shard=shard, meta=t.meta))
            else:
                ref = verifier.tensors[k]
                # the verifier's own bytes, copied unchanged
                tensors.append(OutputTensor(k, ref.dtype, ref.shape, CopyBytes([ref.segment()]), shard=shard,
                                            meta={"copied_from": "verifier"}))
                if k not in builder.candidates:
                    report.copied_tensors += 1
            order.append(k)
        layouts[shard] = ShardLayout(order=order, header_bytes=raw_header(verifier, shard))
        report.rewritten_shards.append(shard)
    config = _stitched_config(verifier, view, builder, req, mode="replace")
    files = _config_file(verifier, config) + files + carried_files(verifier)
    plan = Plan(req.command, tensors, files, inputs=_inputs(draft, verifier), max_shard_size=req.max_shard_size,
                manifest=_manifest(draft, verifier, report, fmt), shard_layouts=layouts)
    if verifier.index is None:
        plan.single_file_name = next(iter(verifier.shard_keys))
    return plan


def _add_plan(draft, verifier: Checkpoint, view: MtpView, builder: _Builder, req, report: StitchReport, fmt):
    from huggingface_hub import split_state_dict_into_shards_factory

    files: list[OutputFile] = []
    wm = verifier.index["weight_map"] if verifier.index else None
    single = verifier.index is None
    for shard, keys in verifier.shard_keys.items():
        listed = [k for k in keys if wm is None or wm.get(k) == shard]
        # a lone model.safetensors would hide the index from loaders: give it a sharded name
        name = "model-00001-of-00002.safetensors" if single else shard
        if single and req.link == "remote":
            raise UsageError("--link remote cannot rename the verifier's lone model.safetensors; use --link copy")
        files.append(_untouched(verifier, shard, req.link, {k: verifier.tensors[k].nbytes for k in listed}, name))
        report.linked_files.append(name)
        report.copied_tensors += len(listed)
    mtp = [builder.candidates[k] for k in sorted(builder.candidates)]
    if single:
        names = {t.key: "model-00002-of-00002.safetensors" for t in mtp}
    else:
        split = split_state_dict_into_shards_factory({t.key: t for t in mtp}, get_storage_size=lambda t: t.nbytes,
                                                     filename_pattern="model-mtp{suffix}.safetensors",
                                                     max_shard_size=req.max_shard_size)
        names = {k: f for f, ks in split.filename_to_tensors.items() for k in ks}
    tensors = [OutputTensor(t.key, t.dtype, t.shape, t.recipe, shard=names[t.key], meta=t.meta) for t in mtp]
    taken = {f.name for f in files}
    clash = taken & set(names.values())
    if clash:
        raise PlanError(f"new MTP shard name(s) {sorted(clash)} already exist in the verifier", rule="shard-name")
    report.new_shards = sorted(set(names.values()))
    config = _stitched_config(verifier, view, builder, req, mode="add")
    files = _config_file(verifier, config) + files + carried_files(verifier)
    return Plan(req.command, tensors, files, inputs=_inputs(draft, verifier), max_shard_size=req.max_shard_size,
                manifest=_manifest(draft, verifier, report, fmt))


def _untouched(verifier: Checkpoint, shard: str, link: str, tensors: dict[str, int], name: str | None = None
               ) -> OutputFile:
    """A verifier shard the stitch leaves alone: copied, linked, or (remote) left on the Hub."""
    if link == "remote":
        return OutputFile(name or shard, link="remote", remote=f"{verifier.root}/{shard}", tensors=tensors)
    return OutputFile(name or shard, source=verifier.file_path(shard), link=link, tensors=tensors)


def _stitched_config(verifier: Checkpoint, view: MtpView, builder: _Builder, req: StitchRequest, mode: str):
    """The verifier's config, with the MTP count (add mode) and quantization ignore list updated."""
    raw = verifier.config.raw
    config = raw
    if mode == "add":
        config = _set_count(view, raw, view.count)
    quant = ConfigView(config).get("quantization_config")
    unquantized_mtp = (mode == "add" and isinstance(quant, dict)) or (req.keep_bf16 and builder.removed)
    if unquantized_mtp and isinstance(quant, dict):
        config = ConfigView(config).with_values({}).raw  # deep copy
        q = ConfigView(config).get("quantization_config")
        prefixes = sorted({layer.prefix.rstrip(".") for layer in view.resolved.layers}
                          | {s.key.rsplit(".", 1)[0] for s in view.resolved.glue_specs() if s.depth is None})
        if isinstance(q.get("ignore"), list):  # compressed-tensors
            q["ignore"] = q["ignore"] + [f"re:^{re.escape(p)}\\..*" for p in prefixes
                                         if f"re:^{re.escape(p)}\\..*" not in q["ignore"]]
        else:  # transformers / vLLM fp8: modules_to_not_convert
            have = list(q.get("modules_to_not_convert") or [])
            q["modules_to_not_convert"] = have + [p for p in prefixes if p not in have]
    return config


def _config_file(verifier: Checkpoint, config: dict) -> list[OutputFile]:
    path = verifier.file_path("config.json") if verifier.local_dir is not None else None
    if config is verifier.config.raw and path is not None and path.is_file():
        return [OutputFile("config.json", source=path)]  # unchanged: byte-identical copy
    return [OutputFile("config.json", content=(json.dumps(config, indent=2) + "\n").encode())]


def _manifest(draft: Checkpoint, verifier: Checkpoint, report: StitchReport, fmt: Format) -> dict:
    return {
        "kind": "stitched",
        "verifier": {"path": source_name(verifier), "revision": revision_of(verifier)},
        "draft": {"path": source_name(draft), "format": fmt.name, "revision": revision_of(draft)},
        "family": report.family,
        "mode": report.mode,
        "totals": report.totals(),
        "tool_version": __version__,
    }


def _inputs(draft: Checkpoint, verifier: Checkpoint):
    return [c.local_dir for c in (draft, verifier) if c.local_dir is not None]
