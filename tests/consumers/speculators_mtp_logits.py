"""Runs INSIDE the speculators 0.9.0 virtual environment (see Makefile: speculators-venv).

    python speculators_mtp_logits.py DRAFT IN.npz OUT.npz [--verifier PATH] [--attn sdpa|eager]
    python speculators_mtp_logits.py --jobs JOBS.json [--attn sdpa|eager]
    python speculators_mtp_logits.py --self-check DRAFT [--verifier PATH]

The per-position logits of a real MTP implementation, speculators' MTPDraftModel, for a draft in
speculators' format (what `ckpt extract --format speculators` writes from a Qwen3-Next /
Qwen3.5(-MoE) verifier), so a test can hold another MTP engine to them on the same weights.

Input  IN.npz:  input_ids [1, L] int64; hidden [1, L, hidden_size] float32, the verifier's last
                hidden states (speculators' `verifier_last_hidden_states`, the output of layer
                num_hidden_layers: the harness takes them as given).
Output OUT.npz: logits [L-1, vocab] float32, depth 1: row t predicts token t+2 from hidden[t] and
                the embedding of input_ids[t+1];
                logits_depth{d} [L-d, vocab] float32 for d = 1..num_speculative_steps (the chain
                speculators trains): row t predicts token t+d+1 from the depth-(d-1) output at t
                (hidden[t] for d = 1) and the embedding of input_ids[t+d]; logits_depth1 == logits;
                meta: one JSON string (versions, dtype, attention / experts implementation, layer
                class, verifier path).
JOBS.json is a list of {"draft", "inputs", "output", "verifier" (optional)}: several drafts for
one start-up (importing speculators takes most of the ~15 s a run costs).
--verifier overrides the draft config's speculators_config.verifier.name_or_path (embed_tokens and
lm_head are the verifier's: speculators loads them from there; a relative name is resolved against
the working directory, as speculators does). Exit 0, or 2 with one line on stderr naming the
input that is wrong.

Alignment, from speculators 0.9.0's source:
- speculators/models/mtp/core.py, MTPDraftModel.forward(input_ids, hidden_states, ...): with
  K = config.num_speculative_steps and effective = min(K, L-2), valid_len = L - effective - 1;
  step s (0-based) takes hidden = (verifier hidden for s = 0, step s-1's MTP output otherwise)
  [:, :valid_len] and embeds = embed_tokens(input_ids[:, s+1 : s+1+valid_len]), its target is
  input_ids[:, s+2 : s+2+valid_len]; position_ids default to arange(valid_len) for every step
  (Qwen3.5 text types: expanded to the 3 MRoPE sections by _prepare_mtp_position_ids); one
  causal mask (transformers' create_causal_mask); logits = lm_head(step output). It returns
  (list of K [1, valid_len, vocab] logits, loss, metrics).
- speculators/models/mtp/model_definitions.py, MTPLayerMixin.forward(hidden_states,
  token_embeddings, ...): input_proj(cat([token_layernorm(embeds), hidden_layernorm(hidden)]))
  (embedding first), then the verifier family's transformers decoder layer
  (Qwen3NextDecoderLayer / Qwen3_5DecoderLayer / Qwen3_5MoeDecoderLayer, built with layer_idx =
  the last full_attention index, _create_mtp_layer_class), then final_layernorm. The norms are the
  family's RMSNorm class (zero-centred, 1 + weight, for these families).
- speculators/model.py, DraftVocabMixin.load_verifier_weights: embed_tokens and lm_head are read
  from the verifier checkpoint (MTPDraftModel.load_verifier_weights, core.py).
Its forward yields only valid_len = L-K-1 rows (each needs its target). To get every row t whose
input token t+1 is known, the harness appends K dummy token ids (0) and K zero hidden rows: then
valid_len = L-1, step s reads only input_ids[:, s+1 : L] for the rows kept here and hidden[:, :L-1],
and the appended ids are only loss targets (the loss is discarded). Causal attention: no kept row
sees a padded one (the self-check proves the rows equal the unpadded forward's).

The draft's weights (bf16 or other) are upcast to float32, the model is in eval mode and run
under torch.no_grad; torch.compile is not involved (speculators compiles only with CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig


def fail(msg: str) -> None:
    print(f"speculators_mtp_logits: {msg}", file=sys.stderr)
    sys.exit(2)


def load(draft: Path, verifier: str | None, attn: str) -> MTPDraftModel:
    if not (draft / "config.json").is_file():
        fail(f"{draft}: no config.json (not a speculators draft directory)")
    config = MTPSpeculatorConfig.from_pretrained(str(draft))
    if verifier is not None:
        config.speculators_config.verifier.name_or_path = verifier
    config.transformer_layer_config._attn_implementation = attn  # noqa: SLF001
    # speculators builds the layer standalone, so transformers would fall back to its eager expert
    # loop with a warning; say so explicitly.
    config.transformer_layer_config._experts_implementation = "eager"  # noqa: SLF001
    model = MTPDraftModel.from_pretrained(str(draft), config=config)
    model = model.to(torch.float32).eval()
    for name in ("embed_tokens", "lm_head"):
        if torch.isnan(getattr(model, name).weight).any():
            fail(f"{draft}: {name}.weight not loaded from verifier {config.speculators_config.verifier.name_or_path!r}")
    return model


def steps(model: MTPDraftModel) -> int:
    return model.config.num_speculative_steps


@torch.no_grad()
def raw_forward(model: MTPDraftModel, ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    logits, _loss, _metrics = model(input_ids=ids, hidden_states=hidden)
    return [x[0].float() for x in logits]


def mtp_logits(model: MTPDraftModel, ids: torch.Tensor, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Depth-d logits for every row whose inputs are all real (see the module docstring)."""
    k = steps(model)
    length = ids.shape[1]
    pad_ids = torch.cat([ids, torch.zeros(1, k, dtype=ids.dtype)], dim=1)
    pad_hidden = torch.cat([hidden, torch.zeros(1, k, hidden.shape[-1], dtype=hidden.dtype)], dim=1)
    per_step = raw_forward(model, pad_ids, pad_hidden)
    assert len(per_step) == k and per_step[0].shape[0] == length - 1, [tuple(x.shape) for x in per_step]
    out = {f"logits_depth{s + 1}": per_step[s][: length - 1 - s].contiguous() for s in range(k)}
    out["logits"] = out["logits_depth1"]
    return out


