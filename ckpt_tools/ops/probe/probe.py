"""`ckpt probe`: measure that an MTP draft drafts, on the user's prompts, before anyone serves it.

The verifier's trunk is loaded with transformers; its MTP layers are built by the table-driven engine
(``mtp_engine``). Where transformers' own ``MtpModel`` loads the same layers, the engine's depth-1 logits
are checked against it (``reference``) and it drafts a ``generate(use_mtp=True)`` run that must equal
greedy decoding (``greedy_equal``).

Per prompt the verifier generates greedily, then runs one teacher-forced pass over prompt + generation
whose hidden states and logits every compared MTP shares (the verifier's own, then each ``--draft``,
mapped onto the verifier's MTP names in memory with stitch's correspondence). Depth k is chained as the
serving engines chain a draft (``chain_logits``); each prediction is scored against the verifier's greedy
token (agreement) and distribution (KL).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import InputError, UsageError, extra_module
from ...io.checkpoint import Checkpoint
from .drafter import Drafter

if TYPE_CHECKING:
    import torch

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
CHAINS = ("sglang", "vllm")  # how depth k > 1 is chained: see chain_logits
EXTRA = "ckpt-tools[probe]"  # transformers, and accelerate for device_map
ENGINE = "ckpt-tools table engine"
REFERENCE = "transformers MtpModel"
# the engine's depth-1 logits may differ from MtpModel's by float rounding only (same weights, same modules)
REFERENCE_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
# (draft, verifier, arch, command) -> the draft's tensors in the verifier's MTP names (stitch's OutputTensors)
DraftMapper = Callable[[Checkpoint, Checkpoint, "str | None", str], list]


@dataclass
class ProbeRequest:
    verifier: str
    drafts: list[str | Mapping] = field(default_factory=list)  # paths, or {name: tensor} mappings (in memory)
    prompts: str | None = None
    max_new_tokens: int = 32
    depth: int = 1
    device: str = "cpu"
    dtype: str = "fp32"
    chain: str = "sglang"
    arch: str | None = None  # the drafts' family, asserted as stitch's --arch (a mapping names none)
    # a draft's tensors in the verifier's MTP names: stitch's correspondence (``ops.stitch.plan.mapped_draft``),
    # given by the caller so that probe imports no other verb; needed only when there are drafts
    map_draft: DraftMapper | None = None
    # --mtp-quant: schemes (and GGUF sidecar types) the verifier's own MTP is measured in too, encoded as the writer
    # encodes it by ``encode_mtp`` (``api.mtp_choice.encode_mtp``, given by the caller as map_draft is)
    mtp_quant: list[str] = field(default_factory=list)
    encode_mtp: Callable[[Checkpoint, str], dict] | None = None


@dataclass
class DraftResult:
    name: str
    agreement: list[float]
    kl: list[float]
    positions: int
    greedy_equal: bool | None  # None: not run (transformers' generate has no MTP for this family)
    mismatch: dict | None = None  # the first prompt whose speculative output differs, and where
    prompts: list[dict] = field(default_factory=list)  # per prompt: kl, agreement (per depth), tokens_sha256
    mean_acceptance_length: float | None = None  # tokens per verifier step as the engine counted them (vLLM)
    num_drafts: int | None = None  # the engine's speculative steps (vLLM)
    tensors: dict | None = None  # the digest of the measured checkpoint's tensors (tensors_digest); None: in memory

    def expected_accepted(self) -> float:
        """Tokens accepted per verification step for chain drafting: sum over k of prod_{j<=k} a_j."""
        total, run = 0.0, 1.0
        for a in self.agreement:
            run *= a
            total += run
        return total

    def to_json(self) -> dict:
        out = {"name": self.name, "agreement": self.agreement, "kl": self.kl, "positions": self.positions,
               "greedy_equal": self.greedy_equal, "expected_accepted": self.expected_accepted()}
        if self.mismatch is not None:
            out["mismatch"] = self.mismatch
        if self.mean_acceptance_length is not None:
            out["mean_acceptance_length"] = self.mean_acceptance_length
            out["num_drafts"] = self.num_drafts
        out["tensors"] = self.tensors
        out["prompts"] = self.prompts
        return out


@dataclass
class ProbeResult:
    drafts: list[DraftResult]
    prompts: int
    needed_bytes: int
    chain: str = "sglang"
    loaded: str = "as stored by transformers"  # how the trunk loaded (probe_load): or "dequantized by ckpt-tools (S)"
    mtp_loaded: str = "as stored by transformers"  # how the verifier's MTP layers loaded
    engine: dict = field(default_factory=lambda: {"name": "transformers", "mtp": ENGINE})  # name, version, ...
    # the engine checked against transformers' MtpModel: {"implementation", "max_abs_diff"} or {"skipped": why}
    reference: dict = field(default_factory=dict)
    # what was measured, so that a report can be matched to the files it describes (name_measured fills these)
    dtype: str | None = None
    device: str | None = None
    max_new_tokens: int | None = None
    prompts_sha256: str | None = None  # of the prompts file's bytes (of the built-in prompts' lines without one)
    plot: str | None = None  # the plot drawn with the report (--plot), relative to the report's directory
    mtp_quant: list[dict] | None = None  # --mtp-quant: one row per scheme (mtp_quant.QuantRow.to_json)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(ProbeResult)}  # in order; mtp_quant only when measured
        if self.mtp_quant is None:
            del out["mtp_quant"]
        return {**out, "drafts": [d.to_json() for d in self.drafts]}


# --- inputs -------------------------------------------------------------------------------------

def read_prompts(path: str | None) -> list[str | list[int]]:
    """JSONL (``{"prompt": text}`` or ``{"input_ids": [...]}`` per line) or a text file (one prompt a line)."""
    return [p for _, p in read_prompt_lines(path)]


def at_least_one(*options: tuple[str, int | None]) -> None:
    """Each option given (a value not None) is at least 1, checked in order."""
    bad = next((name for name, value in options if value is not None and value < 1), None)
    if bad is not None:
        raise UsageError(f"{bad} must be at least 1")


def check_prompts(path: str | None, vocab_size: int | None, positions: int | None, max_new_tokens: int) -> None:
    """Token ids within 0 <= id < vocab_size, and prompt + ``max_new_tokens`` within the model's positions
    (``[prompts]`` errors naming the file, the line, the prompt and the id): an id past the vocabulary or the
    positions would fail inside the model, or run for minutes on a length the model was never made for."""
    for number, (line, prompt) in enumerate(read_prompt_lines(path), 1):
        if not isinstance(prompt, list):
            continue
        where = f"line {line} (prompt {number})"
        for j, i in enumerate(prompt):
            if i < 0 or (vocab_size and i >= vocab_size):
                what = "negative" if i < 0 else "outside the vocabulary"
                bound = f"{vocab_size} (the verifier's vocab_size)" if vocab_size else "the vocabulary size"
                raise InputError(f"{where}: input_ids[{j}] = {i} is {what}: token ids are 0 <= id < {bound}",
                                 rule="prompts", path=path)
        if positions and len(prompt) + max_new_tokens > positions:
            raise InputError(f"{where}: {len(prompt)} prompt tokens + --max-new-tokens {max_new_tokens} exceed "
                             f"the model's {positions} positions (max_position_embeddings)", rule="prompts", path=path)


BUILTIN_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
# a prompts file is read whole, so it is read with a bound: far more prompts than any probe runs in a day
PROMPTS_MAX_BYTES = 64 * 2**20


def prompts_sha256(path: str | None) -> str:
    """sha256 of the prompts file's bytes; without one, of the built-in prompts as a text file (a line each)."""
    data = "".join(p + "\n" for p in BUILTIN_PROMPTS).encode() if path is None else prompt_bytes(path)
    return hashlib.sha256(data).hexdigest()


