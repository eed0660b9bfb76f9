"""`ckpt probe`: measure that an MTP draft drafts, on the user's prompts, before anyone serves it.

The verifier is loaded with transformers and its MTP layers through transformers' ``MtpModel``
(the families transformers supports that way). For each prompt the verifier generates greedily,
then runs ONE teacher-forced forward pass over prompt + generation; its last hidden states and
logits are shared by every MTP compared (the verifier's own, then each ``--draft``).

Depth k is chained as the engines chain a draft: depth 1 takes the verifier's hidden state at t
and the token at t + 1; depth k takes depth k-1's output hidden state and the token at t + k
(teacher-forced: the sequence is the verifier's own greedy output), and predicts the token at
t + k + 1. A model with fewer MTP layers than ``depth`` reuses its last layer, as the engines do.
Each prediction is scored against the verifier's greedy token at that position (agreement) and
its distribution (KL from the verifier's next-token distribution to the draft's).

A draft is mapped onto the verifier's MTP names in memory with stitch's correspondence
(``plan_stitch``; nothing is written) and loaded into a copy of the MTP module.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError, UsageError
from ..io.checkpoint import Checkpoint

if TYPE_CHECKING:
    import torch

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass
class ProbeRequest:
    verifier: str
    drafts: list[str | Mapping] = field(default_factory=list)  # paths, or {name: tensor} mappings (in memory)
    prompts: str | None = None
    max_new_tokens: int = 32
    depth: int = 1
    device: str = "cpu"
    dtype: str = "fp32"
    arch: str | None = None  # the drafts' family, asserted as stitch's --arch (a mapping names none)


@dataclass
class DraftResult:
    name: str
    agreement: list[float]
    kl: list[float]
    positions: int
    greedy_equal: bool
    mismatch: dict | None = None  # the first prompt whose speculative output differs, and where
    prompts: list[dict] = field(default_factory=list)  # per prompt: kl, agreement (per depth), tokens_sha256

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
        out["prompts"] = self.prompts
        return out


@dataclass
class ProbeResult:
    drafts: list[DraftResult]
    prompts: int
    needed_bytes: int

    def to_json(self) -> dict:
        return {"drafts": [d.to_json() for d in self.drafts], "prompts": self.prompts,
                "needed_bytes": self.needed_bytes}


# --- inputs -------------------------------------------------------------------------------------

def read_prompts(path: str | None) -> list[str | list[int]]:
    """JSONL (``{"prompt": text}`` or ``{"input_ids": [...]}`` per line) or a text file (one prompt a line)."""
    if path is None:
        return ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompts: {e}", rule="prompts", path=str(p)) from e
    prompts: list[str | list[int]] = []
    jsonl = p.suffix == ".jsonl"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"line {n} is not JSON: {e.msg}", rule="prompts", path=str(p)) from e
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif (isinstance(obj, dict) and isinstance(obj.get("input_ids"), list) and obj["input_ids"]
              and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in obj["input_ids"])):
            prompts.append(list(obj["input_ids"]))
        else:
            raise InputError(f'line {n}: expected {{"prompt": text}} or {{"input_ids": [ints]}}', rule="prompts",
                             path=str(p))
    if not prompts:
        raise InputError("no prompts in the file", rule="prompts", path=str(p))
    return prompts


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 when it cannot be read: no refusal then)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def needed_bytes(verifier: Checkpoint, dtype: str) -> int:
    """The verifier's weights in the compute dtype, from the headers (every tensor, MTP included)."""
    return sum(math.prod(ref.shape) for ref in verifier.tensors.values()) * DTYPE_BYTES[dtype]


def check_memory(verifier: Checkpoint, dtype: str, drafts: int) -> int:
    need = needed_bytes(verifier, dtype)
    avail = available_memory()
    if avail and need > avail:
        raise InputError(f"the verifier's weights need about {need / 2**30:.2f} GiB in {dtype} ({need} bytes; each "
                         f"of the {drafts} draft(s) adds a copy of the MTP layers); {avail / 2**30:.2f} GiB "
                         f"({avail} bytes) is available",
                         rule="memory", path=verifier.root)
    return need


# --- model engine -------------------------------------------------------------------------------

def mtp_supported(config: Any) -> bool:
    """Whether transformers' MtpModel builds MTP layers for this (transformers) config."""
    return bool(getattr(config.get_text_config(), "num_mtp_layers", None))


