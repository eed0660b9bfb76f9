"""Plans for `ckpt init-draft`: a dimension-matched MTP draft, from scratch or warm-started.

The draft is first built in the family's native names: every MTP tensor the table
declares for the target's config (``resolve`` with the requested count), each either

* initialised (``init_values``: normal(0, std) projections, ones / zeros norms, zero
  biases - a pure function of (seed, name)),
* a byte copy of the target's shared embedding / head (per-layer copies), or
* with ``--from-layer L``, a byte copy of the target's decoder layer L under the MTP
  block's names.

Those tensors form a virtual checkpoint (initialised ones live in an ``InitSource``) and
a virtual MTP view; the draft format's correspondence then runs exactly as in
`ckpt extract`, so names, expert layouts and configs come from the format tables and
``init-draft --format X`` equals ``extract --format X`` of the native draft.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ... import __version__
from ...dtypes import FLOAT_DTYPES
from ...errors import InputError, UsageError
from ...gcpause import gc_paused
from ...io.checkpoint import Checkpoint, revision_of, source_name
from ...io.config import ConfigView
from ...io.safetensors_io import TensorRef
from ...model.consistency import MTP_RULES, note_allowed
from ...model.expert_layouts import ExpertLayout
from ...model.expr import evaluate, render
from ...model.formats import Correspondence, correspond, get_format
from ...model.gate import require_consistent
from ...model.mtp import MtpView, QuantLookup, detect_group_layout
from ...model.quant.codec import Codec, checkpoint_codec, storage_codec
from ...model.quant.detect import QuantScheme, detect_scheme
from ...model.quant.storage import module_storage
from ...model.tables.resolve import MAX_MTP_LAYERS, MAX_TRUNK_LAYERS, Resolved, Spec, part_specs, resolve, trunk_specs
from ...numeric.init_values import BAND_ELEMS, RNG_DESCRIPTION, InitRecipe, InitSource, produce
from ...options import MAX_SEED, int_in_range, positive_finite
from ...stream.fingerprint import record_inputs
from ...stream.plan import Compute, CopyBytes, OutputFile, OutputTensor, Plan
from ..writing.carry import carried_files
from ..writing.out_dtype import dtype_arg, requested_for
from ..writing.output_config import set_count
from .build import build_draft_config, draft_tensors, expert_groups, quantized_source

if TYPE_CHECKING:
    from ...model.formats import Format
    from ...model.tables.schema import Table

DEFAULT_STD = 0.02


@dataclass
class InitRequest:
    arch: str | None = None
    num_layers: int | None = None  # None: the config's MTP count, else 1
    seed: int = 0
    std: float | None = None  # None: the config's initializer_range, else 0.02
    from_layer: int | None = None
    format: str = "native"
    dtype: str = "keep"  # keep | bf16 | fp16 | fp32
    dequant: str | None = None  # --from-layer of an FP8 target into a format without scales
    max_shard_size: int = 5 * 10**9
    command: str = "ckpt init-draft"
    allow_invalid: frozenset[str] = frozenset()  # consistency rules the user lets through (--allow-invalid)


# init-draft reads no MTP tensor of its target: what is wrong there does not reach the draft
INIT_IGNORES = {rule: "init-draft reads no MTP tensor of the target" for rule in MTP_RULES}


@dataclass
class InitSummary:
    family: str
    table_kind: str
    count: int
    std: float
    std_from: str
    initialised: list[str]
    copied: dict[str, str]  # native MTP key -> target key
    left_out: list[str]

    def to_json(self) -> dict:
        return {"family": self.family, "table_kind": self.table_kind, "num_layers": self.count, "std": self.std,
                "std_from": self.std_from, "initialised": len(self.initialised), "copied_from_target": len(self.copied),
                "left_out": self.left_out}


def init_method(spec: Spec, table: Table) -> str:
    """normal | zeros | ones | copy, from the tensor's ``init`` field, else its ``kind``."""
    if spec.copy_of is not None or spec.init == "copy":
        return "copy"
    if spec.init is not None:
        return spec.init
    if spec.kind == "norm":
        return "zeros" if table.norm == "zero_centred" else "ones"
    if spec.kind == "bias":
        return "zeros"
    return "normal"  # linear, router, embedding, other