def prompt_bytes(path: str) -> bytes:
    """The prompts file's bytes: a regular file of at most ``PROMPTS_MAX_BYTES`` (a device, a FIFO or a file that
    keeps growing would otherwise be read until memory runs out; a FIFO could not be read twice either)."""
    try:
        # O_NONBLOCK: a FIFO without a writer is refused, not waited on
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a character device" if stat.S_ISCHR(st.st_mode)
                        else "a socket" if stat.S_ISSOCK(st.st_mode) else "a block device"
                        if stat.S_ISBLK(st.st_mode) else "not a regular file")
                raise InputError(f"the prompts file is {kind}; give a regular file (it is read whole, and hashed "
                                 "into the report)", rule="prompts", path=str(path))
            data = f.read(PROMPTS_MAX_BYTES + 1)
    except OSError as e:
        raise InputError(f"cannot read prompts: {e.strerror or e}", rule="prompts", path=str(path)) from None
    if len(data) > PROMPTS_MAX_BYTES:
        raise InputError(f"the prompts file is larger than {PROMPTS_MAX_BYTES} bytes ({PROMPTS_MAX_BYTES // 2**20} "
                         "MiB), the most probe reads: split it", rule="prompts", path=str(path))
    return data


def read_prompt_lines(path: str | None) -> list[tuple[int, str | list[int]]]:
    """``read_prompts`` with each prompt's line number (0 for the built-in prompts)."""
    if path is None:
        return [(0, p) for p in BUILTIN_PROMPTS]
    p = Path(path)
    try:
        text = prompt_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"cannot read prompts: {e}", rule="prompts", path=str(p)) from e
    prompts: list[tuple[int, str | list[int]]] = []
    jsonl = p.suffix == ".jsonl"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append((n, line))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"line {n} is not JSON: {e.msg}", rule="prompts", path=str(p)) from e
        except RecursionError:
            raise InputError(f"line {n} is nested too deeply to be a prompt", rule="prompts", path=str(p)) from None
        where = f"line {n} (prompt {len(prompts) + 1})"
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append((n, obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("input_ids"), list):
            ids = obj["input_ids"]
            if not ids:
                raise InputError(f"{where}: input_ids is empty; a prompt needs at least one token", rule="prompts",
                                 path=str(p))
            bad = next((j for j, i in enumerate(ids) if isinstance(i, bool) or not isinstance(i, int)), None)
            if bad is not None:
                raise InputError(f"{where}: input_ids[{bad}] is {ids[bad]!r}, not an integer token id",
                                 rule="prompts", path=str(p))
            huge = next((j for j, i in enumerate(ids) if not -2**63 <= i < 2**63), None)
            if huge is not None:  # before any vocabulary is known: torch holds token ids as int64
                raise InputError(f"{where}: input_ids[{huge}] = {ids[huge]} is no token id (not an int64)",
                                 rule="prompts", path=str(p))
            prompts.append((n, list(ids)))
        else:
            raise InputError(f'{where}: expected {{"prompt": text}} or {{"input_ids": [ints]}}', rule="prompts",
                             path=str(p))
    if not prompts:
        raise InputError("no prompts in the file", rule="prompts", path=str(p))
    return prompts


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 when it cannot be read: no refusal then)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def needed_bytes(verifier: Checkpoint, dtype: str, drafts: int = 0) -> int:
    """Weights in the compute dtype, from the headers: every tensor of the verifier (MTP included), and a copy
    of its MTP layers for each draft (a draft is loaded into a copy of the MTP module)."""
    elements = sum(math.prod(ref.shape) for ref in verifier.tensors.values())
    if drafts:
        from ...model.mtp import open_mtp

        mtp = {key for _, key in open_mtp(verifier).stored()}
        elements += drafts * sum(math.prod(verifier.tensors[k].shape) for k in mtp)
    return elements * DTYPE_BYTES[dtype]


