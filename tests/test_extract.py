"""`ckpt extract`: native round trips, draft formats against hand-written golden lists,
speculators config fields, bounded reads, the trunk, and the errors users hit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.tables.loader import all_tables

from conftest import run_ckpt as ckpt
from conftest import tree_hash

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"
MTP_FAMILIES = sorted(f for f, t in all_tables().items() if t.kind == "mtp")


def tensors_of(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """key -> (dtype, shape, raw bytes), read with the safetensors library (independent reader)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                out[k] = (str(t.dtype), list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def read_golden(path: Path) -> dict[str, list[int]]:
    gold = {}
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, shape = line.split("\t")
        gold[key] = json.loads(shape)
    return gold


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_native_extract_reproduces_source_mtp_bytes(family, make_fixture, tmp_path):
    src = make_fixture(family)
    before = tree_hash(src)
    out = tmp_path / "draft"
    ckpt("extract", src, "-o", out)
    source = tensors_of(src)
    draft = tensors_of(out)
    expected = set(open_mtp(Checkpoint.open(src)).keys())
    assert set(draft) == expected
    for key, value in draft.items():  # native: names are the source names, bytes the source bytes
        assert value == source[key], key
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    assert manifest["format"] == "native" and manifest["family"] == family
    for key, entry in manifest["tensors"].items():
        assert entry["source"] == [key]
        assert entry["dtype"] and entry["shape"] == draft[key][1]
        assert len(entry["blake3"]) == 64
    assert (out / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert tree_hash(src) == before


def test_native_fp8_extract_keeps_scales(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3", fp8=True)
    out = tmp_path / "draft"
    ckpt("extract", src, "-o", out)
    draft = tensors_of(out)
    scales = [k for k in draft if k.endswith("weight_scale_inv")]
    assert scales and all(k.removesuffix("_scale_inv") in draft for k in scales)
    source = tensors_of(src)
    assert all(draft[k] == source[k] for k in draft)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


GOLDEN_FORMATS = sorted(GOLDEN.glob("formats/*.txt"))


@pytest.mark.parametrize("golden", GOLDEN_FORMATS, ids=lambda p: p.stem)
def test_format_keys_and_shapes_equal_golden(golden, make_fixture, tmp_path):
    family, fmt = golden.stem.split(".")
    if family not in all_tables():
        pytest.skip(f"no table for {family}")
    out = tmp_path / fmt
    ckpt("extract", make_fixture(family), "-o", out, "--format", fmt)
    got = {k: v[1] for k, v in tensors_of(out).items()}
    assert got == read_golden(golden)


def _fused_from_per_expert(source, prefix: str, experts: int):
    gate_up, down = [], []
    for e in range(experts):
        g = load_key(source, f"{prefix}.{e}.gate_proj.weight")
        u = load_key(source, f"{prefix}.{e}.up_proj.weight")
        gate_up.append(torch.cat([g, u], dim=0))  # gate rows, then up rows
        down.append(load_key(source, f"{prefix}.{e}.down_proj.weight"))
    return torch.stack(gate_up), torch.stack(down)


def load_key(path: Path, key: str) -> torch.Tensor:
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            if key in fh.keys():
                return fh.get_tensor(key)
    raise KeyError(key)


def test_speculators_qwen3_next_follows_the_reference(make_fixture, tmp_path):
    src = make_fixture("qwen3_next")
    # one tensor stored in F32: the draft must keep it (speculators' converter casts everything to one dtype)
    work = tmp_path / "src"
    shutil.copytree(src, work)
    index = json.loads((work / "model.safetensors.index.json").read_text())
    shard = work / index["weight_map"]["mtp.norm.weight"]
    tensors = load_file(str(shard))
    tensors["mtp.norm.weight"] = tensors["mtp.norm.weight"].float()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["metadata"]["total_size"] += 64 * 2
    (work / "model.safetensors.index.json").write_text(json.dumps(index))

    out = tmp_path / "spec"
    ckpt("extract", work, "-o", out, "--format", "speculators")
    cfg = json.loads((out / "config.json").read_text())
    source_cfg = json.loads((work / "config.json").read_text())
    assert cfg["architectures"] == ["MTPDraftModel"]
    assert cfg["speculators_model_type"] == "mtp"
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "mtp" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["verifier"]["architectures"] == source_cfg["architectures"]
    assert sc["verifier"]["name_or_path"] == str(work)  # as given
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3_next"
    assert cfg["transformer_layer_config"]["hidden_size"] == source_cfg["hidden_size"]

    draft = tensors_of(out)
    assert "verifier_lm_head.weight" not in draft  # no NaN placeholder head
    assert draft["mtp_layers.0.final_layernorm.weight"][0] == "torch.float32"
    assert draft["mtp_layers.0.input_proj.weight"][2] == tensors_of(work)["mtp.fc.weight"][2]
    experts = cfg["transformer_layer_config"]["num_experts"]
    gate_up, down = _fused_from_per_expert(work, "mtp.layers.0.mlp.experts", experts)
    assert torch.equal(load_key(out, "mtp_layers.0.mlp.experts.gate_up_proj"), gate_up)
    assert torch.equal(load_key(out, "mtp_layers.0.mlp.experts.down_proj"), down)
    for e in range(gate_up.shape[0]):  # each fused expert block against the source per-expert tensors
        g = load_key(work, f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight")
        assert torch.equal(load_key(out, "mtp_layers.0.mlp.experts.gate_up_proj")[e, : g.shape[0]], g)


SPECULATORS_OWN = sorted(GOLDEN.glob("formats/*.speculators.config.json"))


@pytest.mark.parametrize("golden", SPECULATORS_OWN, ids=lambda p: p.name.split(".")[0])
def test_speculators_config_is_what_speculators_writes(golden, make_fixture, tmp_path, monkeypatch):
    family = golden.name.split(".")[0]
    theirs = json.loads(golden.read_text())
    shutil.copytree(make_fixture(family), tmp_path / family)
    monkeypatch.chdir(tmp_path)  # the converter was given the fixture as a relative path, so are we
    ckpt("extract", family, "-o", "spec", "--format", "speculators")
    ours = json.loads((tmp_path / "spec" / "config.json").read_text())
    for key in ("auto_map", "speculators_version", "transformers_version"):  # no config.py, no versions we never ran
        theirs.pop(key)
    assert ours == theirs


def test_speculators_verifier_name(make_fixture, tmp_path, monkeypatch):
    def name(src, *extra) -> str:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        ckpt("extract", src, "-o", out, "--format", "speculators", *extra)
        return json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]

    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-Next-80B-A3B-Instruct" / "snapshots" / "0123abcd"
    shutil.copytree(make_fixture("qwen3_next"), snapshot)
    assert name(snapshot) == "Qwen/Qwen3-Next-80B-A3B-Instruct"  # a Hub cache snapshot: its Hub id
    monkeypatch.chdir(snapshot.parent)
    assert name("./0123abcd/") == "./0123abcd/"  # a local path exactly as given, never made absolute
    assert name("0123abcd", "--verifier-name", "me/my-verifier") == "me/my-verifier"
    from ckpt_tools.model.formats import verifier_name_of

    assert verifier_name_of("hf://Qwen/Qwen3.5-35B-A3B@3f1c2e0") == "Qwen/Qwen3.5-35B-A3B"  # hf:// sources


def test_speculators_qwen3_5_moe_nested_config_and_fused_experts(make_fixture, tmp_path):
    if "qwen3_5_moe" not in all_tables():
        pytest.skip("no qwen3_5_moe table")
    src = make_fixture("qwen3_5_moe")
    out = tmp_path / "spec"
    ckpt("extract", src, "-o", out, "--format", "speculators")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3_5_moe_text"
    assert "text_config" not in cfg["transformer_layer_config"]
    source = tensors_of(src)
    draft = tensors_of(out)
    # experts are fused on disk already: plain byte copies
    assert draft["mtp_layers.0.mlp.experts.gate_up_proj"] == source["mtp.layers.0.mlp.experts.gate_up_proj"]
    assert draft["mtp_layers.0.mlp.experts.down_proj"] == source["mtp.layers.0.mlp.experts.down_proj"]
    assert draft["mtp_layers.0.input_proj.weight"] == source["mtp.fc.weight"]


def test_reads_only_mtp_bytes(make_fixture, tmp_path):
    from ckpt_tools.io.safetensors_io import IO_STATS
    from ckpt_tools.ops.draft.extract import ExtractRequest, plan_extract
    from ckpt_tools.stream.execute import execute

    for family in ("deepseek_v3", "qwen3_next"):
        src = make_fixture(family)
        IO_STATS.reset()
        c = Checkpoint.open(src)
        mtp_bytes = open_mtp(c).nbytes()
        headers = c.header_bytes()
        execute(plan_extract(c, ExtractRequest()), tmp_path / family)
        assert mtp_bytes <= IO_STATS.total <= (mtp_bytes + headers) * 1.01, (IO_STATS, mtp_bytes, headers)


def test_drop_mtp_writes_the_trunk(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    out = tmp_path / "trunk"
    ckpt("extract", src, "-o", out, "--drop-mtp")
    source = tensors_of(src)
    trunk = tensors_of(out)
    assert not [k for k in trunk if k.startswith("model.layers.3.")]
    assert set(trunk) == {k for k in source if not k.startswith("model.layers.3.")}
    assert all(trunk[k] == source[k] for k in trunk)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in trunk.values())
    # shards that held no MTP tensor come out byte-identical
    src_index = json.loads((src / "model.safetensors.index.json").read_text())
    mtp_shards = {v for k, v in src_index["weight_map"].items() if k.startswith("model.layers.3.")}
    for shard in set(src_index["weight_map"].values()) - mtp_shards:
        assert (out / shard).read_bytes() == (src / shard).read_bytes()
    ckpt("validate", out)


def test_dequant_bf16_drops_scales_and_quant_config(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3", fp8=True)
    out = tmp_path / "bf16"
    ckpt("extract", src, "-o", out, "--dequant", "bf16")
    draft = tensors_of(out)
    assert not [k for k in draft if k.endswith("scale_inv")]
    assert {v[0] for k, v in draft.items() if not k.endswith("e_score_correction_bias")} == {"torch.bfloat16"}
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    assert manifest["source_quantization"]["block"] == [128, 128]
    assert manifest["dequantized_to"] == "BF16"


def test_dry_run_and_plan_json_write_nothing(make_fixture, tmp_path):
    out = tmp_path / "never"
    plan_file = tmp_path / "plan.json"
    ckpt("extract", make_fixture("qwen3_next"), "-o", out, "--dry-run", "--plan-json", plan_file)
    assert not out.exists()
    plan = json.loads(plan_file.read_text())
    assert plan["tensors"] and all(t["recipe"]["op"] in ("copy", "concat", "slice") for t in plan["tensors"])


# ---------------------------------------------------------------------------
# errors


def test_unknown_family_lists_known_ones(make_fixture, tmp_path):
    work = tmp_path / "odd"
    shutil.copytree(make_fixture("deepseek_v3"), work)
    cfg = json.loads((work / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["NoSuchForCausalLM"], "no_such"
    (work / "config.json").write_text(json.dumps(cfg))
    r = ckpt("extract", work, "-o", tmp_path / "o", code=3)
    assert "deepseek_v3" in r.output and "Adding a family" in r.output


def test_declared_mtp_with_missing_tensors_names_them(make_fixture, tmp_path):
    work = tmp_path / "broken"
    shutil.copytree(make_fixture("deepseek_v3"), work)
    index = json.loads((work / "model.safetensors.index.json").read_text())
    shard = work / index["weight_map"]["model.layers.3.eh_proj.weight"]
    tensors = load_file(str(shard))
    del tensors["model.layers.3.eh_proj.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    del index["weight_map"]["model.layers.3.eh_proj.weight"]
    (work / "model.safetensors.index.json").write_text(json.dumps(index))
    r = ckpt("extract", work, "-o", tmp_path / "o", code=3)  # refused by the consistency gate, before planning
    assert "model.layers.3.eh_proj.weight" in r.output and "[mtp-missing]" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("family", "fmt", "why"),
    [
        ("qwen3_next", "angelspec", "zero_centred"),
        # AngelSpec always builds its own final_layernorm; ERNIE-4.5's MTP layer has none
        ("ernie4_5_moe", "angelspec", "no final_norm tensor"),
        ("qwen3_next", "sglang-nextn", "outside the layer prefix"),
        ("deepseek_v3", "speculators", "Qwen3"),
    ],
)
def test_format_that_cannot_express_the_family_says_why(family, fmt, why, make_fixture, tmp_path):
    r = ckpt("extract", make_fixture(family), "-o", tmp_path / "o", "--format", fmt, code=3)
    assert "format-unsupported" in r.output and re.search(why, r.output), r.output


def test_layers_out_of_range_is_a_usage_error(make_fixture, tmp_path):
    r = ckpt("extract", make_fixture("deepseek_v3"), "-o", tmp_path / "o", "--layers", "3", code=2)
    assert "out of range" in r.output


def test_output_directory_not_empty_is_refused(make_fixture, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = ckpt("extract", make_fixture("deepseek_v3"), "-o", out, code=4)
    assert "not empty" in r.output
    assert (out / "keep.txt").read_text() == "mine"


def test_extract_into_the_source_is_refused(make_fixture, tmp_path):
    work = tmp_path / "src"
    shutil.copytree(make_fixture("deepseek_v3"), work)
    before = tree_hash(work)
    r = ckpt("extract", work, "-o", work, "--overwrite", code=None)
    assert r.exit_code != 0
    assert tree_hash(work) == before