def check_request(req: InitRequest) -> None:
    """Option values, checked before the target is opened; each refusal names its option.

    The target-dependent bounds (a format's layer limit, the target's decoder layers, the dtypes
    the std must fit) are checked in ``plan_init``, still before anything is written.
    """
    if req.num_layers is not None:
        int_in_range("--num-layers", req.num_layers, 1, MAX_MTP_LAYERS, "the MTP layer bound")
    int_in_range("--seed", req.seed, 0, MAX_SEED)
    if req.std is not None:
        positive_finite("--std", req.std)
    if req.from_layer is not None:
        int_in_range("--from-layer", req.from_layer, 0, MAX_TRUNK_LAYERS - 1, "a decoder layer index")


def _std(req: InitRequest, target: Checkpoint) -> tuple[float, str]:
    if req.std is not None:
        return float(req.std), "--std"  # finite and positive (check_request)
    v = target.config.get("initializer_range")
    if v is None:
        return DEFAULT_STD, "default"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InputError(f"initializer_range = {v!r} is not a finite number above 0; pass --std X",
                         rule="config-field", path=f"{target.root}/config.json")
    return float(v), "initializer_range"


# |N(0, 1)| samples stay below this (P(|x| >= 16) ~ 1e-57): std * NORMAL_BOUND must fit the dtype.
NORMAL_BOUND = 16.0


@dataclass(frozen=True)
class _Range:
    max: float  # largest finite value
    tiny: float  # smallest normal value


# torch.finfo's values, without importing torch (init-draft computes in numpy only)
_FLOAT_RANGE = {
    "F16": _Range(65504.0, 2.0**-14),
    "BF16": _Range(float.fromhex("0x1.fep127"), 2.0**-126),
    "F32": _Range(float.fromhex("0x1.fffffep127"), 2.0**-126),
    "F64": _Range(float.fromhex("0x1.fffffffffffffp1023"), 2.0**-1022),
}


def _check_std_fits(std: float, std_from: str, dtypes: set[str], target: Checkpoint) -> None:
    """Normal values of this std must be finite, normal numbers in every dtype they are drawn into
    (float32 first, where they are scaled): no Inf from a huge std, no all-zero tensor from a tiny one."""
    for dtype in sorted((dtypes | {"F32"}) if dtypes else ()):
        info = _FLOAT_RANGE[dtype]
        if std * NORMAL_BOUND <= info.max and std >= info.tiny:
            continue
        why = (f"normal values of std {std:g} do not fit {dtype} (finite up to {info.max:g}, normal from "
               f"{info.tiny:g}); use a std from {info.tiny:g} to {info.max / NORMAL_BOUND:g}")
        if std_from == "--std":
            raise UsageError(f"--std {std:g}: {why}")
        raise InputError(f"initializer_range: {why}, or pass --std X", rule="config-field",
                         path=f"{target.root}/config.json")


def _count(declared: int, req: InitRequest, max_layers: int | None) -> int:
    if req.num_layers is not None:  # within 1..MAX_MTP_LAYERS (check_request)
        if max_layers is not None and req.num_layers > max_layers:
            raise UsageError(f"--format {req.format} holds at most {max_layers} MTP layer(s); "
                             f"pass --num-layers {max_layers} or --format native")
        return req.num_layers
    n = declared if declared > 0 else 1
    return min(n, max_layers) if max_layers is not None else n


def _config_sha256(target: Checkpoint) -> tuple[str, str]:
    """sha256 of the target's config.json bytes (or of its canonical JSON when remote)."""
    if target.local_dir is not None:
        path = target.local_dir / "config.json"
        if path.is_file():
            return hashlib.sha256(path.read_bytes()).hexdigest(), "file"
    canon = json.dumps(target.config.raw, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).hexdigest(), "canonical-json"


def _renamed(ref: TensorRef, key: str) -> TensorRef:
    return TensorRef(ref.source, key, ref.dtype, ref.shape, ref.offset, ref.nbytes)


# ---------------------------------------------------------------------------
# Expert layouts and --from-layer