def check_memory(verifier: Checkpoint, dtype: str, drafts: int) -> int:
    """The bytes the weights need (``needed_bytes``); refuses when they exceed MemAvailable, rather than swap."""
    need = needed_bytes(verifier, dtype, drafts)
    avail = available_memory()
    if avail and need > avail:
        raise InputError(f"the verifier needs about {need / 2**30:.2f} GiB in {dtype} ({need} bytes: its weights"
                         f"{f', and a copy of its MTP layers for each of the {drafts} draft(s)' if drafts else ''}); "
                         f"{avail / 2**30:.2f} GiB ({avail} bytes) is available", rule="memory", path=verifier.root)
    return need


# --- model engine -------------------------------------------------------------------------------

def transformers_module(what: str = "ckpt probe"):
    """transformers, or a UsageError naming the extra that installs it (it is not a core dependency)."""
    return extra_module("transformers", what, "transformers", EXTRA)


def resolve_device(device: str) -> str:
    """cpu, cuda or auto (cuda when torch sees a GPU, else cpu); cuda without a GPU is a usage error."""
    import torch

    if device not in ("cpu", "cuda", "auto"):
        raise UsageError(f"--device {device!r}: use cpu, cuda or auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU here (use --device cpu or auto)")
    return device


def device_map(device: str) -> dict[str, str] | None:
    """The ``device_map`` the verifier loads with: every weight straight onto ``device``.

    transformers 5.24 refuses any device_map without accelerate (``check_and_set_device_map``), even
    ``{"": "cpu"}``. Without accelerate, cpu loads with none, which is the same load: transformers 5
    builds the model on the meta device and materialises each weight once, in place (it has no
    ``low_cpu_mem_usage`` switch any more: that is how it always loads; the keyword is accepted and
    ignored). cuda needs accelerate: loading into host memory and moving would need all the weights
    in host memory first."""
    if importlib.util.find_spec("accelerate") is not None:
        return {"": device}
    if device == "cpu":
        return None
    raise UsageError(f"--device {device} loads the weights onto the GPU with a device_map, which needs accelerate "
                     f"(not installed); install the extra: pip install '{EXTRA}'", rule="missing-extra")


