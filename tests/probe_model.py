"""Tiny trained DeepSeek-V3- and GLM-4-MoE-layout verifiers with one MTP layer, for `ckpt probe` tests.

Training a 61-layer model is slow, so a 2-layer trunk and its MTP layer are trained together on a
synthetic language (a Markov chain: each token is followed by ``PERM[token]`` with probability
0.9). The checkpoint then holds 61 layers: the two trained ones, and 59 whose output projections
are zero, so each is exactly the identity on the residual stream. The MTP layer sits at
``model.layers.61.*`` in the released per-expert layout, where ``MtpModel.from_pretrained``
finds it. The GLM-4-MoE model is built the same way with 46 layers (MTP at ``model.layers.46.*``).
Deterministic for the seed; cached on disk keyed by a hash of this file.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.modeling_layers import MtpModel

SEED = 0
VOCAB = 128
FIRST = 3  # tokens 0..2 are pad / bos / eos
STEPS = 100
TRAINED_LAYERS = 2
MLA = dict(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
# name -> (layers where MtpModel.from_pretrained finds the MTP layer, config class, model class, attention
# options, dense trunk). A dense trunk has no MoE layer at all while its MTP layer is MoE (``first_k_dense_replace``
# = the trunk's depth): the MTP block is then made unlike any trunk layer, as the engines build it (the family's
# decoder-layer class at the MTP index). "glm4_moe_gqa32" is the model vLLM's CPU build serves: the 2 trained
# layers and one MoE identity layer (vLLM's GLM-4-MoE needs an MoE trunk layer), head_dim 32 (a width its
# attention kernels accept), MTP at model.layers.3.
FAMILIES = {
    "deepseek_v3": (61, "DeepseekV3Config", "DeepseekV3ForCausalLM", MLA, False),
    "glm4_moe": (46, "Glm4MoeConfig", "Glm4MoeForCausalLM", dict(head_dim=16), False),
    "deepseek_v3_dense": (61, "DeepseekV3Config", "DeepseekV3ForCausalLM", MLA, True),
    "glm4_moe_gqa32": (3, "Glm4MoeConfig", "Glm4MoeForCausalLM", dict(head_dim=32), False),
}
VLLM_MODEL = "glm4_moe_gqa32"
TABLE_FAMILY = {"deepseek_v3_dense": "deepseek_v3", "glm4_moe_gqa32": "glm4_moe"}  # the variants' family tables


def table_family(name: str) -> str:
    return TABLE_FAMILY.get(name, name)
# where transformers' MtpModel finds the MTP layer (its classes' hard-coded model.layers.61 / .46 patterns)
MTP_MODEL_FAMILIES = [f for f in FAMILIES if f != VLLM_MODEL]
MTP_PREFIX = "model.layers.61."  # DeepSeek-V3's


def mtp_prefix(family: str = "deepseek_v3") -> str:
    return f"model.layers.{FAMILIES[family][0]}."


def tiny_config(layers: int | None = None, family: str = "deepseek_v3"):
    """The trained model's config (``layers`` deep, all dense) or, by default, the full-depth trunk's: dense but for
    its last layer, an MoE identity layer like the MTP layer (which is MoE whatever ``first_k_dense_replace``).
    One MoE trunk layer keeps every trunk path (experts stored, quantized, loaded) at a fraction of the cost: the
    identity layers' MoE took about half of each probe's forward passes."""
    full, config_cls, _, attention, dense_trunk = FAMILIES[family]
    depth = full if layers is None else layers
    first_dense = depth if dense_trunk else full - 1 if layers is None else 3
    return getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=depth,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=first_dense, max_position_embeddings=128,
        num_nextn_predict_layers=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **attention,
    )


def model_class(family: str):
    return getattr(transformers, FAMILIES[family][2])


def permutation() -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return FIRST + torch.randperm(VOCAB - FIRST, generator=g)


def sample(n: int, length: int, g: torch.Generator) -> torch.Tensor:
    perm = permutation()
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(FIRST, VOCAB, (n,), generator=g)
    for t in range(1, length):
        follow = perm[x[:, t - 1] - FIRST]
        noise = torch.randint(FIRST, VOCAB, (n,), generator=g)
        x[:, t] = torch.where(torch.rand(n, generator=g) < 0.9, follow, noise)
    return x


def write_prompts(directory, n: int, length: int, seed: int):
    """``n`` prompts of ``length`` tokens from the training language, as a prompts.jsonl in ``directory``."""
    x = sample(n, length, torch.Generator().manual_seed(seed))
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in x))
    return path


def mtp_logits(mtp: MtpModel, hidden: torch.Tensor, ids: torch.Tensor, layer: int = 0, depth: int = 1):
    """Teacher-forced depth-``depth`` pass: hidden[:, t] with the token at t + depth -> logits for t + depth + 1."""
    n = ids.shape[1] - depth
    pos = torch.arange(depth, depth + n).unsqueeze(0).expand(ids.shape[0], -1)
    h = mtp.forward_layer(layer, hidden[:, :n], pos, None, input_ids=ids[:, depth:])
    return h, mtp._project_to_logits(h)


def _init_std(name: str) -> float:
    """0.3 for the MTP layer's expert and shared-expert projections, else 0.05.

    From a 0.05 start the MLP learns nothing in 100 steps (zeroing it even lowers the KL), so a
    draft with gate/up exchanged measures like the original. Started at 0.3 the MLP carries the
    prediction: zeroing it drops depth-1 agreement to about 0.1, exchanging gate/up raises the KL.
    """
    return 0.3 if ".mlp." in name and not name.endswith("mlp.gate.weight") else 0.05


def _init_mtp(mtp: MtpModel, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * _init_std(name))
        for name, b in mtp.layers.named_buffers():
            if "e_score_correction_bias" in name:
                b.zero_()


def train(family: str = "deepseek_v3") -> tuple[transformers.PreTrainedModel, MtpModel, float]:
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    main = model_class(family)(tiny_config(TRAINED_LAYERS, family))
    mtp = MtpModel(main, 1)
    _init_mtp(mtp, g)
    params = {id(p): p for p in [*main.parameters(), *mtp.layers.parameters()]}
    opt = torch.optim.AdamW(params.values(), lr=2e-2)
    ce = torch.nn.functional.cross_entropy
    for _ in range(STEPS):
        x = sample(16, 16, g)
        out = main(x, output_hidden_states=True)
        loss = ce(out.logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        _, logits = mtp_logits(mtp, out.hidden_states[-1], x)
        loss = loss + ce(logits[:, :-1].reshape(-1, VOCAB), x[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    main.eval()
    mtp.eval()
    return main, mtp, time.perf_counter() - t0


def _trunk(trained: transformers.PreTrainedModel, family: str) -> transformers.PreTrainedModel:
    """The full-depth trunk: the trained layers, then identity layers up to where MtpModel looks."""
    torch.manual_seed(SEED)
    big = model_class(family)(tiny_config(family=family))
    state = big.state_dict()
    small = trained.state_dict()
    for k, v in small.items():
        state[k] = v.clone()  # same names: layers 0 and 1, embedding, norm, head
    for k in state:
        parts = k.split(".")
        if k.startswith("model.layers.") and int(parts[2]) >= TRAINED_LAYERS and (
                k.endswith("o_proj.weight") or k.endswith("down_proj.weight") or k.endswith("experts.down_proj")):
            state[k] = torch.zeros_like(state[k])  # identity layer: nothing added to the residual stream
    big.load_state_dict(state)
    return big


def mtp_checkpoint_tensors(mtp: MtpModel, prefix: str = MTP_PREFIX) -> dict[str, torch.Tensor]:
    """The MTP layer in the released names (DeepSeek-V3's, also GLM-4-MoE's) and per-expert layout."""
    out: dict[str, torch.Tensor] = {}
    sd = mtp.layers[0].state_dict()
    for k, v in sd.items():
        if k.startswith("mtp_block."):
            name = k[len("mtp_block."):]
        elif k.startswith("post_norm."):
            name = "shared_head.norm." + k[len("post_norm."):]
        else:
            name = k
        if name == "mlp.experts.gate_up_proj":
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = v[e, :half].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = v[e, half:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[prefix + name] = v.clone().contiguous()
    return out


def _digest() -> str:
    versions = f"{transformers.__version__} {torch.__version__}".encode()
    return hashlib.sha256(Path(__file__).read_bytes() + versions).hexdigest()[:16]


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread. The models are 32 wide: threads gain nothing, and under pytest-xdist on
    2 cores (2 workers x 2 threads) OpenMP's spin waits made one probe run take 302 s instead of 15 s."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(was)


CACHE = Path(tempfile.gettempdir()) / "ckpt-tools-test-cache"  # trained models, kept between test runs


@pytest.fixture(autouse=True, scope="module")
def one_thread_per_module() -> Iterator[None]:
    """Import it into a test module to run that module's torch on one thread (see ``one_thread``)."""
    with one_thread():
        yield