def _trunk_layout(res: Resolved, target: Checkpoint) -> ExpertLayout | None:
    """The layout the target's own experts use on disk (None without weights or experts)."""
    if not target.tensors:
        return None
    groups = trunk_specs(res)[1]
    return detect_group_layout(groups[0], target.tensors) if groups else None


@dataclass
class _LayerMatch:
    """Target decoder layer L renamed onto the MTP block of every depth."""

    refs: dict[str, dict[str, TensorRef]]  # MTP key -> what it copies: the target tensor and its companions
    layouts: dict[str, ExpertLayout]


def _from_layer(res: Resolved, target: Checkpoint, layer: int, dequant: bool) -> _LayerMatch:
    table = res.table
    if not target.tensors:
        raise UsageError(f"--from-layer needs the target's weights; {target.root} has none (a config.json?)")
    blocks = max(len(layer.block_prefixes) for layer in res.layers)
    if blocks != 1:
        raise UsageError(f"--from-layer: {table.family} spreads one MTP step over {blocks} sub-blocks; a single "
                         "decoder layer cannot fill them")
    n = int(evaluate(table.trunk.count, res.env))
    if not 0 <= layer < n:
        raise UsageError(f"--from-layer {layer}: the target has decoder layers 0..{n - 1}")
    lenv = dict(res.env, l=layer)
    prefix = render(table.trunk.prefix, lenv)
    specs, groups = part_specs(table, table.trunk.parts, lenv, prefix, res.dtype, "trunk")
    src = {s.sub: s for s in specs}
    src_groups = {g.sub_prefix: g for g in groups}
    refs: dict[str, dict[str, TensorRef]] = {}
    layouts: dict[str, ExpertLayout] = {}
    fmt, scheme = checkpoint_codec(target, table.quantization), detect_scheme(target)
    for mtp_layer in res.layers:
        dst = {s.sub: s for s in mtp_layer.block}
        dst_groups = {g.sub_prefix: g for g in mtp_layer.experts}
        _check_same_parts(layer, prefix, src, dst, src_groups, dst_groups, mtp_layer.prefix)
        for sub, spec in dst.items():
            refs[spec.key] = _layer_refs(target, src[sub].key, spec.key, scheme, fmt, dequant)
        for sub, g in dst_groups.items():
            sg = src_groups[sub]
            lay = detect_group_layout(sg, target.tensors)
            layouts[g.prefix] = lay
            s_on, d_on = sg.with_layout(lay) if lay != sg.layout else sg, g.with_layout(lay) if lay != g.layout else g
            for st, dt in zip(s_on.tensors(), d_on.tensors(), strict=True):
                refs[dt.key] = _layer_refs(target, st.key, dt.key, scheme, fmt, dequant)
    return _LayerMatch(refs, layouts)


def _check_same_parts(layer, prefix, src, dst, src_groups, dst_groups, mtp_prefix) -> None:
    problems = []
    only_src = sorted(set(src) - set(dst))
    only_dst = sorted(set(dst) - set(src))
    if only_dst:
        problems.append(f"the MTP block needs {', '.join(only_dst[:8])} which layer {layer} lacks")
    if only_src:
        problems.append(f"layer {layer} has {', '.join(only_src[:8])} which the MTP block lacks")
    problems += [f"{sub}: layer {layer} {list(src[sub].shape)}, MTP block {list(dst[sub].shape)}"
                 for sub in sorted(set(src) & set(dst)) if src[sub].shape != dst[sub].shape]
    problems += [f"routed experts {sub} only in {'the MTP block' if sub in dst_groups else f'layer {layer}'}"
                 for sub in sorted(set(src_groups) ^ set(dst_groups))]
    for sub in sorted(set(src_groups) & set(dst_groups)):
        a, b = src_groups[sub], dst_groups[sub]
        if (a.count, a.hidden, a.inter, a.gated) != (b.count, b.hidden, b.inter, b.gated):
            problems.append(f"experts {sub}: layer {layer} E={a.count} I={a.inter}, MTP block E={b.count} I={b.inter}")
    if problems:
        raise InputError(f"--from-layer {layer}: {prefix}* does not have the parts of the MTP block "
                         f"{mtp_prefix}*: " + "; ".join(problems), rule="from-layer-mismatch")