def tokens_sha256(ids: list[int]) -> str:
    """sha256 of token ids as comma-separated decimals (ASCII), e.g. ids [5, 17] hash the bytes b"5,17"."""
    return hashlib.sha256(",".join(map(str, ids)).encode("ascii")).hexdigest()


def verifier_config(path: str):
    """The verifier's transformers config (InputError ``probe-family`` when transformers cannot read it)."""
    transformers = transformers_module()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"transformers cannot read the config: {e}", rule="probe-family", path=path) from e
    except Exception as e:  # huggingface_hub's StrictDataclassError: a field of the wrong JSON type (e.g. 2.0 for 2)
        if not any(c.__name__ == "StrictDataclassError" for c in type(e).__mro__):
            raise
        why = " ".join(str(e).split())  # "Validation error for field 'x': TypeError: ... expected int, got float"
        raise InputError(f"transformers' strict config refuses it: {why}", rule="config-field",
                         path=f"{path}/config.json") from e
    return config


def require_mtp(verifier: Checkpoint, drafts: int = 0) -> None:
    """Refuses (``probe-family``), before any weight is read, a verifier whose table declares no MTP layer; with
    ``drafts``, a trunk whose config declares none says so and how to measure the draft (stitch --mode add)."""
    from ...model.mtp import open_mtp

    view = open_mtp(verifier)
    if drafts and view.count < 1 and view.table.kind == "mtp":
        field = view.table.mtp.count_field
        keys = [k for k in (view.table.config[field].keys if field else []) if verifier.config.has(k)]
        declared = f"{keys[0]}: {verifier.config.get(keys[0])}" if keys else "no MTP count"
        raise InputError(f"the verifier declares no MTP layer ({declared}), and probe measures a --draft inside the "
                         "verifier's own MTP layers (the draft's tensors mapped onto their names, as `ckpt stitch "
                         "--mode replace` maps them): there is none to map it onto. Add the draft as the verifier's "
                         f"MTP first, then probe that: `ckpt stitch DRAFT {verifier.root} --mode add -o OUT`, "
                         "`ckpt probe OUT`", rule="probe-family", path=verifier.root)
    if view.count < 1 or view.table.kind != "mtp":
        raise InputError(f"family {view.table.family!r} ({verifier.config.get('model_type')}): the checkpoint "
                         "declares no MTP layer, so there is nothing to probe", rule="probe-family",
                         path=verifier.root)
    if view.missing:  # e.g. a quantizer's output: the config keeps the MTP count, the tensors were dropped
        first = view.missing[0]
        raise InputError(f"the config declares {view.count} MTP layer(s) but {len(view.missing)} of their tensors are "
                         f"not stored (first: {first.key}); graft them back first (ckpt graft)", rule="mtp-missing",
                         path=verifier.root, key=first.key)


def load_verifier(path: str, config, device: str, dtype: str, verifier: Checkpoint | None = None):
    """A ``probe_load.LoadedVerifier``: main model and its MtpModel, weights on ``device`` in ``dtype``, each loaded
    as stored (or dequantized by our decoders), or an InputError (``probe-load``) naming why not."""
    from . import load as probe_load

    transformers_module()
    with contextlib.ExitStack() as stack:
        if verifier is None:
            verifier = stack.enter_context(Checkpoint.open(path))
        return probe_load.load(path, verifier, config, device, dtype, device_map(device))


