"""The writing verbs as functions: extract, stitch, graft, fuse_experts, unfuse_experts, init_draft, dequant.

Each opens its inputs, plans (``ckpt_tools.ops``), writes the output (unless ``dry_run``) and returns
a report whose ``to_json()`` is what ``ckpt VERB --json`` prints. Inputs are never modified; an
output that fails validation is an ``OutputError`` and is never marked complete.

Module level stays light (no numpy, torch or pydantic): ``from ckpt_tools import stitch`` costs
nothing until the verb runs.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import mtp_choice
from .options import Dequant, Extract, FuseExperts, Graft, InitDraft, Stitch, UnfuseExperts, keywords
from .report import Report, progress_sink

if TYPE_CHECKING:
    from pathlib import Path

    from ..ops.convert.dequant import DequantPlan
    from ..ops.convert.fuse_experts import ExpertsPlan
    from ..ops.draft.init_draft import InitSummary
    from ..ops.stitch import graft as _graft
    from ..ops.stitch import report as _stitch_report
    from ..ops.writing.execute import Outputs, Written
    from ..stream.plan import Plan
    from ..stream.progress import Progress
    from ..stream.targets import Output

PathArg = str | os.PathLike[str]
# a draft: a directory (or hf:// / file path), or tensors in memory (name -> tensor)
DraftArg = str | os.PathLike[str] | Mapping[str, Any]


# -- how the verb was invoked --------------------------------------------------------------


@dataclass(frozen=True)
class Invocation:
    """What the CLI adds to a call: the command line the manifest records, and what to do once the plan
    is made (say what --allow-invalid let in, before anything is written)."""

    command: str
    on_plan: Callable[[Plan], None] | None = None


_INVOKED: ContextVar[Invocation | None] = ContextVar("ckpt_tools_invocation", default=None)


@contextlib.contextmanager
def invocation(command: str, on_plan: Callable[[Plan], None] | None = None) -> Iterator[None]:
    """Calls inside record ``command`` (a CLI's command line) instead of the Python call, and call ``on_plan``."""
    token = _INVOKED.set(Invocation(command, on_plan))
    try:
        yield
    finally:
        _INVOKED.reset(token)


def _command(verb: Callable[..., Any], inputs: Sequence[object], options: Mapping[str, Any]) -> str:
    """The command line of this call: the CLI's, else the Python call with the options that differ from
    their defaults (what the manifest and the plan record to reproduce the output)."""
    invoked = _INVOKED.get()
    if invoked is not None:
        return invoked.command
    params = inspect.signature(verb).parameters
    given = [repr(os.fspath(i)) if isinstance(i, (str, os.PathLike)) else "None" if i is None else "<in memory>"
             for i in inputs]
    given += [f"{k}={v!r}" for k, v in options.items()
              if k in params and k != "progress" and params[k].kind is inspect.Parameter.KEYWORD_ONLY
              and v != params[k].default]
    return f"ckpt_tools.{verb.__name__}({', '.join(given)})"


def _planned(plan: Plan) -> None:
    invoked = _INVOKED.get()
    if invoked is not None and invoked.on_plan is not None:
        invoked.on_plan(plan)


@contextlib.contextmanager
def _progress(progress: bool) -> Iterator[Progress]:
    """The verb's progress sink; a display it started ends with the verb."""
    from ..stream.progress import end_progress

    try:
        yield progress_sink(progress)
    finally:
        if progress:
            end_progress()


# -- option parsing shared by the verbs ------------------------------------------------------


def _out(out: PathArg | None) -> Output | None:
    from ..stream.targets import output_location

    return None if out is None else output_location(out)


def _optional_path(path: PathArg | None) -> Path | None:
    from pathlib import Path

    return None if path is None else Path(path)


def _layers(layers: Sequence[int] | None) -> list[int] | None:
    """MTP depths: each an index below the MTP bound, none twice (the CLI's ``--layers 0,1``)."""
    if layers is None:
        return None
    from ..model.tables.resolve import MAX_MTP_LAYERS
    from ..options import index_list

    return index_list("--layers", ",".join(str(i) for i in layers), MAX_MTP_LAYERS - 1)


def _allow(allow_invalid: Sequence[str]) -> frozenset[str]:
    from ..model.consistency import parse_allow

    if isinstance(allow_invalid, str):  # one rule given bare: not its characters
        allow_invalid = [allow_invalid]
    return parse_allow(allow_invalid)


def _outputs(out: Output | None, dry_run: bool, plan_json: PathArg | None, report: PathArg | None = None,
             overwrite: bool = False, resume: bool = False) -> Outputs:
    from ..ops.writing.execute import Outputs

    # out is None only for a dry run (experts), where nothing is written
    return Outputs(out, dry_run, _optional_path(plan_json), _optional_path(report), overwrite, resume)  # type: ignore[arg-type]


# -- reports -----------------------------------------------------------------------------------


@dataclass
class ExtractReport(Report):
    """``ckpt extract``'s result. A dry run (``written`` None) reports the plan."""

    format: str
    plan: Plan
    written: Written | None
    validation: dict[str, Any] | None
    shared_from_trunk: dict[str, str] | None  # role -> trunk key carried where MTP has no per-layer copy
    # key -> dtype of the float tensors --dequant left as stored (not quantized, another dtype than asked)
    kept_dtype: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        if self.written is None:
            return self.plan.to_json()
        trunk = {"shared_from_trunk": self.shared_from_trunk} if self.shared_from_trunk is not None else {}
        kept = {"kept_dtype": self.kept_dtype} if self.kept_dtype else {}
        return {**self.written.to_json(), "format": self.format, **trunk, **kept, "validation": self.validation}


@dataclass
class InitDraftReport(Report):
    """``ckpt init-draft``'s result: the plan (dry run) or what was written, and what was initialised."""

    format: str
    plan: Plan
    init: InitSummary
    written: Written | None
    validation: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        if self.written is None:
            return {**self.plan.to_json(), "init": self.init.to_json()}
        return {**self.written.to_json(), "format": self.format, "init": self.init.to_json(),
                "validation": self.validation}


@dataclass
class ExpertsReport(Report):
    """``ckpt fuse-experts`` / ``unfuse-experts``' result: each expert group's layout before and after."""

    layout: str  # the target layout's label
    experts: ExpertsPlan
    written: Written | None
    validation: dict[str, Any] | None
    bytes_copied: int  # by byte range
    bytes_computed: int  # restacked or dequantized

    def to_json(self) -> dict[str, Any]:
        if self.written is None:
            return {**self.experts.summary(), "plan": self.experts.plan.to_json()}
        w = self.written
        return {"output": w.output, "layout": self.layout, "groups": [g.to_json() for g in self.experts.groups],
                "tensors": w.tensors, "bytes_written": w.bytes_written, "bytes_read": w.bytes_read,
                "bytes_copied": self.bytes_copied, "bytes_computed": self.bytes_computed, "files": w.files,
                "seconds": w.seconds, "validated": bool(self.validation)}


@dataclass
class DequantReport(Report):
    """``ckpt dequant``'s result: which modules were decoded (dry run: the plan), what was written."""

    dequant: DequantPlan
    written: Written | None
    validation: dict[str, Any] | None
    threads: int  # decoding threads used

    def to_json(self) -> dict[str, Any]:
        if self.written is None:
            return {**self.dequant.summary(), "plan": self.dequant.plan.to_json()}
        s = self.dequant.summary()
        keep = ("family", "scheme", "dtype", "scope", "modules", "storage", "dropped_tensors", "still_quantized",
                "link", "linked_shards", "rewritten_shards", "new_shards")
        return {**self.written.to_json(), **{k: s[k] for k in keep if k in s},
                "threads": self.threads, "validation": self.validation}


@dataclass
class StitchReport(Report):
    """``ckpt stitch``'s result: ``details`` is the stitch's own report (every MTP tensor's comparison and
    decision, the shards rewritten); it is also written into the output as ``stitch-report.json``."""

    details: _stitch_report.StitchReport
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return self.details.to_json()


@dataclass
class GraftReport(Report):
    """``ckpt graft``'s result: ``details`` is graft's own report (also ``graft-report.json`` in the output)."""

    details: _graft.GraftReport
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return self.details.to_json()


# -- the verbs -----------------------------------------------------------------------------------


@keywords(Extract)
def extract(source: PathArg, out: PathArg, *, arch: str | None = None, layers: Sequence[int] | None = None,
            format: str = Extract.format, with_embed: bool | None = None, with_head: bool | None = None,
            dtype: str = Extract.dtype, dequant: str | None = None, drop_mtp: bool = False,
            verifier_name: str | None = None, max_shard_size: int | str = Extract.max_shard_size, dry_run: bool = False,
            plan_json: PathArg | None = None, overwrite: bool = False, resume: bool = False,
            allow_invalid: Sequence[str] = (), progress: bool = False, threads: int | None = None) -> ExtractReport:
    """MTP layers of ``source`` into a standalone draft at ``out``, or with ``drop_mtp`` the trunk without them.
    llama.cpp's GGUF sidecar (``--format gguf``): ``extract_gguf``."""
    from ..ops.draft.extract import ExtractRequest, plan_extract
    from ..parallel import check_threads
    from ..stream.plan import parse_size

    check_threads(threads)  # before anything is opened
    command = _command(extract, (source, out), locals())
    allow = _allow(allow_invalid)
    dest = _out(out)
    req = ExtractRequest(arch=arch, layers=_layers(layers), format=format, with_embed=with_embed,
                         with_head=with_head, dtype=dtype, dequant=dequant, drop_mtp=drop_mtp,
                         max_shard_size=parse_size(max_shard_size), command=command, source=os.fspath(source),
                         verifier_name=verifier_name, allow_invalid=allow)
    plan, written, validation = _plan_and_write(source, lambda c: (plan_extract(c, req),) * 2, allow, progress,
                                                _outputs(dest, dry_run, plan_json, None, overwrite, resume), threads)
    return ExtractReport(format, plan, written, validation, plan.manifest.get("shared_from_trunk"),
                         plan.manifest.get("kept_dtype") or {})


@dataclass
class GgufReport(Report):
    """``ckpt extract --format gguf``'s result: the sidecar (None on a dry run), its tensors and its manifest."""

    path: str | None
    size: int | None
    manifest: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"format": "gguf", "path": self.path, "size": self.size, **self.manifest}