def family_supported(fixture: dict) -> bool:
    """``mtp_supported`` for a family table's fixture config.json (what ``ckpt tables`` reports)."""
    import copy

    import transformers

    fixture = copy.deepcopy(fixture)  # transformers normalises nested values in place; the table is cached
    model_type = fixture.pop("model_type", None)
    try:
        return mtp_supported(transformers.AutoConfig.for_model(model_type, **fixture))
    except (ValueError, KeyError, TypeError):  # a model_type transformers does not know
        return False


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


def tokens_sha256(ids: list[int]) -> str:
    """sha256 of token ids as comma-separated decimals (ASCII), e.g. ids [5, 17] hash the bytes b"5,17"."""
    return hashlib.sha256(",".join(map(str, ids)).encode("ascii")).hexdigest()


def _supported(config: Any) -> None:
    if not mtp_supported(config):
        raise InputError(f"family {config.model_type!r} has no MTP layers transformers' MtpModel can load "
                         "(supported: DeepSeek-V3 / GLM-4-MoE style num_nextn_predict_layers configs)",
                         rule="probe-family")


def load_verifier(path: str, device: str, dtype: str):
    import torch
    import transformers
    from transformers.modeling_layers import MtpModel

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"transformers cannot read the config: {e}", rule="probe-family", path=path) from e
    try:
        _supported(config)
    except InputError as e:
        raise InputError(e.message, rule=e.rule, path=path) from None
    main = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, DTYPES[dtype]), low_cpu_mem_usage=True, local_files_only=True)
    main.to(device).eval()  # no device_map: that needs accelerate, not a dependency
    try:
        mtp = MtpModel.from_pretrained(main, device_map={"": torch.device(device)})
    except (ValueError, RuntimeError) as e:
        raise InputError(f"transformers' MtpModel cannot load the MTP layers: {e}", rule="probe-family",
                         path=path) from e
    mtp.eval()
    return main, mtp


def _materialize(t) -> torch.Tensor:
    from ..arrays import bytes_to_torch
    from ..numeric.transforms import RecipeReader

    buf = RecipeReader(t.recipe).read(t.nbytes)
    return bytes_to_torch(bytearray(buf), t.dtype, t.shape).clone()


def draft_mtp(main, base_mtp, verifier: Checkpoint, draft_path: str | Mapping, arch: str | None = None):
    """A copy of ``base_mtp`` holding the draft's weights, mapped by stitch's correspondence (in memory).

    ``draft_path``: a path, or a ``{name: tensor}`` mapping (``Checkpoint.open``).
    """
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_layers import MtpModel
    from transformers.modeling_utils import LoadStateDictConfig

    from ..stream.plan import OutputTensor
    from .compare import recipe_of
    from .stitch import StitchRequest, plan_stitch

    regex = MtpModel.get_mtp_weights_regex(main)
    with Checkpoint.open(draft_path) as d:
        where = d.root
        plan, _ = plan_stitch(d, verifier, StitchRequest(accept_divergent=True, arch=arch, command="ckpt probe"))
        state = {}
        for key, ref in verifier.tensors.items():  # the verifier's MTP tensors, then the draft's over them
            if regex.search(key):
                state[key] = _materialize(OutputTensor(key, ref.dtype, tuple(ref.shape), recipe_of(ref)))
        for t in plan.tensors:
            if regex.search(t.key):
                state[t.key] = _materialize(t)
    mtp = copy.deepcopy(base_mtp)
    info, _ = convert_and_load_state_dict_in_model(
        model=mtp, state_dict=state,
        load_config=LoadStateDictConfig(weight_mapping=mtp.get_weight_conversions(main), dtype=main.config.dtype))
    mtp._adjust_missing_and_unexpected_keys(info)
    if info.missing_keys:
        raise InputError(f"the mapped draft leaves MTP weights unset: {sorted(info.missing_keys)[:5]}",
                         rule="missing-tensor", path=where)
    mtp.tie_with_main_model(main)
    mtp.eval()
    return mtp


@contextmanager
def mtp_for_generate(mtp) -> Iterator[None]:
    """generate(use_mtp=True) builds its MtpModel with ``MtpModel.from_pretrained``: hand it ``mtp`` instead."""
    from transformers.modeling_layers import MtpModel

    original = MtpModel.__dict__["from_pretrained"]
    MtpModel.from_pretrained = classmethod(lambda cls, main_model, device_map=None, **kw: mtp)
    try:
        yield
    finally:
        MtpModel.from_pretrained = original


# --- measuring ----------------------------------------------------------------------------------