def _layer_refs(target: Checkpoint, src_key: str, dst_key: str, scheme: QuantScheme | None, fmt: Codec,
                dequant: bool) -> dict[str, TensorRef]:
    """``src_key`` and what is stored with it (a module's companions as its scheme table lists them, a stacked
    experts tensor's scale as the target's codec names it), renamed onto ``dst_key``; a module whose codec
    cannot restack is copied only to be dequantized."""
    ref = target.tensors.get(src_key)
    stem, dst_stem = src_key.removesuffix(".weight"), dst_key.removesuffix(".weight")
    quantized = stem != src_key and (ref is None or ref.dtype not in FLOAT_DTYPES)
    st = module_storage(target, scheme, stem) if quantized else None
    keys, missing = [src_key], ()
    if st is not None and st.quantized:
        if not dequant and not storage_codec(st).restacks:  # kept as stored: weight and one tiled scale only
            why = storage_codec(st).refusal(st, "copy a layer as its weight and one tiled scale")
            raise InputError(f"--from-layer: {why}, or pass --dequant", rule="quant-capability", path=target.root,
                             key=src_key)
        keys, missing = st.all_keys(), st.missing
    elif ref is None:
        raise InputError(f"--from-layer: the target has no {src_key}", rule="missing-tensor", path=target.root)
    elif fmt.stores(ref.dtype):
        skey, _, sref = fmt.scale_of(src_key, ref.shape, target.tensors)
        keys, missing = [src_key, skey], () if sref is not None else (skey,)
    if missing:
        raise InputError(f"--from-layer: quantized weight {src_key} has no {', '.join(missing)}", rule="fp8-scale",
                         path=target.root)
    return {dst_stem + k[len(stem):]: _renamed(target.tensors[k], dst_stem + k[len(stem):]) for k in keys}


# ---------------------------------------------------------------------------
# The native draft as a virtual checkpoint


def _shared_source(spec: Spec, res: Resolved, target: Checkpoint) -> TensorRef | None:
    """The target tensor a per-layer copy duplicates (the embedding stands in for a tied head)."""
    shared = res.shared_source(spec.copy_of or spec.role)
    return target.tensors.get(shared.key) if shared is not None else None


@gc_paused()  # planning builds tens of thousands of objects, no cycles: see gcpause
def plan_init(target: Checkpoint, req: InitRequest) -> tuple[Plan, InitSummary]:
    check_request(req)
    gate = require_consistent(target, arch=req.arch, allow=req.allow_invalid, waive=INIT_IGNORES)
    table, declared = gate.table, gate.view.resolved
    fmt = get_format(req.format)
    count = _count(declared.mtp_count, req, fmt.max_layers)
    std, std_from = _std(req, target)
    gen_dtype = dtype_arg(req.dtype, "--dtype")
    dequant_to = dtype_arg(req.dequant, "--dequant")
    res = declared if count == declared.mtp_count else resolve(table, target.config, mtp_count=count)

    match = _from_layer(res, target, req.from_layer, dequant_to is not None) if req.from_layer is not None else None
    trunk_layout = _trunk_layout(res, target)
    layouts = {g.prefix: (match.layouts[g.prefix] if match else trunk_layout or g.layout) for g in res.experts()}
    native = _native_draft(res, target, match, layouts, gen_dtype, std, req.seed)
    _check_std_fits(std, std_from, {r.dtype for r in native.recipes if r.method == "normal"}, target)
    if native.missing_copies:
        raise InputError(
            f"{table.family} MTP layers carry per-layer copies of the target's embedding / head "
            f"({', '.join(native.missing_copies[:4])}), which the table requires and {target.root} has no weights "
            "to copy from: pass the checkpoint directory (with its weights) instead of its config.json",
            rule="copy-needs-weights")
    view, source = _virtual_view(target, res, layouts, native, declared.mtp_count, req.seed)

    corr = correspond(fmt, view, list(range(count)))
    tensors, config, omitted = _draft(fmt, view, corr, native, source, req, gen_dtype, dequant_to)
    files = [OutputFile("config.json", content=(json.dumps(config, indent=2) + "\n").encode())]
    if fmt.carry_files:  # tokenizer, generation config...; the target's model card describes the target
        files += [f for f in carried_files(target) if f.name.lower() != "readme.md"]
    summary = InitSummary(table.family, table.kind, count, std, std_from, [r.name for r in native.recipes],
                          native.copied, native.left_out)
    manifest = _manifest(target, req, table, corr, omitted, summary, gen_dtype)
    plan = record_inputs(Plan(req.command, tensors, files, max_shard_size=req.max_shard_size,
                              manifest=note_allowed(manifest, gate)), target=target)
    return plan, summary