@keywords(Extract)
def extract_gguf(source: PathArg, out: PathArg, trunk: PathArg, *, gguf_type: str = Extract.gguf_type,
                 arch: str | None = None, dry_run: bool = False, overwrite: bool = False,
                 allow_invalid: Sequence[str] = (), prompts: PathArg | None = None,
                 max_drop: float = Extract.max_drop, depth: int = Extract.depth,
                 max_new_tokens: int = Extract.max_new_tokens) -> GgufReport:
    """The MTP sidecar llama.cpp loads beside ``trunk`` (``-m TRUNK -md OUT/mtp-NAME.gguf``), written into the
    directory ``out`` with its ckpt_manifest.json; everything is checked before a byte is written.
    ``gguf_type="auto"``: the smallest type whose acceptance on ``prompts`` is within ``max_drop`` of the MTP as
    stored at every depth up to ``depth`` (api.mtp_choice; the table in the manifest's ``mtp_quant_auto``)."""
    from pathlib import Path

    from ..errors import UsageError
    from ..io.checkpoint import Checkpoint
    from ..io.gguf_file import read_gguf
    from ..ops.draft.gguf_sidecar import GgufRequest, plan_sidecar, write_sidecar

    if "://" in os.fspath(out):
        raise UsageError(f"-o {os.fspath(out)}: a GGUF sidecar is written to a local directory")
    command = _command(extract_gguf, (source, out, trunk), locals())
    choice = _auto(gguf_type, "--gguf-type", prompts, max_drop, depth, max_new_tokens,
                   lambda how: mtp_choice.gguf_choice(source, how))
    if choice is not None:
        gguf_type = choice["chosen"].removeprefix("gguf-")
    req = GgufRequest(gguf_type=gguf_type, arch=arch, command=command, allow_invalid=_allow(allow_invalid))
    trunk_meta = read_gguf(trunk)
    with Checkpoint.open(source) as ckpt:
        plan = plan_sidecar(ckpt, trunk_meta, req)
        plan.manifest["command"] = command
        if choice is not None:
            plan.manifest["mtp_quant_auto"] = choice
        if dry_run:
            return GgufReport(None, None, plan.manifest)
        inputs = [os.fspath(trunk)] + ([os.fspath(source)] if "://" not in os.fspath(source) else [])
        path, size = write_sidecar(plan, Path(out), inputs, overwrite=overwrite)
    return GgufReport(str(path), size, plan.manifest)


