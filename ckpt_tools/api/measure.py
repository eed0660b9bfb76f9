"""``probe``: measure that MTP layers draft, on the user's prompts, before anyone serves them.

The same run as ``ckpt probe`` (``ckpt_tools.ops.probe.probe``): per-depth agreement with the verifier's greedy
tokens, KL to its distribution, and that ``generate(use_mtp=True)`` equals plain greedy. A greedy
mismatch, or a depth-1 agreement below ``min_acceptance``, raises ``CheckFailed`` carrying the report.
Needs the ``probe`` extra (transformers); torch and transformers load when the verb runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..ops.probe import mtp_quant as _probe_mtp_quant
from ..ops.probe import probe as _probe
from .options import Probe, keywords
from .report import Report, progress_sink

PathArg = str | os.PathLike[str]
# a draft: a directory in any format stitch accepts, or its tensors in memory (name -> tensor)
DraftArg = str | os.PathLike[str] | Mapping[str, Any]
Callback = Callable[[int, int], None]


@dataclass
class ProbeReport(_probe.ProbeResult, Report):
    """``ckpt probe --json``: per draft (the verifier's own MTP first) agreement and KL per depth, positions,
    greedy equality (and the first mismatch), per-prompt numbers; the prompts and the memory the verifier needs;
    how its trunk and MTP layers loaded (``loaded``, ``mtp_loaded``: as stored by transformers, or dequantized by
    ckpt-tools' decoders)."""

    min_acceptance: float | None = None  # the depth-1 agreement asked for (not in to_json: the CLI's option)

    def greedy_mismatches(self) -> list[_probe.DraftResult]:
        """The MTPs whose speculative generation differs from plain greedy."""
        return [d for d in self.drafts if not d.greedy_equal]

    def below_min_acceptance(self) -> list[_probe.DraftResult]:
        """The drafts compared (the verifier's own MTP when there is none) whose depth-1 agreement is below
        ``min_acceptance``."""
        if self.min_acceptance is None:
            return []
        # the verifier's own MTP is named "verifier"; --engine llama.cpp measures a trunk without one too
        checked = [d for d in self.drafts if d.name != "verifier"] or self.drafts[:1]
        return [d for d in checked if d.agreement[0] < self.min_acceptance]

    def failures(self) -> list[str]:
        """One line per failed check (empty: the probe passed)."""
        lines = [f"{d.name}: generate(use_mtp=True) differs from greedy at prompt {d.mismatch['prompt']}, "
                 f"generated position {d.mismatch['position']}" for d in self.greedy_mismatches() if d.mismatch]
        lines += [f"{d.name}: depth-1 agreement {d.agreement[0]:.4f} is below --min-acceptance {self.min_acceptance}"
                  for d in self.below_min_acceptance()]
        return lines


# -- how the verb was invoked (the CLI's displays) ----------------------------------------------------------


@dataclass(frozen=True)
class Display:
    """What the CLI shows while probing: a bar over prompts (``bar(done, total)``) and the memory the
    weights need before they load (``announce(needed, available)``; available 0: unknown)."""

    bar: Callback | None = None
    announce: Callback | None = None


_DISPLAY: ContextVar[Display | None] = ContextVar("ckpt_tools_probe_display", default=None)


@contextlib.contextmanager
def displaying(bar: Callback | None, announce: Callback | None) -> Iterator[None]:
    """Calls inside show progress with the CLI's ``bar`` and ``announce`` instead of the library's."""
    token = _DISPLAY.set(Display(bar, announce))
    try:
        yield
    finally:
        _DISPLAY.reset(token)


@contextlib.contextmanager
def _display(progress: bool) -> Iterator[Display]:
    """The CLI's display when it set one; else the library's (``progress=True``): the phase, then the prompt
    being measured, on stderr, ended with the verb."""
    shown = _DISPLAY.get()
    if shown is not None or not progress:
        yield shown or Display()
        return
    from ..stream.progress import end_progress

    sink = progress_sink(True)

    def announce(need: int, available: int) -> None:
        sink.phase(f"loading the verifier ({need} bytes)")

    def bar(done: int, total: int) -> None:
        sink.phase(f"prompt {min(done + 1, total)}/{total}")

    try:
        yield Display(bar, announce)
    finally:
        end_progress()


@contextlib.contextmanager
def _quiet_transformers(quiet: bool) -> Iterator[None]:
    """Without progress, transformers' own bars (loading weights) stay off stderr too."""
    if not quiet:
        yield
        return
    from transformers.utils import logging

    tf_logging: Any = logging  # transformers is untyped
    was = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tf_logging.enable_progress_bar()


# -- the verb -----------------------------------------------------------------------------------------------


def _check_acceptance(min_acceptance: float | None) -> None:
    from ..errors import UsageError

    if min_acceptance is not None and not 0 <= min_acceptance <= 1:  # nan fails both comparisons
        raise UsageError(f"--min-acceptance {min_acceptance!r}: expected a number from 0 to 1")


@keywords(Probe)
def probe(verifier: PathArg, *, drafts: Sequence[DraftArg] = (), prompts: PathArg | None = None,
          max_new_tokens: int = Probe.max_new_tokens, depth: int = Probe.depth, device: str = Probe.device,
          dtype: str = Probe.dtype, chain: str = Probe.chain, min_acceptance: float | None = None,
          report: PathArg | None = None, arch: str | None = None, progress: bool = False, engine: str = Probe.engine,
          tensor_parallel_size: int = Probe.tensor_parallel_size,
          pipeline_parallel_size: int = Probe.pipeline_parallel_size, distributed_executor_backend: str | None = None,
          work_dir: PathArg | None = None, max_model_len: int | None = None, attention_backend: str | None = None,
          plot: PathArg | None = None, llama_cpp: PathArg | None = None, threads: int = Probe.threads,
          mtp_quant: str | Sequence[str] | None = None) -> ProbeReport:
    """Measure ``verifier``'s own MTP layers and each of ``drafts`` (directories in any format stitch accepts, or
    name -> tensor mappings in memory) on ``prompts`` (None: three built-in prompts). The report names what was
    measured: the digest of each MTP's checkpoint's tensors (``tensors``), dtype, device and the prompts file's sha256.

    Raises ``CheckFailed`` (its ``report`` a ``ProbeReport``) on a greedy mismatch or when a draft's depth-1 agreement
    is below ``min_acceptance``; ``InputError`` for a verifier or draft that cannot be used; ``UsageError`` for a bad
    option or a missing extra.
    """
    from ..errors import CheckFailed, UsageError
    from ..jsonutil import write_json_file
    from ..ops.probe.numbers import check_finite
    from ..options import outside_inputs

    _check_acceptance(min_acceptance)
    draft_list: list[Any] = [os.fspath(d) if isinstance(d, (str, os.PathLike)) else d for d in drafts]
    paths = [os.fspath(verifier), *(d for d in draft_list if isinstance(d, str))]  # inputs on disk
    if report is not None:
        outside_inputs("--report", report, paths)  # before anything is loaded
    if plot is not None:
        from ..ops.probe.plot import matplotlib_pyplot

        outside_inputs("--plot", plot, paths)
        matplotlib_pyplot()  # a missing extra is one line, before anything is measured
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: use {' or '.join(ENGINES)}")
    schemes = None if mtp_quant is None else _probe_mtp_quant.parse_schemes(mtp_quant)
    if schemes is not None and engine != "transformers":
        raise UsageError(f"--mtp-quant measures with the table engine: use --engine transformers, not {engine}")
    if engine == "llama.cpp":
        result = _probe_llama_cpp(verifier, draft_list, prompts, max_new_tokens, depth, device, dtype, progress,
                                  llama_cpp, threads)
    elif engine == "vllm":
        result = _probe_vllm(verifier, draft_list, prompts, max_new_tokens, depth, device, dtype, arch, progress,
                             tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend, work_dir,
                             max_model_len, attention_backend)
    else:
        resolved = _probe.resolve_device(device)
        _probe.transformers_module()  # a missing extra is one line, before anything else
        from ..ops.stitch.plan import mapped_draft
        from .mtp_choice import encode_mtp

        req = _probe.ProbeRequest(os.fspath(verifier), draft_list,
                                  None if prompts is None else os.fspath(prompts), max_new_tokens, depth, resolved,
                                  dtype, chain, arch=arch, map_draft=mapped_draft, mtp_quant=schemes or [],
                                  encode_mtp=encode_mtp)
        with _display(progress) as display, _quiet_transformers(not progress):
            result = _probe.probe(req, display.bar, display.announce)
    check_finite(result, os.fspath(verifier))  # a NaN is no measurement: refused, never reported
    out = ProbeReport(**{f.name: getattr(result, f.name) for f in fields(result)}, min_acceptance=min_acceptance)
    if plot is not None:
        from ..ops.probe.plot import draw

        draw(out.to_json(), plot)
        out.plot = _relative(plot, report)
    if report is not None:
        write_json_file(report, out.to_json(), "--report", paths)
    failed = out.failures()
    if failed:
        raise CheckFailed("; ".join(failed), report=out)
    return out


ENGINES = ("transformers", "vllm", "llama.cpp")


def _relative(plot: PathArg, report: PathArg | None) -> str:
    """The plot's path as the report records it: relative to the report's directory (they travel together)."""
    if report is None:
        return os.fspath(plot)
    return os.path.relpath(Path(plot).resolve(), Path(report).resolve().parent)


def _probe_vllm(verifier: PathArg, drafts: list[Any], prompts: PathArg | None, max_new_tokens: int, depth: int,
                device: str, dtype: str, arch: str | None, progress: bool, tensor_parallel_size: int,
                pipeline_parallel_size: int, backend: str | None, work_dir: PathArg | None,
                max_model_len: int | None, attention_backend: str | None) -> _probe.ProbeResult:
    """``engine="vllm"``: vLLM serves the verifier, and each draft stitched into a copy of it whose untouched
    shards are hard links under ``work_dir`` (removed afterwards); ops/probe/vllm.py measures."""
    from ..errors import UsageError
    from ..ops.probe.vllm import VllmOptions, check_inputs, check_options, probe_vllm, vllm_module

    if any(not isinstance(d, str) for d in drafts):
        raise UsageError("--engine vllm serves drafts from directories (a draft in memory has no files to serve)")
    opts = VllmOptions(tensor_parallel_size, pipeline_parallel_size, backend, max_model_len, attention_backend)
    req = _probe.ProbeRequest(os.fspath(verifier), drafts, None if prompts is None else os.fspath(prompts),
                              max_new_tokens, depth, device, dtype, "vllm", arch=arch)
    check_options(req, opts)
    vllm_module()  # a missing extra is one line, before anything else
    check_inputs(req, opts)
    with _stitched_drafts(verifier, drafts, arch, work_dir) as served, _display(progress) as display:
        result = probe_vllm(req, opts, served, display.bar)
    return _probe.name_measured(result, req)  # the drafts' own files, not the stitched copies served


def _probe_llama_cpp(verifier: PathArg, drafts: list[Any], prompts: PathArg | None, max_new_tokens: int, depth: int,
                     device: str, dtype: str, progress: bool, llama_cpp: PathArg | None,
                     threads: int) -> _probe.ProbeResult:
    """``engine="llama.cpp"``: llama.cpp serves the verifier GGUF's own MTP and each sidecar GGUF beside it;
    ops/probe/llama_cpp.py measures. The GGUF files are measured as they are (``dtype`` is theirs)."""
    from ..errors import UsageError
    from ..ops.probe.llama_cpp import LlamaCppOptions, probe_llama_cpp

    if any(not isinstance(d, str) for d in drafts):
        raise UsageError("--engine llama.cpp measures drafts from GGUF files (a draft in memory has no files)")
    req = _probe.ProbeRequest(os.fspath(verifier), drafts, None if prompts is None else os.fspath(prompts),
                              max_new_tokens, depth, device, dtype, "llama.cpp")
    opts = LlamaCppOptions(None if llama_cpp is None else os.fspath(llama_cpp), threads)
    with _display(progress) as display:
        result = probe_llama_cpp(req, opts, display.bar)
    result.device, result.max_new_tokens = "cpu", max_new_tokens
    result.prompts_sha256 = _probe.prompts_sha256(req.prompts)
    return result


@contextlib.contextmanager
def _stitched_drafts(verifier: PathArg, drafts: list[str], arch: str | None,
                     work_dir: PathArg | None) -> Iterator[list[tuple[str, Path]]]:
    """Each draft stitched into the verifier (divergent drafts too: they are measured, not shipped), in a temporary
    directory under ``work_dir`` whose untouched shards are hard links to the verifier's."""
    import shutil
    import tempfile

    from ..errors import OutputError
    from .writing import stitch

    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-probe-vllm-", dir=work_dir))
    try:
        served = []
        for i, draft in enumerate(drafts):
            try:
                stitch(draft, verifier, work / f"draft-{i}", link="hardlink", accept_divergent=True, arch=arch)
            except OutputError as e:
                raise OutputError(f"cannot stitch draft {draft} into a hard-linked copy of the verifier under {work} "
                                  f"({e}); give --work-dir on the verifier's filesystem") from None
            served.append((draft, work / f"draft-{i}"))
        yield served
    finally:
        shutil.rmtree(work, ignore_errors=True)
