"""`ckpt fuse-experts` / `ckpt unfuse-experts` on fixture checkpoints, through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.model.tables.loader import all_tables

from conftest import run_ckpt as ckpt
from conftest import tree_hash

FP8_128 = {"moe_intermediate_size": 128, "hidden_size": 128}  # I multiple of the block: scales fuse exactly


def tensors_of(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """key -> (dtype, shape, raw bytes), read with the safetensors library."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118
                t = fh.get_tensor(k)
                out[k] = (str(t.dtype), list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def rewrite(src: Path, dst: Path, drop=(), rename=None) -> Path:
    """A copy of a fixture with some tensors dropped or renamed (index kept consistent)."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    rename = rename or {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(dst / shard)
        if not (set(tensors) & (set(drop) | set(rename))):
            continue
        kept = {rename.get(k, k): v for k, v in tensors.items() if k not in drop}
        save_file(kept, str(dst / shard), metadata={"format": "pt"})
    wm = {rename.get(k, k): v for k, v in index["weight_map"].items() if k not in drop}
    index["weight_map"] = dict(sorted(wm.items()))
    index_path.write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("opts", [{}, {"fp8": True, "config_overrides": FP8_128}], ids=["bf16", "fp8"])
def test_fuse_then_unfuse_is_byte_identical(make_fixture, tmp_path, opts):
    src = make_fixture("deepseek_v3", **opts)
    before = tree_hash(src)
    ckpt("fuse-experts", src, "-o", tmp_path / "fused")
    fused = tensors_of(tmp_path / "fused")
    moe_layers = [1, 2, 3]  # first_k_dense_replace = 1; layer 3 is the MTP layer
    for layer in moe_layers:
        p = f"model.layers.{layer}.mlp.experts"
        assert fused[f"{p}.gate_up_proj"][1] == [4, 2 * (128 if opts else 32), 128 if opts else 64]
        assert f"{p}.down_proj" in fused
        assert not any(k.startswith(f"{p}.0.") for k in fused)
        if opts:
            assert fused[f"{p}.gate_up_proj_scale_inv"][1] == [4, 2, 1]
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["ckpt_expert_layout"] == "fused"
    manifest = json.loads((tmp_path / "fused" / "ckpt_manifest.json").read_text())
    groups = {g["prefix"]: g for g in manifest["expert_groups"]}
    assert groups["model.layers.3.mlp.experts"]["source_layout"] == "per-expert"
    assert groups["model.layers.3.mlp.experts"]["scope"] == "mtp" and groups["model.layers.1.mlp.experts"]["scope"]
    for name in ("README.md", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "fused" / name).read_bytes() == (src / name).read_bytes()

    ckpt("unfuse-experts", tmp_path / "fused", "-o", tmp_path / "back")
    assert tensors_of(tmp_path / "back") == tensors_of(src)
    assert tree_hash(src) == before


def test_transposed_up_first_round_trip_uses_the_recorded_layout(make_fixture, tmp_path):
    """Key names cannot show up-first order: the recorded layout brings the experts back exactly."""
    src = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_128)
    ckpt("fuse-experts", src, "-o", tmp_path / "t", "--to", "fused-transposed:up-first")
    t = tensors_of(tmp_path / "t")
    assert t["model.layers.3.mlp.experts.gate_up_proj"][1] == [4, 128, 256]
    assert t["model.layers.3.mlp.experts.down_proj"][1] == [4, 128, 128]
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    assert config["ckpt_expert_layout"] == "fused-transposed(up-first)"
    ckpt("unfuse-experts", tmp_path / "t", "-o", tmp_path / "back")
    assert tensors_of(tmp_path / "back") == tensors_of(src)


def test_only_mtp(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    ckpt("fuse-experts", src, "-o", tmp_path / "m", "--only-mtp", "--to", "stacked")
    t = tensors_of(tmp_path / "m")
    assert "model.layers.3.mlp.experts.gate_proj.weight" in t and "model.layers.3.mlp.experts.0.up_proj.weight" not in t
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in t  # the trunk stays per-expert
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["ckpt_expert_layout"], config["ckpt_expert_layout_scope"]) == ("stacked", "mtp")
    ckpt("unfuse-experts", tmp_path / "m", "-o", tmp_path / "back", "--only-mtp")
    assert tensors_of(tmp_path / "back") == tensors_of(src)


def test_draft_with_mtp_layers_only(make_fixture, tmp_path):
    """A native draft (MTP layers only, no main-model tensor) converts its MTP groups; nothing else is required.
    Keeping the trunk's embedding, norm and head without its decoder layers is a broken model, not a draft
    (issue 24: validate and the gate agree on trunk-missing)."""
    src = make_fixture("deepseek_v3")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    layers = [k for k in index["weight_map"] if k.startswith(("model.layers.0.", "model.layers.1.", "model.layers.2."))]
    broken = rewrite(src, tmp_path / "broken", drop=layers)
    r = ckpt("fuse-experts", broken, "-o", tmp_path / "nf", code=3)
    assert "trunk-missing" in r.output
    trunk = [k for k in index["weight_map"] if not k.startswith("model.layers.3.")]
    draft = rewrite(src, tmp_path / "draft", drop=trunk)
    r = ckpt("fuse-experts", draft, "-o", tmp_path / "f", "--json")
    rep = json.loads(r.output)
    assert [g["prefix"] for g in rep["groups"]] == ["model.layers.3.mlp.experts"]
    ckpt("unfuse-experts", tmp_path / "f", "-o", tmp_path / "back")
    assert tensors_of(tmp_path / "back") == tensors_of(draft)


def test_extracted_draft_fused_then_stitched_back(make_fixture, tmp_path):
    """extract -> fuse-experts -> stitch: the draft stays a draft, and the verifier comes back byte for byte."""
    src = make_fixture("deepseek_v3")
    ckpt("extract", src, "-o", tmp_path / "draft")
    ckpt("fuse-experts", tmp_path / "draft", "-o", tmp_path / "fused")
    manifest = json.loads((tmp_path / "fused" / "ckpt_manifest.json").read_text())
    assert manifest["kind"] == "mtp-draft" and manifest["layers"] == [0]
    assert manifest["expert_groups"]["model.layers.3.mlp.experts"]["layout"] == "fused"
    ckpt("stitch", tmp_path / "fused", src, "-o", tmp_path / "stitched")
    assert tensors_of(tmp_path / "stitched") == tensors_of(src)


def test_no_experts_is_an_error(make_fixture, tmp_path):
    if "qwen3_5" not in all_tables():
        pytest.skip("no dense table")
    r = ckpt("fuse-experts", make_fixture("qwen3_5"), "-o", tmp_path / "o", code=3)
    assert "[no-experts]" in _error(r)


def test_qwen3_next_fused_unfuse_refuse_is_byte_identical(make_fixture, tmp_path):
    src = make_fixture("qwen3_next", expert_layout="fused")
    ckpt("unfuse-experts", src, "-o", tmp_path / "per")
    per = tensors_of(tmp_path / "per")
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in per and "mtp.layers.0.mlp.experts.down_proj" not in per
    ckpt("fuse-experts", tmp_path / "per", "-o", tmp_path / "back")
    assert tensors_of(tmp_path / "back") == tensors_of(src)


@pytest.mark.skipif("qwen3_5_moe" not in all_tables(), reason="qwen3_5_moe table not present")
def test_qwen3_5_moe_ships_fused_and_round_trips(make_fixture, tmp_path):
    src = make_fixture("qwen3_5_moe")
    source = tensors_of(src)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in source  # the release layout is fused
    ckpt("unfuse-experts", src, "-o", tmp_path / "per", "--json")
    ckpt("fuse-experts", tmp_path / "per", "-o", tmp_path / "back")
    assert tensors_of(tmp_path / "back") == source


def test_dry_run_and_plan_json_write_nothing(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    r = ckpt("fuse-experts", src, "-o", tmp_path / "o", "--dry-run", "--plan-json", tmp_path / "plan.json")
    text = " ".join(r.output.split())
    assert "per-expert ->" in text and "12 -> 2" in text and "2 concat" in text  # cells fold at 80 columns
    assert "3 expert group(s); 63 other tensor(s) copied" in text
    assert not (tmp_path / "o").exists()
    plan = json.loads((tmp_path / "plan.json").read_text())
    gu = next(t for t in plan["tensors"] if t["key"] == "model.layers.3.mlp.experts.gate_up_proj")
    assert gu["recipe"]["op"] == "concat" and len(gu["recipe"]["ranges"]) >= 1
    r = ckpt("fuse-experts", src, "--dry-run", "--json", "--to", "stacked-transposed")
    summary = json.loads(r.output)
    assert {g["layout"] for g in summary["groups"]} == {"stacked-transposed"}
    assert all(g["ops"] == {"transpose": 3} for g in summary["groups"])


def test_json_report(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    r = ckpt("fuse-experts", src, "-o", tmp_path / "o", "--json", "--max-shard-size", "100KB")
    rep = json.loads(r.output)
    assert rep["layout"] == "fused" and rep["validated"] and len(rep["groups"]) == 3
    assert rep["bytes_computed"] == 0  # fusing the blocked layout is pure byte ranges
    assert len(list((tmp_path / "o").glob("model-*.safetensors"))) > 1  # sharded by --max-shard-size


def _error(result) -> str:
    return result.output + (result.stderr if result.stderr_bytes is not None else "")


def test_missing_expert(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    drop = [f"model.layers.3.mlp.experts.2.{p}_proj.weight" for p in ("gate", "up", "down")]
    bad = rewrite(src, tmp_path / "bad", drop=drop)
    before = tree_hash(bad)
    # the consistency gate refuses this input too (mtp-missing); let it through to reach fuse's own check
    r = ckpt("fuse-experts", bad, "-o", tmp_path / "o", "--allow-invalid", "mtp-missing", code=3)
    msg = " ".join(_error(r).split())
    assert "[expert-noncontiguous]" in msg and "model.layers.3.mlp.experts" in msg and "no 2" in msg
    assert "missing model.layers.3.mlp.experts.2.gate_proj.weight" in msg
    assert not (tmp_path / "o").exists() and tree_hash(bad) == before


def test_non_contiguous_expert_indices(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    ren = {f"model.layers.1.mlp.experts.3.{p}_proj.weight": f"model.layers.1.mlp.experts.5.{p}_proj.weight"
           for p in ("gate", "up", "down")}
    bad = rewrite(src, tmp_path / "bad", rename=ren)
    # the consistency gate refuses this input too (trunk-missing); let it through to reach fuse's own check
    r = ckpt("fuse-experts", bad, "-o", tmp_path / "o", "--allow-invalid", "trunk-missing", code=3)
    msg = " ".join(_error(r).split())
    assert "[expert-noncontiguous] expert indices of model.layers.1.mlp.experts are not contiguous" in msg
    assert "[expert-index] model.layers.1.mlp.experts.5.down_proj.weight: expert index 5" in msg


def test_fp8_scale_fusion_refused_when_inter_is_not_a_block_multiple(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3", fp8=True)  # moe_intermediate_size 32
    before = tree_hash(src)
    r = ckpt("fuse-experts", src, "-o", tmp_path / "o", code=3)
    msg = " ".join(_error(r).split())
    assert "[fp8-scale-fusion]" in msg and "gate_up_proj_scale_inv" in msg and "I=32" in msg
    assert "--dequant" in msg
    ckpt("fuse-experts", src, "-o", tmp_path / "s", "--to", "stacked")  # gate and up apart: fine
    assert tree_hash(src) == before


def test_usage_errors(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    r = ckpt("unfuse-experts", src, "-o", tmp_path / "o", "--to", "fused", code=2)
    assert "fuse-experts" in _error(r)
    ckpt("fuse-experts", src, "-o", tmp_path / "o", "--to", "fused:sideways", code=2)
    ckpt("fuse-experts", src, code=2)  # no -o and no --dry-run
    ckpt("fuse-experts", src, "-o", src, code=2)  # the input as output


def _dequant_reference(codes: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """float64 value x scale per block, written independently of the code under test, then bf16."""
    br, bc = block
    rows, cols = codes.shape
    x = codes.to(torch.float64)
    s = scale.to(torch.float64).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (x * s).to(torch.float32).to(torch.bfloat16)  # the float32 product is exact: one rounding


def test_fuse_with_dequant_writes_bf16_everywhere_with_reference_values(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3", fp8=True)  # I=32: FP8 scales could not fuse, dequantized ones can
    out = tmp_path / "fused-bf16"
    ckpt("fuse-experts", src, "-o", out, "--dequant", "bf16")
    source = {}
    for f in sorted(src.glob("*.safetensors")):
        source.update(load_file(f))
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(load_file(f))
    assert not [k for k, t in written.items() if t.dtype == torch.float8_e4m3fn or k.endswith("scale_inv")]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["ckpt_expert_layout"] == "fused"
    # a fused MTP expert: gate rows then up rows, each the dequantized source expert
    n = config["num_hidden_layers"]
    prefix = f"model.layers.{n}.mlp.experts"
    gate_up = written[f"{prefix}.gate_up_proj"]
    for e in (0, gate_up.shape[0] - 1):
        for half, proj in enumerate(("gate_proj", "up_proj")):
            w = source[f"{prefix}.{e}.{proj}.weight"]
            want = _dequant_reference(w, source[f"{prefix}.{e}.{proj}.weight_scale_inv"])
            rows = w.shape[0]
            assert torch.equal(gate_up[e, half * rows:(half + 1) * rows].view(torch.int16), want.view(torch.int16))
    # a non-expert FP8 weight outside any expert group
    fp8_keys = [k for k, t in source.items() if t.dtype == torch.float8_e4m3fn and ".experts." not in k]
    key = fp8_keys[0]
    want = _dequant_reference(source[key], source[key.removesuffix("weight") + "weight_scale_inv"])
    assert torch.equal(written[key].view(torch.int16), want.view(torch.int16))
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    assert manifest["dequantized_to"] == "BF16" and manifest["source_quantization"]["quant_method"] == "fp8"
    # and back to per-expert: the same bf16 values, still no FP8
    back = tmp_path / "per-expert"
    ckpt("unfuse-experts", out, "-o", back)
    again = {}
    for f in sorted(back.glob("*.safetensors")):
        again.update(load_file(f))
    w = source[f"{prefix}.0.up_proj.weight"]
    assert torch.equal(again[f"{prefix}.0.up_proj.weight"].view(torch.int16),
                       _dequant_reference(w, source[f"{prefix}.0.up_proj.weight_scale_inv"]).view(torch.int16))


# -- one group, two layouts (issue 40, class 10) ------------------------------------------------------------

PRODUCED = Path(__file__).resolve().parents[1] / "fixtures" / "producers" / "transformers-deepseek_v3"


def _with_fused_beside(src: Path, dst: Path, layer: str) -> Path:
    """transformers' own DeepSeek-V3 checkpoint (per-expert names) with ``layer``'s experts also stored fused, as
    transformers 5 holds them in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    every = {k: v for shard in sorted(set(index["weight_map"].values())) for k, v in load_file(dst / shard).items()}
    p = f"{layer}.mlp.experts"
    count = sum(1 for k in every if k.startswith(p + ".") and k.endswith(".down_proj.weight"))
    shard = index["weight_map"][f"{p}.0.gate_proj.weight"]
    tensors = load_file(dst / shard)
    tensors[f"{p}.gate_up_proj"] = torch.stack(
        [torch.cat([every[f"{p}.{e}.gate_proj.weight"], every[f"{p}.{e}.up_proj.weight"]]) for e in range(count)])
    tensors[f"{p}.down_proj"] = torch.stack([every[f"{p}.{e}.down_proj.weight"] for e in range(count)])
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    for k in (f"{p}.gate_up_proj", f"{p}.down_proj"):
        index["weight_map"][k] = shard
        index["metadata"]["total_size"] += tensors[k].numel() * tensors[k].element_size()
    index_path.write_text(json.dumps(index, indent=2))
    return dst


@pytest.mark.parametrize("layer", ["model.layers.1", "model.layers.2"])  # a trunk layer; the MTP layer
def test_a_group_holding_two_layouts_is_refused_by_validate_and_every_verb_alike(layer, tmp_path):
    mixed = _with_fused_beside(PRODUCED, tmp_path / "mixed", layer)
    before = tree_hash(mixed)
    r = ckpt("validate", mixed, "--json", code=1)
    found = {(p["rule"], p["key"]) for p in json.loads(r.stdout)["problems"]}
    assert found == {("expert-layouts-mixed", f"{layer}.mlp.experts.gate_up_proj"),
                     ("expert-layouts-mixed", f"{layer}.mlp.experts.down_proj")}  # not mtp-extra besides
    draft = tmp_path / "draft"
    ckpt("extract", PRODUCED, "-o", draft)
    verbs = [["extract", mixed], ["extract", mixed, "--drop-mtp"], ["fuse-experts", mixed], ["unfuse-experts", mixed],
             ["init-draft", mixed], ["stitch", draft, mixed], ["graft", mixed, PRODUCED]]
    for i, args in enumerate(verbs):
        r = ckpt(*args, "-o", tmp_path / f"o{i}", code=3)
        msg = " ".join(_error(r).split())
        assert "[expert-layouts-mixed]" in msg and f"{layer}.mlp.experts." in msg, (args, msg)
        assert "a tensor of the fused layout" in msg and not (tmp_path / f"o{i}").exists(), args
    # past the gate, the converters refuse it by the same rule
    r = ckpt("fuse-experts", mixed, "-o", tmp_path / "f", "--allow-invalid", "expert-layouts-mixed", code=3)
    assert "[expert-layouts-mixed]" in _error(r)
    assert tree_hash(mixed) == before