def draft_mtp(main, loaded, verifier: Checkpoint, draft_path: str | Mapping, map_draft: DraftMapper,
              arch: str | None = None, dtype: str = "fp32", device: str = "cpu") -> Drafter:
    """The draft's weights, mapped onto the verifier's MTP names by stitch's correspondence (in memory), in the
    engine (and in an MtpModel where the verifier has one).

    ``draft_path``: a path, or a ``{name: tensor}`` mapping (``Checkpoint.open``). ``loaded``: the verifier as
    ``load_verifier`` loaded it (its quantization scheme decodes what the mapping stores quantized). The MTP
    tensors are the mapping's, and the verifier's own for the files the mapping leaves untouched.
    """
    from . import load as probe_load
    from . import mtp_engine

    with Checkpoint.open(draft_path) as d:
        where = d.root
        mapped = map_draft(d, verifier, arch, "ckpt probe")
        rewritten = {t.shard for t in mapped if t.shard}
        own = probe_load.stored_tensors(verifier)
        kept = {k for shard, keys in verifier.shard_keys.items() if shard not in rewritten for k in keys}
        state = {k: t for k, t in own.items() if k in kept and loaded.mtp_keys.search(k)}
        state.update({t.key: t for t in mapped if loaded.mtp_keys.search(t.key)})
        engine, _ = mtp_engine.build(main, verifier, state, loaded.scheme, dtype, device, where)
        reference = None
        if loaded.reference is not None:
            regex = loaded.reference_regex
            ref_state = {k: t for k, t in own.items() if k in kept and regex.search(k)}
            ref_state.update({t.key: t for t in mapped if regex.search(t.key)})
            reference, _ = probe_load.load_mtp(main, ref_state, regex, loaded.scheme, dtype, device, where)
    return Drafter(draft_name(draft_path), engine, reference)


def mtp_for_generate(mtp) -> contextlib.AbstractContextManager:
    """generate(use_mtp=True) builds its MtpModel with ``MtpModel.from_pretrained``: hand it ``mtp`` instead."""
    from unittest import mock

    from transformers.modeling_layers import MtpModel

    return mock.patch.object(MtpModel, "from_pretrained", classmethod(lambda cls, *a, **kw: mtp))


# --- measuring ----------------------------------------------------------------------------------

@contextmanager
def transformers_forward(main, where: str) -> Iterator[None]:
    """transformers' own forward of the verifier; one that fails on the checkpoint's config is a refusal
    (``probe-forward``), not a crash: probe cannot measure what the family's own model cannot run."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
        raise InputError(f"transformers' {type(main).__name__} cannot run a forward pass of this checkpoint: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", rule="probe-forward",
                         path=where) from None


def teacher_forward(main, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's one forward pass over a sequence: (logits, last hidden states). Shared by all drafts."""
    out = main(seq, output_hidden_states=True)
    return out.logits.float(), out.hidden_states[-1]


# How the engines chain an MTP draft past depth 1, read in their sources:
# - vLLM: vllm/model_executor/models/deepseek_mtp.py @ 4f7c14402630b97c8c078523fca8edef287ed2cf (and
#   glm4_moe_mtp.py @ 6e052ba8f4d97e43fb88a3288f3240ff4f73d7d2) return the MTP block's output BEFORE
#   shared_head.norm, which compute_logits applies only for the logits; the proposer
#   (vllm/v1/spec_decode/eagle.py @ f7eef1b6987f4780fe8636077682936fe075aa2f, llm_base_proposer.py
#   @ 82720b1ed4712ddebb597acdbcff752db48a76c1) feeds that output, the token drafted at the step
#   before and position + 1 to the next step, calling the model without spec_step_idx: the first
#   MTP layer drafts every step (config/speculative.py @ f19b16d9: "multiple times of forward on
#   same MTP layer").
# - SGLang: python/sglang/srt/models/deepseek_nextn.py @ c28bdc9012d29bed6b96688a44d6788157ef3d86
#   (and glm4_moe_nextn.py @ d737979cbd17c6162f39c1953cfa72d3d23cc0d0) applies shared_head.norm in
#   forward; speculative/eagle_worker.py @ fba8eccd7ebe41bbdbf70ab3b6a2df1835f8b532 feeds that
#   (post-norm) hidden state, the drafted token and position + 1 to the next step; the NextN
#   model holds one decoder layer, the first MTP layer, reused every step.
# - transformers 5.24 (MtpModel.forward) also chains the post-norm state, but drafts one token per
#   MTP layer: it never reuses a layer.
# In both engines step k attends to the MTP's cache: depth-1 entries for the verified prefix (the
# drafter rewrites accepted positions at depth 1 after each verification) and this chain's own
# entries of steps 2..k. Teacher-forced, the token fed at step k is the verifier's own: the token
# an accepted draft proposed.