@keywords(InitDraft)
def init_draft(target: PathArg, out: PathArg, *, arch: str | None = None, num_layers: int | None = None,
               seed: int = InitDraft.seed, std: float | None = None, from_layer: int | None = None,
               format: str = InitDraft.format, dtype: str = InitDraft.dtype, dequant: str | None = None,
               max_shard_size: int | str = InitDraft.max_shard_size, dry_run: bool = False,
               plan_json: PathArg | None = None, overwrite: bool = False, allow_invalid: Sequence[str] = (),
               progress: bool = False) -> InitDraftReport:
    """A draft whose dimensions match ``target`` (a checkpoint or its config.json): initialised from
    ``seed``, or warm-started from its decoder layer ``from_layer``."""
    from ..ops.draft.init_draft import InitRequest, check_request, plan_init
    from ..stream.plan import parse_size

    command = _command(init_draft, (target, out), locals())
    allow = _allow(allow_invalid)
    dest = _out(out)
    req = InitRequest(arch=arch, num_layers=num_layers, seed=seed, std=std, from_layer=from_layer, format=format,
                      dtype=dtype, dequant=dequant, max_shard_size=parse_size(max_shard_size), command=command,
                      allow_invalid=allow)
    check_request(req)  # before the target is opened
    outputs = _outputs(dest, dry_run, plan_json, None, overwrite)
    (plan, summary), written, validation = _plan_and_write(target, lambda c: ((r := plan_init(c, req))[0], r), allow,
                                                           progress, outputs)
    return InitDraftReport(format, plan, summary, written, validation)