def check_inputs(model: MTPDraftModel, ids: np.ndarray, hidden: np.ndarray, src: str) -> None:
    tc = model.config.transformer_layer_config
    if ids.dtype != np.int64 or ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        fail(f"{src}: input_ids must be int64 [1, L] with L >= 2, got {ids.dtype} {list(ids.shape)}")
    if ids.min() < 0 or ids.max() >= tc.vocab_size:
        fail(f"{src}: input_ids outside [0, {tc.vocab_size})")
    if hidden.dtype != np.float32 or hidden.shape != (1, ids.shape[1], tc.hidden_size):
        fail(f"{src}: hidden must be float32 [1, {ids.shape[1]}, {tc.hidden_size}], "
             f"got {hidden.dtype} {list(hidden.shape)}")


def meta(model: MTPDraftModel, attn: str) -> str:
    tc = model.config.transformer_layer_config
    return json.dumps({
        "speculators": version("speculators"), "transformers": version("transformers"), "torch": torch.__version__,
        "dtype": "float32", "attn_implementation": attn,
        "experts_implementation": getattr(tc, "_experts_implementation", None),
        "model_type": tc.model_type, "layer_class": type(model.mtp_layers[0]).__name__,
        "layer_idx": getattr(model.mtp_layers[0].self_attn, "layer_idx", None),
        "num_speculative_steps": steps(model),
        "verifier": model.config.speculators_config.verifier.name_or_path,
    })