def chain_logits(mtp, seq: torch.Tensor, hidden: torch.Tensor, depth: int, chain: str) -> list[torch.Tensor]:
    """Per depth k (1..depth): the draft's logits ``[L - k, vocab]`` for the chains starting at t = 0..L-k-1,
    row t predicting ``seq[t + k + 1]`` (the last row of each has nothing to predict inside ``seq``).

    ``hidden[:, t]`` is the verifier's last hidden state at t. Depth k of chain t runs the first MTP
    layer on (chained hidden state of depth k - 1, or ``hidden[:, t]``; the token ``seq[t + k]``) at
    position t + k. One forward per depth over every chain at once: the inputs of all depths so far,
    concatenated, under an attention mask that lets depth k of chain t see exactly what the engines'
    cache holds (``_chain_mask``). ``chain``: "sglang" feeds the post-norm state on, "vllm" the
    pre-norm one."""
    import torch

    length = seq.shape[1]
    out: list[torch.Tensor] = []
    prev_inputs: list[torch.Tensor] = []  # per depth d: the hidden states its entries take
    prev = hidden[:, : length - 1]
    with _pre_norm(mtp, chain == "vllm"):
        for k in range(1, depth + 1):
            n = length - k
            if n <= 0:
                break
            prev_inputs.append(prev[:, :n])
            ids = torch.cat([seq[:, d:] for d in range(1, k + 1)], dim=1)
            pos = torch.cat([torch.arange(d, length, device=seq.device) for d in range(1, k + 1)]).unsqueeze(0)
            mask = None if k == 1 else _chain_mask(mtp, length, k, torch.cat(prev_inputs, dim=1))
            with _attention_mask(mtp, mask):
                h = mtp.forward_layer(0, torch.cat(prev_inputs, dim=1), pos, None, input_ids=ids)[:, -n:]
            prev = h
            if chain == "vllm" and mtp.layers[0].post_norm is not None:
                h = mtp.layers[0].post_norm(h)  # the norm belongs to the logits only
            out.append(mtp._project_to_logits(h).float()[0])
    return out


def _chain_mask(mtp, length: int, depth: int, inputs: torch.Tensor):
    """The attention mask, in the model's attention implementation's format, over the entries of depths
    1..``depth`` (depth d holds chains t = 0..length-d-1, in that order): depth d of chain t sees the
    depth-1 entries of chains <= t (the verified prefix) and its own chain's entries of depths 2..d."""
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    dev = inputs.device
    level = torch.cat([torch.full((length - d,), d, device=dev) for d in range(1, depth + 1)])
    chain = torch.cat([torch.arange(length - d, device=dev) for d in range(1, depth + 1)])
    allowed = (((level[None, :] == 1) & (chain[None, :] <= chain[:, None]))
               | ((level[None, :] >= 2) & (level[None, :] <= level[:, None]) & (chain[None, :] == chain[:, None])))
    impl = mtp.config._attn_implementation
    if impl not in ("sdpa", "eager"):  # flash attention takes no arbitrary mask
        raise UsageError(f"--depth {depth} needs an attention implementation that takes a mask (sdpa or eager); "
                         f"the verifier's config uses {impl}")
    n = allowed.shape[0]
    return ALL_MASK_ATTENTION_FUNCTIONS[impl](
        batch_size=1, q_length=n, kv_length=n, mask_function=lambda b, h, q, kv: allowed[q, kv],
        allow_is_causal_skip=False, dtype=inputs.dtype, device=dev)


def _attention_mask(mtp, mask) -> contextlib.AbstractContextManager:
    """``forward_layer`` with ``mask`` instead of the causal mask it builds (None: its own)."""
    from unittest import mock

    return contextlib.nullcontext() if mask is None else mock.patch.object(
        mtp, "create_masks_for_mtp_layer", lambda *a, **k: {"attention_mask": mask})  # shadows the method