def _experts(verb: Callable[..., ExpertsReport], name: str, source: PathArg, out: PathArg | None,
             options: dict[str, Any]) -> ExpertsReport:
    """fuse_experts / unfuse_experts: the same run, each with its own target layouts."""
    from ..errors import UsageError
    from ..ops.convert.fuse_experts import ExpertsRequest, plan_experts, stats, target_layout
    from ..parallel import check_threads
    from ..stream.plan import parse_size

    o = options
    command = _command(verb, (source, out), o)
    layout = target_layout(o["to"], name)
    check_threads(o["threads"])
    allow = _allow(o["allow_invalid"])
    if out is None and not o["dry_run"]:
        raise UsageError(f"{name} needs -o OUT (or --dry-run)")
    dest = _out(out)
    req = ExpertsRequest(layout, only_mtp=o["only_mtp"], arch=o["arch"], max_shard_size=parse_size(o["max_shard_size"]),
                         command=command, dequant=o["dequant"], allow_invalid=allow)
    outputs = _outputs(dest, o["dry_run"], o["plan_json"], None, o["overwrite"])
    xplan, written, validation = _plan_and_write(source, lambda c: ((x := plan_experts(c, req)).plan, x), allow,
                                                 o["progress"], outputs, o["threads"], o["arch"])
    moved = stats(xplan)
    return ExpertsReport(layout.label(), xplan, written, validation, moved["bytes_copied"], moved["bytes_computed"])


@keywords(FuseExperts)
def fuse_experts(source: PathArg, out: PathArg | None, *, to: str = FuseExperts.to, only_mtp: bool = False,
                 arch: str | None = None, max_shard_size: int | str = FuseExperts.max_shard_size, dry_run: bool = False,
                 plan_json: PathArg | None = None, overwrite: bool = False, dequant: str | None = None,
                 allow_invalid: Sequence[str] = (), progress: bool = False,
                 threads: int | None = None) -> ExpertsReport:
    """Routed experts stacked into one tensor per projection; ``out`` may be None for a dry run."""
    return _experts(fuse_experts, "fuse-experts", source, out, locals())


@keywords(UnfuseExperts)
def unfuse_experts(source: PathArg, out: PathArg | None, *, to: str = UnfuseExperts.to, only_mtp: bool = False,
                   arch: str | None = None, max_shard_size: int | str = UnfuseExperts.max_shard_size,
                   dry_run: bool = False, plan_json: PathArg | None = None, overwrite: bool = False,
                   dequant: str | None = None, allow_invalid: Sequence[str] = (), progress: bool = False,
                   threads: int | None = None) -> ExpertsReport:
    """Fused experts split apart again; ``out`` may be None for a dry run."""
    return _experts(unfuse_experts, "unfuse-experts", source, out, locals())


