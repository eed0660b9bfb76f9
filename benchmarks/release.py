"""A sparse replica of the DeepSeek-V3 release: every key, dtype and shape as released, no weights.

163 shards, 91,991 tensors, 688.6 GB apparent (641 GiB), a few MB on disk: each shard is its real
header followed by a hole (``truncate``), so planning commands see the release exactly as they would
on disk, and reading a tensor's bytes returns zeros. Nothing is downloaded; standard library only.

The keys, dtypes and shapes follow from the release's config (FP8 e4m3 128x128 block weights with F32
``weight_scale_inv``, bf16 norms, embeddings, router and MTP glue; F32 ``e_score_correction_bias``) and
were checked against the release's tensor list (91,991 tensors; see BENCHMARKS.md). The assignment to
shards keeps the release's anchors: ``model.embed_tokens`` and the dense layers 0-2 in shard 1,
``model.norm`` and ``lm_head`` opening shard 160, the MTP layer 61 in shards 160-163 with its glue
(``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``) in shard 163; between the anchors
the layers are cut into shards of equal size in module order (the release's exact cut points are not
needed for planning: every shard holds ~560 tensors of a few layers, as there).

``nomtp=True`` builds the same release as a quantizer that dropped the MTP layer leaves it: layer 61
gone (shards 161-163 with it), ``num_nextn_predict_layers`` kept: the target of ``ckpt graft``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

SHARDS = 163
INDEX = "model.safetensors.index.json"

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

BITS = {"F8_E4M3": 8, "BF16": 16, "F32": 32}
Entry = tuple[str, str, tuple[int, ...]]  # key, dtype, shape


def _fp8(name: str, out: int, inp: int) -> list[Entry]:
    """A block-FP8 linear: e4m3 weight and its F32 inverse scale per 128 x 128 block."""
    return [(f"{name}.weight", "F8_E4M3", (out, inp)),
            (f"{name}.weight_scale_inv", "F32", (math.ceil(out / 128), math.ceil(inp / 128)))]


def _mlp(prefix: str, hidden: int, inter: int) -> list[Entry]:
    return (_fp8(f"{prefix}.gate_proj", inter, hidden) + _fp8(f"{prefix}.up_proj", inter, hidden)
            + _fp8(f"{prefix}.down_proj", hidden, inter))


def layer_entries(i: int, c: dict = CONFIG) -> list[Entry]:
    """Decoder layer ``i`` in module order (attention, MLP or MoE, norms)."""
    h, p = c["hidden_size"], f"model.layers.{i}"
    heads, nope, rope, v = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                            c["v_head_dim"])
    q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
    out: list[Entry] = []
    out += _fp8(f"{p}.self_attn.q_a_proj", q_rank, h)
    out.append((f"{p}.self_attn.q_a_layernorm.weight", "BF16", (q_rank,)))
    out += _fp8(f"{p}.self_attn.q_b_proj", heads * (nope + rope), q_rank)
    out += _fp8(f"{p}.self_attn.kv_a_proj_with_mqa", kv_rank + rope, h)
    out.append((f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (kv_rank,)))
    out += _fp8(f"{p}.self_attn.kv_b_proj", heads * (nope + v), kv_rank)
    out += _fp8(f"{p}.self_attn.o_proj", h, heads * v)
    if i < c["first_k_dense_replace"]:
        out += _mlp(f"{p}.mlp", h, c["intermediate_size"])
    else:
        n, inter = c["n_routed_experts"], c["moe_intermediate_size"]
        out.append((f"{p}.mlp.gate.weight", "BF16", (n, h)))
        out.append((f"{p}.mlp.gate.e_score_correction_bias", "F32", (n,)))
        for e in range(n):
            out += _mlp(f"{p}.mlp.experts.{e}", h, inter)
        out += _mlp(f"{p}.mlp.shared_experts", h, inter * c["n_shared_experts"])
    out.append((f"{p}.input_layernorm.weight", "BF16", (h,)))
    out.append((f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
    return out


def nbytes(e: Entry) -> int:
    return math.prod(e[2]) * BITS[e[1]] // 8


def _cut(entries: list[Entry], n: int) -> list[list[Entry]]:
    """``entries`` in order into exactly ``n`` shards of about equal bytes (a tensor never splits)."""
    total = sum(nbytes(e) for e in entries)
    out: list[list[Entry]] = [[] for _ in range(n)]
    done = 0
    for e in entries:
        out[min(n - 1, done * n // total)].append(e)
        done += nbytes(e)
    assert all(out), "a shard came out empty"
    return out


def shard_entries(c: dict = CONFIG, nomtp: bool = False) -> list[list[Entry]]:
    """The release's tensors, shard by shard (see the module docstring for the anchors)."""
    h, vocab, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    first = [("model.embed_tokens.weight", "BF16", (vocab, h))]
    for i in range(c["first_k_dense_replace"]):
        first += layer_entries(i, c)
    middle = [e for i in range(c["first_k_dense_replace"], layers) for e in layer_entries(i, c)]
    head = [("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (vocab, h))]
    m = f"model.layers.{layers}"
    mtp = layer_entries(layers, c) + [
        (f"{m}.embed_tokens.weight", "BF16", (vocab, h)), (f"{m}.enorm.weight", "BF16", (h,)),
        (f"{m}.hnorm.weight", "BF16", (h,)), (f"{m}.eh_proj.weight", "BF16", (h, 2 * h)),
        (f"{m}.shared_head.norm.weight", "BF16", (h,)), (f"{m}.shared_head.head.weight", "BF16", (vocab, h)),
    ]
    shards = [first] + _cut(middle, SHARDS - 5)
    if nomtp:
        return shards + [head]
    return shards + _cut(head + mtp, 4)


def shard_name(i: int, n: int = SHARDS) -> str:
    return f"model-{i + 1:05d}-of-{n:06d}.safetensors"


# the safetensors writer's order in a file (the release's too): by dtype, descending in its enum's order, then by name;
# the F32 scales of a shard lie end to end (read in a few runs), and the header lists tensors in that order
WRITER_ORDER = {"F32": 0, "BF16": 1, "F8_E4M3": 2}


def write_shard(path: Path, entries: list[Entry]) -> int:
    """Header as the release writes it, then a hole for the data; returns the data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for key, dtype, shape in sorted(entries, key=lambda e: (WRITER_ORDER[e[1]], e[0])):
        n = nbytes((key, dtype, shape))
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + pos)  # sparse: the weights are a hole that reads as zeros
    return pos


def build(out: str | os.PathLike, nomtp: bool = False) -> Path:
    """Write the replica into ``out`` (created; must not hold another checkpoint)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_entries(nomtp=nomtp)
    # a quantizer that dropped the MTP leaves the release's file names (the count in them too)
    names = [shard_name(i) for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for name, entries in zip(names, shards, strict=True):
        total += write_shard(out / name, entries)
        weight_map.update((e[0], name) for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
                    "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.46.3"}, indent=2) + "\n")
    return out


def disk_bytes(path: Path) -> int:
    """Bytes the directory really occupies (blocks), against its apparent size."""
    return sum(p.stat().st_blocks * 512 for p in Path(path).iterdir())


# --- extract --format gguf on the replica: bytes read (issue 41) ------------------------------------------------

SHARED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
SCALE_SUFFIX = "_scale_inv"


def sidecar_bytes(c: dict = CONFIG) -> dict[str, int]:
    """What a GGUF sidecar of the release reads, by the release's tensor list: the MTP layer's tensors, the shared
    ones (embedding, final norm, head), and what every verb's gate reads besides: every FP8 scale of the trunk
    (rule quant-scale-value). ``all``: every tensor's bytes."""
    m = f"model.layers.{c['num_hidden_layers']}."
    entries = [e for shard in shard_entries(c) for e in shard]
    return {"mtp": sum(nbytes(e) for e in entries if e[0].startswith(m)),
            "shared": sum(nbytes(e) for e in entries if e[0] in SHARED),
            "trunk_scales": sum(nbytes(e) for e in entries if e[0].endswith(SCALE_SUFFIX) and not e[0].startswith(m)),
            "all": sum(nbytes(e) for e in entries)}


def header_bytes(src: Path) -> int:
    """The shards' headers (8 + JSON) and the side files (config, index ...): what any reader reads first."""
    total = 0
    for p in Path(src).iterdir():
        if p.suffix == ".safetensors":
            with open(p, "rb") as f:
                total += 8 + struct.unpack("<Q", f.read(8))[0]
        elif p.is_file():
            total += p.stat().st_size
    return total


def trunk_gguf(src: Path, path: Path) -> Path:
    """A trunk GGUF for the replica: llama.cpp's key-values and a stand-in vocabulary of the release's size, no
    tensors (a sidecar takes nothing else of its trunk)."""
    from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

    from .scale import _zero_scales

    if not Path(path).exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_trunk_gguf(src, path, tensors=False, allow=tuple(_zero_scales()[1:]))
    return Path(path)


def gguf_read(workdir: Path, out: Path | None = None) -> dict:
    """``ckpt extract REPLICA --format gguf`` in a child process, its bytes read (/proc/PID/io ``rchar``: every
    read-like syscall, imports included; ``read_bytes``: from the device) against what the sidecar needs. No
    timing: the wall time is the lead's to take on a quiet machine."""
    import shutil

    from .measure import run
    from .scale import _zero_scales, build_inputs, ckpt_argv

    src, _ = build_inputs(workdir)
    trunk = trunk_gguf(src, workdir / "trunk" / "trunk.gguf")
    out = out or workdir / "sidecar"
    shutil.rmtree(out, ignore_errors=True)
    argv = ckpt_argv() + ["extract", str(src), "--format", "gguf", "--gguf-trunk", str(trunk), "-o", str(out),
                          *_zero_scales()]
    s = run(argv, log=workdir / "logs" / "extract-gguf.log", timeout=6 * 3600.0)
    need = sidecar_bytes()
    headers = header_bytes(src)
    bound = need["mtp"] + need["shared"] + need["trunk_scales"] + headers
    written = sum(p.stat().st_size for p in out.glob("*.gguf")) if out.is_dir() else 0
    shutil.rmtree(out, ignore_errors=True)
    return {"returncode": s.returncode, "rchar": s.rchar, "read_bytes": s.read_bytes, "wchar": s.wchar,
            "written": written, **need, "headers": headers, "bound": bound,
            "rchar_over_needed": s.rchar / (need["mtp"] + need["shared"]), "rchar_over_bound": s.rchar / bound,
            "error": None if s.returncode == 0 else s.stderr_tail[-800:]}


if __name__ == "__main__":  # python -m benchmarks.release DIR [--nomtp] | --gguf-read WORKDIR
    import sys

    if sys.argv[1] == "--gguf-read":
        print(json.dumps(gguf_read(Path(sys.argv[2])), indent=1))
        sys.exit(0)
    d = build(sys.argv[1], nomtp="--nomtp" in sys.argv)
    print(f"{d}: {sum(1 for _ in d.glob('*.safetensors'))} shards, "
          f"{len(json.loads((d / INDEX).read_text())['weight_map'])} tensors, {disk_bytes(d) / 1e6:.1f} MB on disk")