@dataclass
class _NativeDraft:
    """The draft's tensors in the family's native names: copied from the target, or initialised."""

    refs: dict[str, TensorRef] = field(default_factory=dict)  # native key -> the target tensor it copies
    copied: dict[str, str] = field(default_factory=dict)  # native key -> target key
    recipes: list[InitRecipe] = field(default_factory=list)  # the initialised tensors
    present: list[Spec] = field(default_factory=list)  # every tensor the draft holds
    left_out: list[str] = field(default_factory=list)  # per-layer copies the target has no tensor for
    missing_copies: list[str] = field(default_factory=list)  # those of them the table requires


def _native_draft(res: Resolved, target: Checkpoint, match: _LayerMatch | None, layouts: dict[str, ExpertLayout],
                  gen_dtype: str | None, std: float, seed: int) -> _NativeDraft:
    """Every MTP tensor the table declares: a per-layer copy, a tensor of --from-layer, or initialised."""
    d = _NativeDraft()
    for spec in res.mtp_specs(layouts):
        method = init_method(spec, res.table)
        if method == "copy":
            ref = _shared_source(spec, res, target)
            if ref is None:
                if not spec.optional:
                    d.missing_copies.append(spec.key)
                d.left_out.append(spec.key)  # optional: engines take the shared tensor
                continue
            if tuple(ref.shape) != tuple(spec.shape):
                raise InputError(f"{ref.key} has shape {list(ref.shape)}; the per-layer copy {spec.key} needs "
                                 f"{list(spec.shape)}", rule="shape", path=target.root)
            d.refs[spec.key] = _renamed(ref, spec.key)
            d.copied[spec.key] = ref.key
        elif match is not None and spec.key in match.refs:
            d.refs.update(match.refs[spec.key])
            d.copied.update((k, r.key) for k, r in match.refs[spec.key].items())
        else:
            # a dtype the table pins is written as such whatever --dtype says
            dtype = requested_for(spec, gen_dtype) or spec.dtype
            d.recipes.append(InitRecipe(spec.key, dtype, tuple(spec.shape), method, std, seed))
        d.present.append(spec)
    return d


def _virtual_view(target: Checkpoint, res: Resolved, layouts: dict[str, ExpertLayout], native: _NativeDraft,
                  declared: int, seed: int) -> tuple[MtpView, InitSource]:
    """The native draft as a checkpoint of its own (initialised tensors read from an InitSource) and its view."""
    source = InitSource(native.recipes, name=f"<init-draft seed={seed}>")
    refs = dict(native.refs)
    for i, r in enumerate(native.recipes):
        refs[r.name] = TensorRef(source, r.name, r.dtype, r.shape, source.offset_of(i), r.nbytes)
    virtual = Checkpoint(target.root, target.config, refs, {}, None, list(target.files), local_dir=target.local_dir)
    view = MtpView(virtual, res, layouts)
    view.present = native.present
    # a weight --from-layer copies in a format that cannot restack is carried as its storage (to be dequantized); a
    # block format's weight and scale travel as the checkpoint's codec pairs them
    quant = QuantLookup(virtual, view.codec)
    view.quantized = {s.key: st for s in native.present
                      if (st := quant.storage(s, refs.get(s.key))) is not None and not storage_codec(st).restacks}
    if res.mtp_count != declared:
        virtual.config = ConfigView(set_count(view, target.config.raw, res.mtp_count))
    return view, source