@keywords(Dequant)
def dequant(source: PathArg, out: PathArg | None, *, dtype: str = Dequant.dtype, only_mtp: bool = False,
            link: str | None = None, arch: str | None = None, max_shard_size: int | str = Dequant.max_shard_size,
            dry_run: bool = False, plan_json: PathArg | None = None, overwrite: bool = False, resume: bool = False,
            threads: int | None = None, allow_invalid: Sequence[str] = (), progress: bool = False) -> DequantReport:
    """Every quantized module of ``source`` (``only_mtp``: of its MTP layers) decoded, scales dropped, everything
    else copied. ``out`` may be None for a dry run."""
    from ..errors import UsageError
    from ..ops.convert.dequant import DequantRequest, plan_dequant
    from ..parallel import check_threads, decode_threads
    from ..stream.plan import parse_size

    command = _command(dequant, (source, out), locals())
    check_threads(threads)
    allow = _allow(allow_invalid)
    if out is None and not dry_run:
        raise UsageError("dequant needs -o OUT (or --dry-run)")
    dest = _out(out)
    req = DequantRequest(dtype=dtype, only_mtp=only_mtp, arch=arch, max_shard_size=parse_size(max_shard_size),
                         command=command, allow_invalid=allow, link=link)
    outputs = _outputs(dest, dry_run, plan_json, None, overwrite, resume)
    (dplan, used), written, validation = _plan_and_write(
        source, lambda c: ((d := plan_dequant(c, req)).plan, (d, decode_threads())), allow, progress, outputs, threads,
        arch)
    return DequantReport(dplan, written, validation, used)


@keywords(Stitch)
def stitch(draft: DraftArg, verifier: PathArg, out: PathArg, *, format: str = Stitch.format, mode: str = Stitch.mode,
           link: str = Stitch.link, allow_partial: bool = False, dtype: str = Stitch.dtype, update_copies: bool = False,
           keep_bf16: bool = False, arch: str | None = None, strip_prefix: str | None = None,
           layers: Sequence[int] | None = None, max_shard_size: int | str = Stitch.max_shard_size,
           accept_divergent: bool = False, dry_run: bool = False, plan_json: PathArg | None = None,
           report: PathArg | None = None, overwrite: bool = False, resume: bool = False,
           allow_invalid: Sequence[str] = (), progress: bool = False) -> StitchReport:
    """A finetuned ``draft`` (a directory, or name -> tensor in memory) stitched into ``verifier``: exact
    names, layout and dtypes, compared tensor by tensor.

    Errors are the tool's exceptions (``InputError``, ``UsageError``, ``OutputError``, ...), raised before
    anything is written whenever the inputs are at fault."""
    from ..errors import UsageError
    from ..ops.stitch.plan import StitchRequest, plan_stitch
    from ..stream.plan import parse_size

    command = _command(stitch, (draft, verifier, out), locals())
    dest = _out(out)
    depths = _layers(layers)
    allow = _allow(allow_invalid)
    if strip_prefix is not None and not strip_prefix:
        raise UsageError("--strip-prefix needs a non-empty prefix (e.g. --strip-prefix model.)")
    req = StitchRequest(format=format, mode=mode, link=link, allow_partial=allow_partial, dtype=dtype,
                        update_copies=update_copies, keep_bf16=keep_bf16, arch=arch, layers=depths,
                        max_shard_size=parse_size(max_shard_size), accept_divergent=accept_divergent,
                        strip_prefix=strip_prefix, command=command, allow_invalid=allow)
    details = _merge_and_write(plan_stitch, draft, verifier, req, "stitch-report.json", allow, progress,
                               lambda: _outputs(dest, dry_run, plan_json, report, overwrite, resume))
    return StitchReport(details, dry_run)


