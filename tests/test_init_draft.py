"""`ckpt init-draft`: dimension-matched MTP drafts that stitch back into their target.

Oracles: the original fixtures (key sets after init + stitch --mode add), transformers 5.24
(template trunks as save_pretrained writes them; a DeepSeek-V3 model generating with
use_mtp=True from the stitched checkpoint), numpy's generator called directly (the exact
values), and a subprocess's peak RSS (memory).

``python tests/test_init_draft.py --memory EXPERTS`` runs the memory measurement at full
size (hidden 4096, EXPERTS experts of width 1536) and prints the numbers.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.config import ConfigView
from ckpt_tools.model.expert_layouts import ExpertLayout
from ckpt_tools.model.tables.loader import all_tables, get_table
from ckpt_tools.model.tables.resolve import expert_specs, resolve, trunk_specs
from ckpt_tools.testing import fixture_config

from conftest import run_ckpt as ckpt
from conftest import tree_hash

TABLES = all_tables()
MTP_FAMILIES = sorted(f for f, t in TABLES.items() if t.kind == "mtp")
TEMPLATES = sorted(f for f, t in TABLES.items() if t.kind == "template")


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with the safetensors library."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def signature(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {k: (r.dtype, tuple(r.shape)) for k, r in Checkpoint.open(path).tensors.items()}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def mtp_count(family: str) -> int:
    t = get_table(family)
    return resolve(t, ConfigView(t.fixture)).mtp_count


# --------------------------------------------------------------------------- every family, through stitch


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_draft_stitched_into_the_trunk_restores_the_fixture(family, make_fixture, tmp_path):
    full = make_fixture(family)
    trunk = make_fixture(family, drop_mtp=True)
    before = tree_hash(trunk)
    draft, out = tmp_path / "draft", tmp_path / "stitched"
    ckpt("init-draft", trunk, "-o", draft, "--num-layers", mtp_count(family))
    released = signature(full)
    mtp = {k for k in released if k not in signature(trunk)}
    assert signature(draft) == {k: released[k] for k in mtp}  # exactly the family's MTP layout
    result = ckpt("stitch", draft, trunk, "-o", out, "--mode", "add", "--json", code=None)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["validation"]["ok"]
    assert signature(out) == released  # same keys, shapes and dtypes as the released layout
    assert tree_hash(trunk) == before


@pytest.mark.parametrize("family", TEMPLATES)
def test_template_draft_matches_the_trunk_layers(family, make_fixture, tmp_path):
    trunk = make_fixture(family)  # a template fixture is a trunk: its config declares no MTP
    draft, out = tmp_path / "draft", tmp_path / "stitched"
    ckpt("init-draft", trunk, "-o", draft)
    result = ckpt("stitch", draft, trunk, "-o", out, "--mode", "add", "--json")
    assert json.loads(result.stdout)["validation"]["ok"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    n = cfg["num_hidden_layers"]
    got = signature(out)
    added = {k: v for k, v in got.items() if k.startswith(f"model.layers.{n}.")}
    assert set(got) - set(added) == set(signature(trunk))
    glue = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    block = {k[len(f"model.layers.{n}."):]: v for k, v in added.items()}
    h = cfg["hidden_size"]
    assert block.pop("eh_proj.weight")[1] == (h, 2 * h)
    assert {k for k in block if k in glue} == glue - {"eh_proj.weight"}
    # the block is the target's own decoder layer (its last one, MoE for Qwen3-MoE) by name and shape
    last = {k[len(f"model.layers.{n - 1}."):]: v for k, v in got.items() if k.startswith(f"model.layers.{n - 1}.")}
    assert {k: v for k, v in block.items() if k not in glue} == last


TEMPLATE_TRANSFORMERS = [
    pytest.param("qwen3", "Qwen3ForCausalLM", {}, id="qwen3"),
    pytest.param("qwen3", "Qwen3ForCausalLM", {"attention_bias": True, "tie_word_embeddings": True},
                 id="qwen3-bias-tied"),
    pytest.param("qwen3_moe", "Qwen3MoeForCausalLM", {}, id="qwen3_moe"),
    pytest.param("qwen3_moe", "Qwen3MoeForCausalLM", {"mlp_only_layers": [], "decoder_sparse_step": 2},
                 id="qwen3_moe-sparse-step"),
    pytest.param("llama", "LlamaForCausalLM", {}, id="llama"),
    pytest.param("llama", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, id="llama-biases"),
]


@pytest.mark.parametrize(("family", "cls_name", "edit"), TEMPLATE_TRANSFORMERS)
def test_template_trunk_is_what_transformers_saves(family, cls_name, edit, tmp_path):
    """The template's trunk names are transformers 5.24's (save_pretrained of a tiny model)."""
    import transformers

    if family not in TABLES:
        pytest.skip(f"no {family} template")
    cfg = fixture_config(family, edit)
    res = resolve(get_table(family), ConfigView(cfg))
    specs, groups = trunk_specs(res)
    expected = {s.key: tuple(s.shape) for s in list(res.shared.values()) + specs}
    for g in groups:
        expected.update({s.key: tuple(s.shape) for s in expert_specs(g, ExpertLayout("per-expert"), res.dtype)})
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "cfg")
    getattr(transformers, cls_name)(config).save_pretrained(tmp_path / "saved")
    got = {k: tuple(v.shape) for k, v in tensors_of(tmp_path / "saved").items()}
    assert got == expected


# --------------------------------------------------------------------------- values


def reference(name: str, shape, std: float, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """The documented recipe, computed here with numpy and torch directly."""
    v = np.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(int(np.prod(shape)), dtype=np.float32)
    return torch.from_numpy(v * np.float32(std)).reshape(tuple(shape)).to(dtype)


def test_values_statistics_and_recipe(make_fixture, tmp_path):
    over = {"hidden_size": 512, "moe_intermediate_size": 256, "q_lora_rank": 128, "kv_lora_rank": 64}
    trunk = make_fixture("deepseek_v3", drop_mtp=True, config_overrides=over)
    draft = tmp_path / "draft"
    ckpt("init-draft", trunk, "-o", draft, "--std", "0.05", "--seed", "7")
    got = tensors_of(draft)
    res = resolve(get_table("deepseek_v3"), Checkpoint.open(trunk).config, mtp_count=1)
    specs = {s.key: s for s in res.mtp_specs()}
    assert set(got) == set(specs)
    seen = set()
    for key, t in got.items():
        s = specs[key]
        seen.add(s.kind)
        if s.copy_of:  # per-layer copies of the target's embedding / head: its bytes
            assert raw(t) == raw(tensors_of(trunk)[res.shared[s.copy_of].key]), key
        elif s.kind == "norm":
            assert torch.equal(t, torch.ones_like(t)), key  # plain RMSNorm family
        elif s.kind == "bias":
            assert t.dtype == torch.float32 and not t.any(), key  # router bias: F32 zeros
        else:
            assert torch.equal(t, reference(key, s.shape, 0.05, 7)), key
            std = t.float().std().item()
            assert abs(std - 0.05) < 0.05 * 0.05, (key, std)
            assert abs(t.float().mean().item()) < 0.05 * 0.1, key
    assert seen == {"norm", "bias", "linear", "router", "embedding"}
    manifest = json.loads((draft / "ckpt_manifest.json").read_text())
    rec = manifest["init"]
    assert (rec["seed"], rec["std"], rec["std_from"], rec["from_layer"]) == (7, 0.05, "--std", None)
    assert rec["target_config_sha256"] == hashlib.sha256((trunk / "config.json").read_bytes()).hexdigest()
    assert manifest["kind"] == "mtp-draft" and manifest["family"] == "deepseek_v3"


def test_zero_centred_norms_start_at_zero_and_std_comes_from_the_config(make_fixture, tmp_path):
    trunk = make_fixture("qwen3_next", drop_mtp=True, config_overrides={"initializer_range": 0.03})
    draft = tmp_path / "draft"
    ckpt("init-draft", trunk, "-o", draft)
    got = tensors_of(draft)
    norms = [k for k in got if k.endswith("norm.weight") or "norm_" in k]
    assert len(norms) >= 6
    for k in norms:
        assert not got[k].any(), k  # (1 + w) convention: w = 0 is the identity scale
    assert torch.equal(got["mtp.fc.weight"], reference("mtp.fc.weight", got["mtp.fc.weight"].shape, 0.03, 0))
    assert json.loads((draft / "ckpt_manifest.json").read_text())["init"]["std_from"] == "initializer_range"


def test_same_seed_same_bytes_whatever_the_sharding(make_fixture, tmp_path):
    trunk = make_fixture("qwen3_next", drop_mtp=True)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    ckpt("init-draft", trunk, "-o", a, "--seed", "3")
    ckpt("init-draft", trunk, "-o", b, "--seed", "3", "--max-shard-size", "20KB")
    ckpt("init-draft", trunk, "-o", c, "--seed", "4")
    assert len(list(b.glob("*.safetensors"))) > 3
    ta, tb, tc = tensors_of(a), tensors_of(b), tensors_of(c)
    assert {k: raw(v) for k, v in ta.items()} == {k: raw(v) for k, v in tb.items()}
    random = [k for k in ta if ta[k].float().std() > 0]
    assert random and all(not torch.equal(ta[k], tc[k]) for k in random)
    assert all(torch.equal(ta[k], tc[k]) for k in ta if k not in random)  # norms do not depend on the seed


def test_band_size_does_not_change_values():
    from ckpt_tools.numeric import init_values as iv

    r = iv.InitRecipe("model.layers.3.eh_proj.weight", "BF16", (37, 129), "normal", 0.02, 5)
    whole = b"".join(bytes(memoryview(c).cast("B")) for c in iv.produce(r, band=10**6))
    banded = b"".join(bytes(memoryview(c).cast("B")) for c in iv.produce(r, band=7))
    assert whole == banded == raw(reference(r.name, r.shape, 0.02, 5))
    src = iv.InitSource([iv.InitRecipe("n", "F32", (10,), "ones"), r])
    buf = bytearray(src.size)
    for start in (0, 300, 41, 9000, 40):  # forward, backward and overlapping reads
        end = min(src.size, start + 777)
        src.readinto(start, memoryview(buf)[start:end])
    src.readinto(0, memoryview(buf))
    assert bytes(buf) == np.ones(10, np.float32).tobytes() + whole


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "qwen3"])
def test_other_formats_equal_extract_of_the_native_draft(family, make_fixture, tmp_path):
    """--format X reuses extract's correspondence: the same bytes as extracting the native draft."""
    if family not in TABLES:
        pytest.skip(f"no {family} table")
    trunk = make_fixture(family, drop_mtp=True)
    native, direct, extracted = tmp_path / "native", tmp_path / "direct", tmp_path / "extracted"
    ckpt("init-draft", trunk, "-o", native, "--num-layers", "1")
    ckpt("init-draft", trunk, "-o", direct, "--format", "speculators", "--num-layers", "1")
    ckpt("extract", native, "-o", extracted, "--format", "speculators")
    d, e = tensors_of(direct), tensors_of(extracted)
    assert {k: raw(v) for k, v in d.items()} == {k: raw(v) for k, v in e.items()}
    assert any("experts" in k for k in d) == (family != "qwen3")
    cfg = json.loads((direct / "config.json").read_text())
    assert cfg["speculators_model_type"] == "mtp"
    plan = json.loads(ckpt("init-draft", trunk, "-o", tmp_path / "x", "--format", "speculators",
                           "--dry-run", "--json").stdout)
    assert not (tmp_path / "x").exists()
    ops = {t["recipe"]["op"] for t in plan["tensors"]}
    assert "init" in ops and ops <= {"init", "restack", "transpose", "concat", "copy"}


