"""How far finetuning moves MTP weights, and how far broken drafts are: the evidence behind
stitch's divergence thresholds (``ckpt_tools.ops.stitch.compare.DIVERGENCE``).

    python -m benchmarks.divergence [--steps 500] [--json FILE]        (needs transformers)

A tiny DeepSeek-V3 built by transformers (the model of tests/test_consumer_transformers.py,
4 trunk layers, MoE everywhere) gets an MTP layer initialised like the test fixtures
(weights N(0, 0.02), norms 1 + N(0, 0.05)) and *pretrained* on one token distribution (300
AdamW steps at lr 3e-4), so its weights have seen gradients. That layer is then *finetuned*
on another distribution (a domain shift) with AdamW over a grid of learning rates, weight
decays and step counts, and every tensor is compared with its pretrained value the way
stitch compares a draft with the verifier: cosine and norm ratio ||draft|| / ||verifier||
per tensor (per expert and gate / up half for the fused expert stacks, as the verifier
stores them). The same numbers are computed for broken drafts: every expert's gate and up
halves swapped, another model's weights of the same shapes, norms left at their initial
ones. Only the MTP layer trains; the trunk, embedding and head are frozen. Gradients of a
tiny model on a Markov chain are far less noisy than an LLM's, so the drift per step is
an upper end of what real finetuning does at the same learning rate.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

PRETRAIN_STEPS, PRETRAIN_LR = 300, 3e-4
KINDS = ("norm", "fusion", "attention", "router", "shared-mlp", "experts")


def tiny_config():
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=128, num_nextn_predict_layers=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def kind_of(name: str) -> str:
    if "norm" in name:
        return "norm"
    if name.startswith("eh_proj"):
        return "fusion"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp.experts." in name:
        return "experts"
    return "shared-mlp"


def pieces(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: fused expert stacks cut per expert (and gate / up)."""
    if name.endswith("experts.gate_up_proj"):
        half = t.shape[1] // 2
        out = {}
        for e in range(t.shape[0]):
            out[f"{name}[{e}].gate"] = t[e, :half]
            out[f"{name}[{e}].up"] = t[e, half:]
        return out
    if name.endswith("experts.down_proj"):
        return {f"{name}[{e}]": t[e] for e in range(t.shape[0])}
    return {name: t}


