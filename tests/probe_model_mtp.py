"""A tiny trained Qwen3-Next verifier (a ``mtp.*`` family) with one MTP layer, for `ckpt probe` tests.

The trunk has two decoder layers, ``[linear_attention, full_attention]`` (Gated DeltaNet on
transformers' torch fallback, then gated attention), each with a 4-expert MoE. The MTP layer is
probe's own table-driven engine (``ckpt_tools.ops.probe.mtp_engine``) built over the model being trained:
an initial checkpoint in the release layout is written, the engine is built from it around the
trunk, and trunk and engine are trained together on probe_model's synthetic Markov language. The
engine's trained tensors are then saved under the release names (``mtp.fc``, ``mtp.pre_fc_norm_*``,
``mtp.norm``, ``mtp.layers.0.*`` with per-expert MoE) in their own shard beside the trunk's shards,
and an engine rebuilt from the saved checkpoint must give the trained engine's logits exactly.
Deterministic for the seed; cached on disk keyed by a hash of this file and probe_model.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import probe_model
import torch
import transformers
from probe_model import CACHE, SEED, VOCAB, sample
from safetensors.torch import save_file

FAMILY = "qwen3_next"
STEPS = 60  # agreement is 1.0 from 40 steps on; the KL keeps falling (0.20 at 40, 0.09 at 60)
MTP_SHARD = "model-mtp.safetensors"
GLUE = {  # engine attribute of TableMtpLayer -> release name (mappings/architectures/qwen3_next.yaml, mtp.glue)
    "enorm": "mtp.pre_fc_norm_embedding.weight",
    "hnorm": "mtp.pre_fc_norm_hidden.weight",
    "fusion": "mtp.fc.weight",
    "post_norm": "mtp.norm.weight",
}
BLOCK_PREFIX = "mtp.layers.0."


def tiny_config() -> transformers.PretrainedConfig:
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1,
        max_position_embeddings=128, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _initial_mtp(config, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The MTP layer before training, in release names: a full-attention decoder layer as transformers
    initialises one (seeded apart from the trunk's), zero (identity) zero-centred norms, a random fusion."""
    torch.manual_seed(SEED + 2)
    donor = transformers.Qwen3NextForCausalLM(config)
    [full] = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    block = block_release_tensors(donor.model.layers[full].state_dict())
    h = config.hidden_size
    glue = {GLUE["enorm"]: torch.zeros(h), GLUE["hnorm"]: torch.zeros(h), GLUE["post_norm"]: torch.zeros(h),
            GLUE["fusion"]: torch.randn(h, 2 * h, generator=g) * 0.1}
    return {**glue, **block}


def block_release_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder layer's state dict (transformers' fused experts) in the release names, per-expert layout."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k == "mlp.experts.gate_up_proj":  # [experts, 2 * inter, hidden]: gate rows first
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{BLOCK_PREFIX}mlp.experts.{e}.gate_proj.weight"] = v[e, :half]
                out[f"{BLOCK_PREFIX}mlp.experts.{e}.up_proj.weight"] = v[e, half:]
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"{BLOCK_PREFIX}mlp.experts.{e}.down_proj.weight"] = v[e]
        else:
            out[BLOCK_PREFIX + k] = v
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def engine_release_tensors(engine) -> dict[str, torch.Tensor]:
    """The engine's one MTP layer under the release names."""
    [layer] = engine.layers
    [block] = layer.blocks
    glue = {name: getattr(layer, attr).weight.detach().clone().contiguous() for attr, name in GLUE.items()}
    return {**glue, **block_release_tensors(block.state_dict())}