def _pre_norm(mtp, on: bool) -> contextlib.AbstractContextManager:
    """The first MTP layer returning its block's output before its final norm (vLLM's chained state)."""
    from unittest import mock

    return mock.patch.object(mtp.layers[0], "use_post_norm", mtp.layers[0].use_post_norm and not on)


@dataclass
class DepthCounts:
    """At one depth: the predictions that agree with the verifier's greedy token, the positions scored and the
    KL summed over them; one prompt's, or added up over prompts."""

    agree: int = 0
    positions: int = 0
    kl: float = 0.0

    def add(self, other: DepthCounts) -> None:
        self.agree += other.agree
        self.positions += other.positions
        self.kl += other.kl

    @property
    def agreement(self) -> float:
        return self.agree / self.positions if self.positions else 0.0

    @property
    def mean_kl(self) -> float:
        return self.kl / self.positions if self.positions else 0.0


def score(mtp, seq: torch.Tensor, prompt_len: int, logits: torch.Tensor, hidden: torch.Tensor, depth: int,
          chain: str = "sglang") -> list[DepthCounts]:
    """Per depth, the counts over the generated tokens."""
    drafts = chain_logits(mtp, seq, hidden, depth, chain)
    length = seq.shape[1]
    out = []
    for k in range(1, depth + 1):
        first = max(prompt_len - k - 1, 0)  # seq[t + k + 1] generated, not prompt
        last = length - k - 1  # exclusive: seq[t + k + 1] must exist
        if k > len(drafts) or last <= first:
            out.append(DepthCounts())
            continue
        d = drafts[k - 1][first:last]
        v = logits[0, first + k:last + k]
        agree = int((d.argmax(-1) == v.argmax(-1)).sum())
        lv, ld = v.log_softmax(-1), d.log_softmax(-1)
        kl = float((lv.exp() * (lv - ld)).sum(-1).sum())
        out.append(DepthCounts(agree, last - first, kl))
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _mapper(req: ProbeRequest) -> DraftMapper:
    if req.map_draft is None:
        raise TypeError("ProbeRequest.map_draft is needed to measure drafts (ops.stitch.plan.mapped_draft)")
    return req.map_draft


def probe(req: ProbeRequest, progress: Callable[[int, int], None] | None = None,
          announce: Callable[[int, int], None] | None = None) -> ProbeResult:
    """``announce(needed_bytes, available_bytes)`` is called before the weights load (available 0: unknown)."""
    import torch

    at_least_one(("--depth", req.depth), ("--max-new-tokens", req.max_new_tokens))
    if req.dtype not in DTYPES:
        raise UsageError(f"--dtype {req.dtype!r}: use bf16 or fp32")
    if req.chain not in CHAINS:
        raise UsageError(f"--chain {req.chain!r}: use {' or '.join(CHAINS)}")
    device = resolve_device(req.device)
    device_map(device)  # a missing extra is said before anything is read
    prompts = read_prompts(req.prompts)
    config = verifier_config(req.verifier)
    text_config = config.get_text_config()
    check_prompts(req.prompts, getattr(text_config, "vocab_size", None),
                  getattr(text_config, "max_position_embeddings", None), req.max_new_tokens)
    with Checkpoint.open(req.verifier) as verifier:
        require_mtp(verifier, len(req.drafts))
        need = check_memory(verifier, req.dtype, len(req.drafts) + len(req.mtp_quant))
        if announce is not None:
            announce(need, available_memory())
        loaded = load_verifier(req.verifier, config, device, req.dtype, verifier)
        main = loaded.main
        models = [Drafter("verifier", loaded.mtp, loaded.reference)] + [
            draft_mtp(main, loaded, verifier, p, _mapper(req), req.arch, req.dtype, device) for p in req.drafts]
        quant_rows = None
        if req.mtp_quant:
            from . import mtp_quant

            quant_rows, quantized = mtp_quant.drafters(main, loaded, verifier, req, device, len(models))
            models += quantized
    reference = {"implementation": REFERENCE, "max_abs_diff": 0.0} if loaded.reference is not None else {
        "skipped": loaded.reference_note}
    tokenizer = _tokenizer(req.verifier) if any(isinstance(p, str) for p in prompts) else None
    totals = [[DepthCounts() for _ in range(req.depth)] for _ in models]  # per MTP, per depth, over prompts
    mismatch: list[dict | None] = [None for _ in models]
    per_prompt: list[list[dict]] = [[] for _ in models]
    if progress is not None:
        progress(0, len(prompts))
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = (torch.tensor([prompt]) if isinstance(prompt, list)
                   else tokenizer(prompt, return_tensors="pt").input_ids).to(device)
            with transformers_forward(main, req.verifier):
                greedy = main.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False)
                logits, hidden = teacher_forward(main, greedy)
            digest = tokens_sha256(greedy[0].tolist())
            for m, drafter in enumerate(models):
                scores = score(drafter.engine, greedy, ids.shape[1], logits, hidden, req.depth, req.chain)
                if drafter.reference is not None:
                    diff = reference_difference(drafter, greedy, hidden, req.dtype, req.verifier)
                    reference["max_abs_diff"] = max(reference["max_abs_diff"], diff)
                for total, counts in zip(totals[m], scores, strict=True):
                    total.add(counts)
                per_prompt[m].append({"kl": [c.mean_kl for c in scores], "agreement": [c.agreement for c in scores],
                                      "positions": scores[0].positions, "tokens_sha256": digest})
                if mismatch[m] is None and drafter.reference is not None:
                    with mtp_for_generate(drafter.reference):
                        spec = main.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False, use_mtp=True)
                    a, b = greedy[0].tolist(), spec[0].tolist()
                    if a != b:
                        mismatch[m] = {"prompt": i, "position": first_difference(a, b) - ids.shape[1]}
            if progress is not None:
                progress(i + 1, len(prompts))
    results = [DraftResult(drafter.name, [c.agreement for c in per_depth], [c.mean_kl for c in per_depth],
                           per_depth[0].positions, None if drafter.reference is None else miss is None, miss, rows)
               for drafter, per_depth, miss, rows in zip(models, totals, mismatch, per_prompt, strict=True)]
    import transformers

    engine = {"name": "transformers", "version": transformers.__version__, "mtp": ENGINE}
    result = ProbeResult(results[:1 + len(req.drafts)], len(prompts), need, req.chain, loaded.loaded,
                         loaded.mtp_loaded, engine, reference)
    result.device = device
    if quant_rows is not None:
        result.mtp_quant = [r.to_json(results, results[0].agreement) for r in quant_rows]
    return name_measured(result, req)