# --------------------------------------------------------------------------- --from-layer, config-only targets


def test_from_layer_copies_the_target_layer(make_fixture, tmp_path):
    trunk = make_fixture("deepseek_v3", drop_mtp=True)
    draft = tmp_path / "draft"
    ckpt("init-draft", trunk, "-o", draft, "--from-layer", "2")
    got, src = tensors_of(draft), tensors_of(trunk)
    n = Checkpoint.open(trunk).config.get("num_hidden_layers")
    copied = [k for k in got if k.startswith(f"model.layers.{n}.") and
              f"model.layers.2.{k[len(f'model.layers.{n}.'):]}" in src]
    assert len(copied) > 20
    for k in copied:
        assert raw(got[k]) == raw(src[k.replace(f"model.layers.{n}.", "model.layers.2.", 1)]), k
    assert torch.equal(got[f"model.layers.{n}.enorm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert json.loads((draft / "ckpt_manifest.json").read_text())["init"]["from_layer"] == 2
    r = ckpt("init-draft", trunk, "-o", tmp_path / "bad", "--from-layer", "0", code=3)  # dense layer, MoE block
    assert "from-layer-mismatch" in r.output and "mlp.gate.weight" in r.output
    ckpt("init-draft", trunk, "-o", tmp_path / "bad", "--from-layer", "9", code=2)


def test_from_layer_of_an_fp8_target_keeps_its_scales(make_fixture, tmp_path):
    trunk = make_fixture("deepseek_v3", drop_mtp=True, fp8=True)
    draft, out = tmp_path / "draft", tmp_path / "out"
    ckpt("init-draft", trunk, "-o", draft, "--from-layer", "1")
    got, src = tensors_of(draft), tensors_of(trunk)
    scales = [k for k in got if k.endswith("weight_scale_inv")]
    assert scales and all(raw(got[k]) == raw(src[k.replace("layers.3.", "layers.1.", 1)]) for k in scales)
    ckpt("stitch", draft, trunk, "-o", out, "--mode", "add")
    ckpt("init-draft", trunk, "-o", tmp_path / "a", "--from-layer", "1", "--format", "sglang-nextn",
         "--dequant", "bf16")
    assert not [k for k in tensors_of(tmp_path / "a") if k.endswith("weight_scale_inv")]
    # from scratch the draft holds no FP8 weight, so its config declares no FP8 quantization
    scratch = tmp_path / "scratch"
    ckpt("init-draft", trunk, "-o", scratch)
    assert "quantization_config" not in json.loads((scratch / "config.json").read_text())
    assert {t.dtype for t in tensors_of(scratch).values()} == {torch.bfloat16, torch.float32}
    ckpt("stitch", scratch, trunk, "-o", tmp_path / "stitched", "--mode", "add")


def test_from_layer_of_llm_compressors_fp8_block_release_reads_its_block_structure(tmp_path):
    """llm-compressor's FP8_BLOCK output (compressed-tensors, weight_scale over [128, 128] blocks): layer 1 is
    read with the parameters its config declares (not the table's per-tensor default); its experts cannot be
    kept as stored (the codec names why), and with --dequant the draft holds what `ckpt dequant` decodes."""
    src = Path(__file__).resolve().parents[1] / "fixtures" / "producers" / "llmcompressor-fp8-block"
    r = ckpt("init-draft", src, "-o", tmp_path / "kept", "--from-layer", "1", code=3)
    assert "[quant-capability]" in r.output and "whose codec (ct-fp8) cannot copy a layer" in r.output
    ckpt("init-draft", src, "-o", tmp_path / "d", "--from-layer", "1", "--dequant", "bf16")
    ckpt("dequant", src, "-o", tmp_path / "dq", "--allow-invalid", "mtp-missing")  # the producer dropped the MTP
    got, want = tensors_of(tmp_path / "d"), tensors_of(tmp_path / "dq")
    copied = {k: k.replace("layers.2.", "layers.1.", 1) for k in got if k.replace("layers.2.", "layers.1.", 1) in want}
    assert len(copied) == 26 and not [k for k in got if "weight_scale" in k]
    for k, w in copied.items():
        assert got[k].dtype == want[w].dtype and torch.equal(got[k], want[w]), k
    assert ckpt("validate", tmp_path / "d").exit_code == 0


def test_config_only_target(make_fixture, tmp_path):
    cfg = make_fixture("qwen3") / "config.json"
    ckpt("init-draft", cfg, "-o", tmp_path / "q", "--num-layers", "2")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    # optional per-layer copies (GLM) are left out without weights, and the manifest says so
    glm = make_fixture("glm4_moe") / "config.json"
    ckpt("init-draft", glm, "-o", tmp_path / "g")
    left = json.loads((tmp_path / "g" / "ckpt_manifest.json").read_text())["init"]["left_out"]
    assert left and all(k.endswith(("embed_tokens.weight", "shared_head.head.weight")) for k in left)
    assert not set(left) & set(tensors_of(tmp_path / "g"))
    # required copies (LongCat's own embedding; DeepSeek-V3's became optional) cannot be made up from a
    # config alone
    assert not get_table("longcat_flash").mtp.glue["embed"].optional
    r = ckpt("init-draft", make_fixture("longcat_flash") / "config.json", "-o", tmp_path / "d", code=3)
    assert "copy-needs-weights" in r.output
    ckpt("init-draft", cfg, "-o", tmp_path / "f", "--from-layer", "0", code=2)  # no weights to copy
    ckpt("init-draft", cfg, "-o", tmp_path / "s", "--format", "speculators", "--num-layers", "2", code=2)


# --------------------------------------------------------------------------- a real consumer


def test_transformers_deepseek_v3_generates_with_the_stitched_mtp(tmp_path):
    """transformers hard-codes DeepSeek-V3's MTP at layer 61: a 61-layer tiny model without MTP,
    init-draft + stitch --mode add, then MtpModel loads every MTP parameter from our tensors."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpModel

    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=61,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=2,
        num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=61, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=128,
        num_nextn_predict_layers=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(tmp_path / "target")
    ckpt("init-draft", tmp_path / "target", "-o", tmp_path / "draft")
    ckpt("stitch", tmp_path / "draft", tmp_path / "target", "-o", tmp_path / "stitched", "--mode", "add")

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "stitched")
    assert model.config.num_mtp_layers == 1
    mtp = MtpModel.from_pretrained(model)
    ours = tensors_of(tmp_path / "stitched")
    p = "model.layers.61."
    glue = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "post_norm.weight": "shared_head.norm.weight"}
    checked = 0
    for name, param in mtp.named_parameters():
        if name in ("embed_tokens.weight", "shared_head.weight"):  # the main model's, shared
            continue
        sub = name.removeprefix("layers.0.")
        if sub in glue:
            want = ours[p + glue[sub]]
        elif sub == "mtp_block.mlp.experts.gate_up_proj":
            want = torch.stack([torch.cat([ours[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                           ours[f"{p}mlp.experts.{e}.up_proj.weight"]]) for e in range(2)])
        elif sub == "mtp_block.mlp.experts.down_proj":
            want = torch.stack([ours[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(2)])
        else:
            want = ours[p + sub.removeprefix("mtp_block.")]
        assert torch.equal(param.detach(), want.to(param.dtype)), name
        checked += 1
    assert checked == len(list(mtp.named_parameters())) - 2 == 19
    ids = torch.tensor([[1, 5, 9, 3]])
    with_mtp = model.generate(ids, max_new_tokens=5, do_sample=False, use_mtp=True)
    plain = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert with_mtp.shape == (1, 9) and torch.equal(with_mtp, plain)  # greedy drafting never changes the output


# --------------------------------------------------------------------------- memory


MEMORY_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48,
    "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 64,
    "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initializer_range": 0.02,
}

# Peak RSS from /proc/self/status VmHWM: unlike getrusage's ru_maxrss, which Linux carries over
# from the parent across fork + exec, it belongs to this process's own address space.
_CHILD = """
import json, re, sys, time
def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
import numpy, safetensors, huggingface_hub, rich  # the libraries a run may load (torch is not one)
import ckpt_tools.ops.draft.init_draft, ckpt_tools.ops.check.validate, ckpt_tools.stream.writer
from ckpt_tools.cli import app
base = hwm()
t = time.monotonic()
try:
    app(["init-draft", sys.argv[1], "-o", sys.argv[2], "--json"])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps({"base_kb": base, "peak_kb": hwm(), "seconds": time.monotonic() - t,
                  "torch_loaded": "torch" in sys.modules}))
"""


def measure_memory(workdir: Path, experts: int) -> dict:
    """Peak RSS of `ckpt init-draft` in a fresh process (output written for real, then deleted)."""
    import shutil

    cfg = dict(MEMORY_CONFIG, num_experts=experts)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(cfg))
    out = workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(workdir / "config.json"), str(out)],
                              capture_output=True, text=True, check=True)
        stats = json.loads(proc.stdout.strip().splitlines()[-1])
        manifest = json.loads((out / "ckpt_manifest.json").read_text())
        sizes = [int(np.prod(e["shape"])) * 2 for e in manifest["tensors"].values()]
        stats.update(largest_tensor=max(sizes), total_bytes=sum(sizes), tensors=len(sizes))
        return stats
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_peak_memory_is_bounded_by_bands(tmp_path):
    """hidden 4096 (the fusion is a 64 MB tensor), 2 experts of width 1536: ~230 MB written.
    (`python tests/test_init_draft.py --memory 64` measures 64 experts: 2.6 GB, same peak.)"""
    stats = measure_memory(tmp_path, experts=2)
    peak, largest = stats["peak_kb"] * 1024, stats["largest_tensor"]
    assert largest == 4096 * 8192 * 2 and stats["total_bytes"] > 3 * largest
    assert peak < 300 * 2**20 + largest, stats  # the bound
    assert not stats["torch_loaded"], "init-draft computes in numpy: torch alone is ~250 MB of RSS"
    # the run itself stays near one tensor (bands, copy and hashing buffers, allocator arenas), not the draft
    assert peak - stats["base_kb"] * 1024 < largest + 32 * 2**20, stats


if __name__ == "__main__":  # full-size measurement: python tests/test_init_draft.py --memory 64
    import tempfile

    n = int(sys.argv[sys.argv.index("--memory") + 1]) if "--memory" in sys.argv else 64
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        s = measure_memory(Path(d), n)
    mb = 2**20
    print(f"{n} experts: {s['tensors']} tensors, {s['total_bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s; "
          f"peak RSS {s['peak_kb'] / 1024:.0f} MB (after imports {s['base_kb'] / 1024:.0f} MB), "
          f"largest tensor {s['largest_tensor'] / mb:.0f} MB")