def measure(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    na, nb = a.norm().item(), b.norm().item()
    cos = (a @ b).item() / (na * nb) if na and nb else float("nan")
    return cos, nb / na if na else float("inf")


class Markov:
    """Token sequences from a random sparse transition matrix (each token has a few likely successors)."""

    def __init__(self, vocab: int, seed: int, fan: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.full((vocab, vocab), -1e9)
        for i in range(vocab):
            nxt = torch.randperm(vocab, generator=g)[:fan]
            logits[i, nxt] = torch.randn(fan, generator=g) * 2
        self.p = torch.softmax(logits, -1)
        self.g = g
        self.vocab = vocab

    def batch(self, n: int, length: int) -> torch.Tensor:
        ids = torch.empty(n, length, dtype=torch.long)
        ids[:, 0] = torch.randint(3, self.vocab, (n,), generator=self.g)
        for t in range(1, length):
            ids[:, t] = torch.multinomial(self.p[ids[:, t - 1]], 1, generator=self.g).squeeze(1)
        return ids


def build(seed: int):
    import transformers
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    main = transformers.DeepseekV3ForCausalLM(tiny_config()).eval()
    for p in main.parameters():
        p.requires_grad_(False)
    mtp = MtpModel(main, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the generic MtpModel leaves some parameters (the experts) uninitialised
        for name, p in mtp.layers.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            scale = 0.05 if "norm" in name else 0.02
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
    return main, mtp


def batches(main, data: Markov, count: int, n: int = 16, length: int = 48):
    """(mtp input ids, main hidden states, targets) per batch, the trunk run once."""
    out = []
    with torch.no_grad():
        for _ in range(count):
            ids = data.batch(n, length)
            h = main.model(input_ids=ids).last_hidden_state
            out.append((ids[:, 1:-1], h[:, :-2], ids[:, 2:]))
    return out


def train(mtp, data, steps: int, lr: float, wd: float) -> list[float]:
    params = [p for p in mtp.layers.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    losses = []
    for s in range(steps):
        ids, h, target = data[s % len(data)]
        pos = torch.arange(1, ids.shape[1] + 1).expand(ids.shape[0], -1)
        hs = mtp.forward_layer(0, h, pos, None, input_ids=ids)
        logits = mtp._project_to_logits(hs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def state(mtp) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in mtp.layers[0].state_dict().items():
        if t.is_floating_point():
            out.update(pieces(name, t.detach().clone()))
    return out


def _rms(tensors: dict) -> dict[str, float]:
    """Median RMS of the pretrained tensors of each kind (finetuning drift scales with lr / RMS)."""
    per: dict[str, list[float]] = {}
    for name, t in tensors.items():
        per.setdefault(kind_of(name), []).append(float(t.double().pow(2).mean().sqrt()))
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}


def compare(before: dict, after: dict) -> dict[str, dict]:
    """Per kind: min cosine, min and max norm ratio, over every tensor of that kind."""
    rows: dict[str, dict] = {}
    for name, a in before.items():
        if float(a.abs().max()) == 0.0:  # a zero buffer (e_score_correction_bias): no direction to compare
            continue
        cos, ratio = measure(a, after[name])
        r = rows.setdefault(kind_of(name), {"min_cos": 1.0, "max_cos": -1.0, "min_ratio": math.inf, "max_ratio": 0.0,
                                            "worst": ""})
        if cos < r["min_cos"]:
            r["min_cos"], r["worst"] = cos, name
        r["max_cos"] = max(r["max_cos"], cos)
        r["min_ratio"], r["max_ratio"] = min(r["min_ratio"], ratio), max(r["max_ratio"], ratio)
    return rows


def main_(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    main, mtp = build(0)
    pre_data = batches(main, Markov(128, 1), 64)
    train(mtp, pre_data, PRETRAIN_STEPS, PRETRAIN_LR, 0.1)  # a "pretrained" MTP layer, weights still ~0.02 RMS
    pretrained = {k: v.clone() for k, v in mtp.state_dict().items()}
    ref = state(mtp)
    ft_data = batches(main, Markov(128, 2), 64)
    results = {"finetune": [], "broken": {}, "rms": _rms(ref)}
    grid = [(lr, 0.1, args.steps) for lr in (1e-5, 1e-4, 3e-4, 1e-3)]
    grid += [(1e-3, 0.0, args.steps), (1e-4, 0.1, 4 * args.steps), (1e-3, 0.1, 4 * args.steps)]
    for lr, wd, steps in grid:
        mtp.load_state_dict(pretrained)
        losses = train(mtp, ft_data, steps, lr, wd)
        rows = compare(ref, state(mtp))
        results["finetune"].append({"lr": lr, "weight_decay": wd, "steps": steps, "loss": [losses[0], losses[-1]],
                                    "kinds": rows})
    # broken drafts
    swapped = {}
    for k in ref:
        if k.endswith(".gate"):
            swapped[k] = ref[k[: -len(".gate")] + ".up"]
        elif k.endswith(".up"):
            swapped[k] = ref[k[: -len(".up")] + ".gate"]
    results["broken"]["gate/up halves swapped"] = compare({k: ref[k] for k in swapped}, swapped)
    other_main, other = build(1)
    train(other, batches(other_main, Markov(128, 3), 64), PRETRAIN_STEPS, PRETRAIN_LR, 0.1)
    results["broken"]["another model's weights"] = compare(ref, state(other))
    ones = {k: torch.ones_like(v) for k, v in ref.items() if kind_of(k) == "norm"}
    results["broken"]["norms left at ones"] = compare({k: ref[k] for k in ones}, ones)
    results["seconds"] = round(time.time() - t0, 1)
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def render(results: dict) -> str:
    lines = ["finetune (AdamW)                        " + "  ".join(f"{k:>17}" for k in KINDS)]
    for run in results["finetune"]:
        label = f"lr {run['lr']:g} wd {run['weight_decay']:g} {run['steps']} steps loss {run['loss'][1]:.2f}"
        lines.append(f"{label:<40}" + "  ".join(_cell(run["kinds"].get(k)) for k in KINDS))
    for name, rows in results["broken"].items():
        lines.append(f"{name:<40}" + "  ".join(_cell(rows.get(k)) for k in KINDS))
        lines.append(f"{'  (max cosine)':<40}" + "  ".join(f"{rows[k]['max_cos']:>17.3f}" if k in rows else f"{'-':>17}"
                                                       for k in KINDS))
    lines.append("median RMS  " + "  ".join(f"{k} {v:.3g}" for k, v in results["rms"].items()))
    lines.append("cells: min cosine / norm ratio range (||after|| / ||before||)")
    return "\n".join(lines)


def _cell(r: dict | None) -> str:
    if not r:
        return f"{'-':>17}"
    return f"{r['min_cos']:6.3f} {r['min_ratio']:4.2f}-{r['max_ratio']:4.2f}"


if __name__ == "__main__":
    main_()