@keywords(Graft)
def graft(source: PathArg, target: PathArg, out: PathArg, *, mtp_dtype: str | None = None, mtp_quant: str | None = None,
          link: str = Graft.link, arch: str | None = None, max_shard_size: int | str = Graft.max_shard_size,
          dry_run: bool = False, plan_json: PathArg | None = None, report: PathArg | None = None,
          overwrite: bool = False, resume: bool = False, allow_invalid: Sequence[str] = (),
          progress: bool = False, prompts: PathArg | None = None, max_drop: float = Graft.max_drop,
          depth: int = Graft.depth, max_new_tokens: int = Graft.max_new_tokens) -> GraftReport:
    """``target`` (a converted checkpoint that lost its MTP) with ``source``'s MTP layers: config count and
    quantization config repaired. ``mtp_quant="auto"``: the smallest scheme the target declares whose acceptance
    on ``prompts`` is within ``max_drop`` of the MTP as stored at every depth up to ``depth``, else the MTP as
    stored (api.mtp_choice; the table in the report and manifest's ``mtp_quant_auto``)."""
    from ..ops.stitch.graft import GraftRequest, plan_graft
    from ..stream.plan import parse_size

    command = _command(graft, (source, target, out), locals())
    choice = _auto(mtp_quant, "--mtp-quant", prompts, max_drop, depth, max_new_tokens,
                   lambda how: mtp_choice.graft_choice(source, target, how))
    if choice is not None:
        mtp_quant = None if choice["chosen"] == mtp_choice.AS_STORED else choice["chosen"]
    allow = _allow(allow_invalid)
    dest = _out(out)
    req = GraftRequest(link=link, mtp_dtype=mtp_dtype, mtp_quant=mtp_quant, arch=arch,
                       max_shard_size=parse_size(max_shard_size), command=command, allow_invalid=allow,
                       check_values=not dry_run, measured=choice)
    details = _merge_and_write(plan_graft, source, target, req, "graft-report.json", allow, progress,
                               lambda: _outputs(dest, dry_run, plan_json, report, overwrite, resume))
    return GraftReport(details, dry_run)


def _plan_and_write(source: PathArg, planner: Callable[[Any], tuple[Plan, Any]], allow: frozenset[str], progress: bool,
                    outputs: Outputs, threads: int | None = None, arch: str | None = None) -> tuple[Any, Any, Any]:
    """extract / init_draft / dequant / (un)fuse_experts: open ``source``, plan (``planner(ckpt)`` -> the plan and
    the verb's own result), write with ``threads``; returns (that result, what was written, the validation)."""
    from ..io.checkpoint import Checkpoint
    from ..ops.writing.execute import bytes_read_so_far, write_plan
    from ..parallel import use_threads

    read_before = bytes_read_so_far()
    with _progress(progress) as sink, use_threads(threads):
        sink.phase("reading headers")
        with Checkpoint.open(source) as ckpt:
            sink.phase("planning")
            plan, result = planner(ckpt)
            _planned(plan)
            done = write_plan(plan, outputs, allow, sink, arch=arch, read_before=read_before)
    return (result, *(done if done is not None else (None, None)))


def _auto(value: str | None, option: str, prompts: PathArg | None, max_drop: float, depth: int, max_new_tokens: int,
          choose: Callable[[Any], dict[str, Any]]) -> dict[str, Any] | None:
    """``option auto``: ``choose(how)``'s record; None for a named storage (``prompts`` then has nothing to do)."""
    from ..errors import UsageError

    if value != "auto":
        if prompts is not None:
            raise UsageError(f"--prompts measures for {option} auto only", rule=mtp_choice.RULE)
        return None
    return choose(mtp_choice.Measure(option, prompts, max_drop, depth, max_new_tokens))


def _merge_and_write(planner: Callable[[Any, Any, Any], tuple[Plan, Any]], first: Any, second: Any, request: Any,
                     report_name: str, allow: frozenset[str], progress: bool, outputs: Callable[[], Outputs]) -> Any:
    """stitch / graft: open both inputs, plan the output from them (``planner(first, second, request)`` -> plan and
    the verb's report), then write it with the report as ``report_name``; returns that report."""
    from ..io.checkpoint import Checkpoint
    from ..ops.writing.execute import execute_and_report

    with _progress(progress) as sink:
        sink.phase("reading headers")
        with Checkpoint.open(first) as a, Checkpoint.open(second) as b:
            sink.phase("planning")
            plan, details = planner(a, b, request)
            _planned(plan)
            execute_and_report(plan, details, outputs(), allow, report_name, sink)
    return details