def build(cache_root: Path = CACHE, family: str = "deepseek_v3") -> tuple[Path, float]:
    """The trained checkpoint directory (built once per digest) and the seconds training took (0 if cached)."""
    return cached(cache_root, f"probe-{family}-{_digest()}", lambda d: _build(d, family))


def cached(cache_root: Path, name: str, make) -> tuple[Path, float]:
    """``cache_root / name``, made by ``make(directory) -> (directory, seconds)`` on one thread unless a finished
    one (holding ``DONE``) is there: then (directory, 0.0)."""
    import fcntl

    cache_root.mkdir(parents=True, exist_ok=True)
    d = cache_root / name
    with open(cache_root / f"{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers build it once
        if (d / "DONE").exists():
            return d, 0.0
        with one_thread():
            return make(d)


def _build(d: Path, family: str) -> tuple[Path, float]:
    main, mtp, seconds = train(family)
    big = _trunk(main, family)
    tmp = d.with_name(d.name + ".tmp")
    big.save_pretrained(tmp, max_shard_size="400KB" if FAMILIES[family][0] > 10 else "60KB")  # sharded
    mtp_t = mtp_checkpoint_tensors(mtp, mtp_prefix(family))
    save_file(mtp_t, str(tmp / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((tmp / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp_t})
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in mtp_t.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "DONE").write_text(f"{seconds:.1f}\n")
    if d.exists():
        import shutil

        shutil.rmtree(d)
    tmp.rename(d)
    return d, seconds


def edited(draft: Path, out: Path, edit) -> Path:
    """A copy of an extracted draft with ``edit(tensors)`` applied (its manifest dropped: the bytes changed)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(draft, out)
    [f] = out.glob("*.safetensors")
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    (out / "ckpt_manifest.json").unlink(missing_ok=True)
    return out


def swap_eh_proj_halves(tensors: dict) -> None:
    """The two concat halves of eh_proj exchanged (a trainer's [h, e] order)."""
    [key] = [k for k in tensors if k.endswith("eh_proj.weight")]
    w = tensors[key]
    h = w.shape[1] // 2
    tensors[key] = torch.cat([w[:, h:], w[:, :h]], dim=1).contiguous()