LOADED: dict[tuple, MTPDraftModel] = {}  # one load per (draft, verifier, attn) in a --jobs run


def run(draft: str, inputs: str, output: str, verifier: str | None, attn: str) -> None:
    key = (draft, verifier, attn)
    if key not in LOADED:
        LOADED[key] = load(Path(draft), verifier, attn)
    model = LOADED[key]
    with np.load(inputs) as data:
        for key in ("input_ids", "hidden"):
            if key not in data:
                fail(f"{inputs}: no array {key!r} (has {sorted(data.keys())})")
        ids, hidden = data["input_ids"], data["hidden"]
    check_inputs(model, ids, hidden, inputs)
    out = mtp_logits(model, torch.from_numpy(ids), torch.from_numpy(hidden))
    arrays = {k: v.numpy() for k, v in out.items()}
    tmp = Path(f"{output}.tmp.npz")
    np.savez(tmp, meta=np.array(meta(model, attn)), **arrays)
    tmp.replace(output)


def run_jobs(path: str, attn: str) -> None:
    jobs = json.loads(Path(path).read_text())
    for i, job in enumerate(jobs):
        missing = {"draft", "inputs", "output"} - set(job)
        if missing:
            fail(f"{path}: job {i} lacks {sorted(missing)}")
        run(job["draft"], job["inputs"], job["output"], job.get("verifier"), attn)


def self_check(args: argparse.Namespace) -> None:
    """By hand: determinism, the padding trick against speculators' own rows, causality."""
    model = load(Path(args.draft), args.verifier, args.attn)
    tc = model.config.transformer_layer_config
    k, length = steps(model), 10
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tc.vocab_size, (1, length), generator=gen)
    hidden = torch.randn(1, length, tc.hidden_size, generator=gen)
    a, b = mtp_logits(model, ids, hidden), mtp_logits(model, ids, hidden)
    rerun = max(float((a[key] - b[key]).abs().max()) for key in a)
    own = raw_forward(model, ids, hidden)  # speculators unpadded: L-K-1 rows per step
    vs_own = max(float((a[f"logits_depth{s + 1}"][: own[s].shape[0]] - own[s]).abs().max()) for s in range(k))
    ids2, hidden2 = ids.clone(), hidden.clone()  # change the last position: earlier rows must not move
    ids2[0, -1] = (ids2[0, -1] + 1) % tc.vocab_size
    hidden2[0, -1] += 1.0
    c = mtp_logits(model, ids2, hidden2)
    causal = float((c["logits"][: length - 2] - a["logits"][: length - 2]).abs().max())
    moved = float((c["logits"][length - 2] - a["logits"][length - 2]).abs().max())
    report = {"shapes": {key: list(v.shape) for key, v in a.items()}, "rerun_max_abs": rerun,
              "vs_unpadded_max_abs": vs_own, "earlier_rows_after_last_change": causal,
              "last_row_after_last_change": moved, "finite": all(bool(torch.isfinite(v).all()) for v in a.values()),
              "meta": json.loads(meta(model, args.attn))}
    print(json.dumps(report))
    ok = report["finite"] and rerun == 0.0 and vs_own <= 1e-5 and causal <= 1e-5 and moved > 0.0
    sys.exit(0 if ok else 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--self-check", action="store_true")
    p.add_argument("--jobs", default=None)
    p.add_argument("--verifier", default=None)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("draft", nargs="?")
    p.add_argument("inputs", nargs="?")
    p.add_argument("output", nargs="?")
    args = p.parse_args()
    if args.jobs is not None:
        run_jobs(args.jobs, args.attn)
    elif args.draft is None:
        p.error("DRAFT is required")
    elif args.self_check:
        self_check(args)
    elif args.inputs is None or args.output is None:
        p.error("DRAFT IN.npz OUT.npz")
    else:
        run(args.draft, args.inputs, args.output, args.verifier, args.attn)


if __name__ == "__main__":
    main()