def _draft(fmt: Format, view: MtpView, corr: Correspondence, native: _NativeDraft, source: InitSource,
           req: InitRequest, gen_dtype: str | None,
           dequant_to: str | None) -> tuple[list[OutputTensor], dict, list[str]]:
    """The draft's tensors in the format (as ``extract`` names them) and its config (with the fields omitted)."""
    tensors = draft_tensors(view, corr, gen_dtype, dequant_to)
    fp8 = quantized_source(view)
    if fp8 and dequant_to is None and fmt.rename == "roles":
        raise UsageError(f"layer {req.from_layer} of the target is FP8; format {fmt.name} has no place for block "
                         "scales: pass --dequant bf16")
    tensors = [_direct(t, source, native.copied) for t in tensors]
    if not any(view.codec.stores(t.dtype) for t in tensors) and \
            view.ckpt.config.get("quantization_config") is not None:
        # an FP8 target, a draft without FP8 tensors: its config must not declare FP8 weights
        config, omitted = build_draft_config(fmt, view, corr, tensors, dequant_to or gen_dtype or view.resolved.dtype,
                                             True)
    else:
        config, omitted = build_draft_config(fmt, view, corr, tensors, dequant_to, fp8)
    return tensors, config, omitted


def _manifest(target: Checkpoint, req: InitRequest, table: Table, corr: Correspondence, omitted: list[str],
              summary: InitSummary, gen_dtype: str | None) -> dict:
    """The draft's manifest: where it comes from, how it names things, and how it was initialised."""
    sha, sha_of = _config_sha256(target)
    return {
        "kind": "mtp-draft",
        "source": {"path": source_name(target), "revision": revision_of(target)},
        "family": table.family,
        "format": corr.fmt.name,
        "layers": corr.layers,
        "mtp_count_in_source": summary.count,
        "concat_order": corr.fmt.concat_order or table.mtp.concat_order,
        "expert_groups": expert_groups(corr),
        "config_fields_omitted": omitted,
        "init": _recipe_record(req, table, summary, sha, sha_of, gen_dtype),
        "tool_version": __version__,
    }


def _recipe_record(req: InitRequest, table: Table, summary: InitSummary, sha: str, sha_of: str, dtype) -> dict:
    import numpy as np

    return {
        "seed": req.seed,
        "std": summary.std,
        "std_from": summary.std_from,
        "from_layer": req.from_layer,
        "num_layers": summary.count,
        "table_kind": table.kind,
        "norm": table.norm,
        "dtype": dtype or "table",
        "target_config_sha256": sha,
        "target_config_hashed": sha_of,
        "rng": RNG_DESCRIPTION,
        "band_elems": BAND_ELEMS,
        "numpy": np.__version__,
        "torch": _torch_version(),  # whose casts the bf16 / f16 rounding reproduces
        "initialised_tensors": len(summary.initialised),
        "copied_from_target": len(summary.copied),
        "left_out": summary.left_out,
    }


def _torch_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def _direct(t: OutputTensor, source: InitSource, copied: dict[str, str]) -> OutputTensor:
    """Record where a draft tensor comes from; one that is a whole initialised tensor is generated
    straight into the writer (re-laid-out or half-swapped ones read the InitSource through their recipe)."""
    natives = t.meta.get("source") or []
    if natives and natives[0] in copied:
        t.meta["copied_from"] = [copied[k] for k in natives]
        return t
    t.meta.pop("source_dtype", None)
    t.meta["source"] = []  # nothing is read: the values are generated
    t.meta["init_from"] = natives  # the native tensors whose values these are (re-laid-out)
    rec = t.recipe
    if not (isinstance(rec, CopyBytes) and len(rec.segments) == 1 and rec.segments[0].source is source):
        return t
    seg = rec.segments[0]
    r = source.recipe_at(seg.offset)
    if r is None or r.nbytes != seg.length or r.dtype != t.dtype:
        return t
    t.meta.pop("init_from")
    t.meta["init"] = r.describe()
    return OutputTensor(t.key, t.dtype, t.shape, Compute(lambda: produce(r), "init", [], r.describe()), t.shard,
                        t.meta)