def teacher_forward(main, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's one forward pass over a sequence: (logits, last hidden states). Shared by all drafts."""
    out = main(seq, output_hidden_states=True)
    return out.logits.float(), out.hidden_states[-1]


def score(mtp, seq: torch.Tensor, prompt_len: int, logits: torch.Tensor, hidden: torch.Tensor, depth: int
          ) -> list[tuple[int, int, float]]:
    """Per depth: (agreeing positions, positions, summed KL) over the generated tokens."""
    import torch

    out = []
    prev = hidden
    length = seq.shape[1]
    for k in range(1, depth + 1):
        n = length - k
        if n <= 0:
            out.append((0, 0, 0.0))
            continue
        layer = min(k - 1, len(mtp.layers) - 1)
        pos = torch.arange(k, k + n, device=seq.device).unsqueeze(0)
        h = mtp.forward_layer(layer, prev[:, :n], pos, None, input_ids=seq[:, k:])
        draft = mtp._project_to_logits(h).float()[0]  # draft[t] predicts seq[t + k + 1]
        first = max(prompt_len - k - 1, 0)
        last = length - k - 1  # exclusive: seq[t + k + 1] must exist
        if last <= first:
            out.append((0, 0, 0.0))
        else:
            d = draft[first:last]
            v = logits[0, first + k:last + k]
            agree = int((d.argmax(-1) == v.argmax(-1)).sum())
            lv, ld = v.log_softmax(-1), d.log_softmax(-1)
            kl = float((lv.exp() * (lv - ld)).sum(-1).sum())
            out.append((agree, last - first, kl))
        prev = h
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def probe(req: ProbeRequest, progress: Callable[[int, int], None] | None = None) -> ProbeResult:
    import torch

    if req.depth < 1:
        raise UsageError("--depth must be at least 1")
    if req.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if req.dtype not in DTYPES:
        raise UsageError(f"--dtype {req.dtype!r}: use bf16 or fp32")
    device = resolve_device(req.device)
    prompts = read_prompts(req.prompts)
    with Checkpoint.open(req.verifier) as verifier:
        need = check_memory(verifier, req.dtype, len(req.drafts))
        main, own = load_verifier(req.verifier, device, req.dtype)
        models = [("verifier", own)] + [(draft_name(p), draft_mtp(main, own, verifier, p, req.arch))
                                        for p in req.drafts]
    tokenizer = _tokenizer(req.verifier) if any(isinstance(p, str) for p in prompts) else None
    sums = [[[0, 0, 0.0] for _ in range(req.depth)] for _ in models]
    mismatch: list[dict | None] = [None for _ in models]
    per_prompt: list[list[dict]] = [[] for _ in models]
    if progress is not None:
        progress(0, len(prompts))
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = (torch.tensor([prompt]) if isinstance(prompt, list)
                   else tokenizer(prompt, return_tensors="pt").input_ids).to(device)
            greedy = main.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False)
            logits, hidden = teacher_forward(main, greedy)
            digest = tokens_sha256(greedy[0].tolist())
            for m, (_, mtp) in enumerate(models):
                scores = score(mtp, greedy, ids.shape[1], logits, hidden, req.depth)
                for k, (agree, n, kl) in enumerate(scores):
                    sums[m][k][0] += agree
                    sums[m][k][1] += n
                    sums[m][k][2] += kl
                per_prompt[m].append({"kl": [kl / n if n else 0.0 for _, n, kl in scores],
                                      "agreement": [a / n if n else 0.0 for a, n, _ in scores],
                                      "positions": scores[0][1], "tokens_sha256": digest})
                if mismatch[m] is None:
                    with mtp_for_generate(mtp):
                        spec = main.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False, use_mtp=True)
                    a, b = greedy[0].tolist(), spec[0].tolist()
                    if a != b:
                        mismatch[m] = {"prompt": i, "position": first_difference(a, b) - ids.shape[1]}
            if progress is not None:
                progress(i + 1, len(prompts))
    results = []
    for (name, _), per_depth, miss, rows in zip(models, sums, mismatch, per_prompt, strict=True):
        results.append(DraftResult(
            name, [a / n if n else 0.0 for a, n, _ in per_depth], [kl / n if n else 0.0 for _, n, kl in per_depth],
            per_depth[0][1], miss is None, miss, rows))
    return ProbeResult(results, len(prompts), need)


def draft_name(draft: str | Mapping) -> str:
    """How results name a draft: its path, or the display name of a mapping in memory."""
    from ..io.readers.memory import ROOT

    return ROOT if isinstance(draft, Mapping) else str(draft)


def _tokenizer(path: str):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(f"text prompts need the verifier's tokenizer, which transformers cannot load ({e}); "
                         'give token ids as JSONL {"input_ids": [...]} instead', rule="prompts", path=path) from e