def save(main, mtp: dict[str, torch.Tensor], d: Path) -> None:
    """The trunk in several shards (transformers' writer), the MTP layer in a shard of its own, one index."""
    was = main.config.dtype
    main.save_pretrained(d, max_shard_size="60KB")
    main.config.dtype = was  # save_pretrained leaves the string "float32" there, which the engine cannot build with
    save_file(mtp, str(d / MTP_SHARD), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: MTP_SHARD for k in mtp})
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in mtp.values())
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def engine_over(main, d: Path):
    """probe's engine for checkpoint ``d``'s MTP layer, built around ``main``."""
    from ckpt_tools.io.checkpoint import Checkpoint
    from ckpt_tools.ops.probe import load as probe_load
    from ckpt_tools.ops.probe import mtp_engine

    with Checkpoint.open(d) as c:
        engine, _ = mtp_engine.build(main, c, probe_load.stored_tensors(c), None, "fp32", "cpu", str(d))
    return engine


def mtp_logits(engine, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced depth 1 (probe's ``chain_logits`` call): hidden[:, t] with ids[:, t + 1] -> logits for t + 2."""
    n = ids.shape[1] - 1
    pos = torch.arange(1, n + 1).unsqueeze(0)  # [1, n], as probe passes them: the engine takes one row for a batch
    return engine._project_to_logits(engine.forward_layer(0, hidden[:, :n], pos, None, input_ids=ids[:, 1:]))


def train(work: Path) -> tuple[transformers.PreTrainedModel, object, float]:
    """Trunk and engine trained together; ``work`` receives the initial checkpoint the engine is built from."""
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(SEED)
    config = tiny_config()
    initial = _initial_mtp(config, g)
    torch.manual_seed(SEED)
    main = transformers.Qwen3NextForCausalLM(config)
    save(main, initial, work)
    engine = engine_over(main, work)
    params = {id(p): p for p in [*main.parameters(), *engine.layers.parameters()]}
    opt = torch.optim.AdamW(params.values(), lr=2e-2)
    ce = torch.nn.functional.cross_entropy
    main.train()
    for _ in range(STEPS):
        x = sample(16, 16, g)
        out = main(x, output_hidden_states=True)
        loss = ce(out.logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        logits = mtp_logits(engine, out.hidden_states[-1], x)
        loss = loss + ce(logits[:, :-1].reshape(-1, VOCAB), x[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    main.eval()
    return main, engine, time.perf_counter() - t0


def _digest() -> str:
    versions = f"{transformers.__version__} {torch.__version__}".encode()
    sources = Path(__file__).read_bytes() + Path(probe_model.__file__).read_bytes()
    return hashlib.sha256(sources + versions).hexdigest()[:16]


def build(cache_root: Path = CACHE) -> tuple[Path, float]:
    """The trained checkpoint directory (built once per digest) and the seconds training took (0 if cached)."""
    return probe_model.cached(cache_root, f"probe-{FAMILY}-{_digest()}", _build)


def _build(d: Path) -> tuple[Path, float]:
    tmp, init = d.with_name(d.name + ".tmp"), d.with_name(d.name + ".init")
    for p in (tmp, init):
        shutil.rmtree(p, ignore_errors=True)
    main, engine, seconds = train(init)
    save(main, engine_release_tensors(engine), tmp)
    _check_saved(main, engine, tmp)
    shutil.rmtree(init)
    (tmp / "DONE").write_text(f"{seconds:.1f}\n")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d, seconds


def _check_saved(main, engine, d: Path) -> None:
    """The engine rebuilt from the saved release names gives the trained engine's logits exactly."""
    x = sample(4, 16, torch.Generator().manual_seed(SEED + 3))
    with torch.no_grad():
        hidden = main(x, output_hidden_states=True).hidden_states[-1]
        trained, saved = mtp_logits(engine, hidden, x), mtp_logits(engine_over(main, d), hidden, x)
    if not torch.equal(trained, saved):
        raise AssertionError(f"the saved MTP layer is not the trained one: max abs difference "
                             f"{float((trained - saved).abs().max())}")


def swap_fusion_halves(tensors: dict) -> None:
    """The fusion's two concat halves exchanged (a trainer's [h, e] order): ``mtp.fc`` (native) or speculators'
    ``input_proj``."""
    [key] = [k for k in tensors if k.endswith(("fc.weight", "input_proj.weight"))]
    w = tensors[key]
    h = w.shape[1] // 2
    tensors[key] = torch.cat([w[:, h:], w[:, :h]], dim=1).contiguous()