def name_measured(result: ProbeResult, req: ProbeRequest) -> ProbeResult:
    """``result`` naming what it measured, so that ``ckpt push`` can tell a report of other files: the digest of
    the tensors of each MTP's checkpoint (the verifier's own MTP: the verifier's; a draft in memory has none), and
    the conditions (dtype, device, tokens per prompt, the prompts file's sha256)."""
    from ..shared.tensors_digest import tensors_digest

    for entry, source in zip(result.drafts, [req.verifier, *req.drafts], strict=True):
        entry.tensors = None if isinstance(source, Mapping) else tensors_digest(source).to_json()
    result.dtype = req.dtype
    result.device = result.device or req.device
    result.max_new_tokens = req.max_new_tokens
    result.prompts_sha256 = prompts_sha256(req.prompts)
    return result


def reference_difference(drafter: Drafter, seq: torch.Tensor, hidden: torch.Tensor, dtype: str, where: str) -> float:
    """Max abs difference of the engine's depth-1 logits from transformers' MtpModel's on the same sequence; more
    than float rounding is an error (the two would measure different models)."""
    ours = chain_logits(drafter.engine, seq, hidden, 1, "sglang")[0]
    theirs = chain_logits(drafter.reference, seq, hidden, 1, "sglang")[0]
    diff = float((ours - theirs).abs().max())
    if diff > REFERENCE_TOLERANCE[dtype]:
        raise InputError(f"the table engine and {REFERENCE} disagree on {drafter.name}'s depth-1 logits (max abs "
                         f"difference {diff:.3g} > {REFERENCE_TOLERANCE[dtype]}): the family table and transformers "
                         "describe different MTP layers", rule="probe-engine", path=where)
    return diff


def draft_name(draft: str | Mapping) -> str:
    """How results name a draft: its path, or the display name of a mapping in memory."""
    from ...io.readers.memory import ROOT

    return ROOT if isinstance(draft, Mapping) else str(draft)


def _tokenizer(path: str):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(f"text prompts need the verifier's tokenizer, which transformers cannot load ({e}); "
                         'give token ids as JSONL {"input_ids": [...]} instead', rule="prompts", path=path) from e
