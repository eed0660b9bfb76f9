"""A compressed-tensors module's declared arguments, judged as compressed-tensors 0.20.1 (and vLLM) read them
(issue 40, classes 2, 3, 4 and 7), on llm-compressor's own outputs (fixtures/producers/llmcompressor-*):

- ``quant-zero-point``: a zero point under ``symmetric: true`` is never read (compressed-tensors drops it); under
  ``symmetric: false`` it is required, one per scale;
- ``quant-group-size``: the group size divides the columns (compressed-tensors refuses a partial last group);
- ``quant-actorder``: activation order ``group`` (a permuted ``weight_g_idx``) is refused, as both consumers
  refuse it; a ``weight_g_idx`` nobody reads is refused rather than copied into a float output;
- config groups that overlap are read in compressed-tensors' order (exact name, regex, class name:
  ``match.ranked`` held to ``match_targets``), and a module vLLM reads with another group is ``quant-group-order``.

Each case is validated (the rule, the module and the config group named) and refused by a verb's gate (dequant),
and by dequant's own decode under ``--allow-invalid``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_ckpt

pytest.importorskip("compressed_tensors")

PRODUCERS = Path(__file__).resolve().parent.parent / "fixtures" / "producers"
W8A8, W4A16 = PRODUCERS / "llmcompressor-w8a8", PRODUCERS / "llmcompressor-w4a16"
SHARED = "model.layers.1.mlp.shared_experts.down_proj"  # W4A16: [128, 128] in groups of 32, in the last shard
EXPERT = "model.layers.1.mlp.experts.1.down_proj"  # W8A8: [128, 128] per channel, in the last shard


def variant(src: Path, dst: Path, weights=None, add: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the producer's output ``src`` with its MTP count 0 (the producer dropped the layers), the config
    group's ``weights`` updated, ``add`` written into its last shard and the index kept exact."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    if weights:
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = sorted(dst.glob("*.safetensors"))[-1]
    state = load_file(shard)
    state.update(add or {})
    save_file(state, shard, metadata={"format": "pt"})
    index["weight_map"].update({k: shard.name for k in add or {}})
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for f in dst.glob("*.safetensors")
                                          for t in load_file(f).values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


def problems(path: Path, code: int = 1) -> list[dict]:
    return json.loads(run_ckpt("validate", path, "--json", code=code).stdout)["problems"]


def refused(path: Path, tmp_path: Path, rule: str, module: str) -> None:
    """validate names the rule, the module and the group; dequant's gate refuses, and so does its decode when the
    rule is allowed (nothing is written)."""
    found = [p for p in problems(path) if p["rule"] == rule and p["key"] == module]
    assert found and "config group 'group_0'" in found[0]["message"], problems(path)
    out = run_ckpt("dequant", path, "-o", tmp_path / "gated", code=3).output
    assert f"[{rule}]" in out and "config group 'group_0'" in out
    allowed = run_ckpt("dequant", path, "-o", tmp_path / "allowed", "--allow-invalid", rule, code=3).output
    assert f"[{rule}]" in allowed and "cannot be decoded" in allowed
    assert not (tmp_path / "gated").exists() and not (tmp_path / "allowed" / "config.json").exists()


def test_the_producers_outputs_are_valid_as_written(tmp_path):
    for src in (W8A8, W4A16):
        assert problems(variant(src, tmp_path / src.name), code=0) == []


# -- class 2: zero points by the scheme's symmetry -------------------------------------------------------------


@pytest.mark.parametrize(("src", "module", "zp"), [
    (W8A8, EXPERT, torch.full((128, 1), 3, dtype=torch.int8)),  # I8, one per channel
    (W4A16, SHARED, torch.full((16, 4), 0x11111111, dtype=torch.int32)),  # packed INT4 zero points of 1
], ids=["w8a8-i8", "w4a16-packed-i32"])
def test_a_zero_point_under_a_symmetric_scheme_is_refused(tmp_path, src, module, zp):
    path = variant(src, tmp_path / "in", add={f"{module}.weight_zero_point": zp})
    refused(path, tmp_path, "quant-zero-point", module)
    msg = next(p["message"] for p in problems(path) if p["rule"] == "quant-zero-point")
    assert "symmetric = True" in msg and f"{module}.weight_zero_point is present" in msg


def test_compressed_tensors_never_reads_a_symmetric_zero_point(tmp_path):
    """The consumer's fact the rule rests on: its model-free dequantizer leaves the zero point out of the module's
    state (compression_param_names) and refuses it as a residual parameter."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    path = variant(W8A8, tmp_path / "in", add={f"{EXPERT}.weight_zero_point": torch.ones((128, 1), dtype=torch.int8)})
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()
               if k.startswith(EXPERT + ".")}
    with pytest.raises(ValueError, match="residual quantization param.*weight_zero_point"):
        CompressedTensorsDequantizer(path).validate(tensors)


def test_an_asymmetric_scheme_without_its_zero_points_is_refused(tmp_path):
    path = variant(W4A16, tmp_path / "in", weights={"symmetric": False})
    found = {p["key"]: p["message"] for p in problems(path) if p["rule"] == "quant-zero-point"}
    assert SHARED in found and "symmetric = False" in found[SHARED] and "is missing" in found[SHARED]
    out = run_ckpt("dequant", path, "-o", tmp_path / "out", "--allow-invalid", "quant-zero-point", code=3).output
    assert "[quant-zero-point]" in out


def test_an_asymmetric_zero_point_of_the_wrong_shape_is_refused(tmp_path):
    """Under symmetric: false every module has its zero points, packed along the rows as the scales are grouped:
    [ceil(rows / 8), cols / 32]; one of another shape is refused."""
    def zero_points(bad: str | None) -> dict[str, torch.Tensor]:
        return {f"{m}.weight_zero_point": torch.zeros((-(-rows // 8) // (4 if m == bad else 1), cols // 32),
                                                      dtype=torch.int32) for m, (rows, cols) in _shapes(W4A16).items()}

    good = variant(W4A16, tmp_path / "good", weights={"symmetric": False}, add=zero_points(None))
    assert problems(good, code=0) == []
    bad = variant(W4A16, tmp_path / "bad", weights={"symmetric": False}, add=zero_points(SHARED))
    found = [p for p in problems(bad) if p["rule"] == "quant-zero-point"]
    assert [p["key"] for p in found] == [SHARED] and "expected [16, 4]" in found[0]["message"], found


@pytest.mark.parametrize("bits", [4, 8])
def test_the_packed_zero_point_shape_is_the_librarys(bits):
    """The shape required under symmetric: false is what compressed-tensors' pack_to_int32 writes (rows packed)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from ckpt_tools.model.quant.storage import zero_point_shapes
    from ckpt_tools.model.quant.tables import get_scheme

    fmt = next(f for f in get_scheme("ct-pack").storage if f.decoder.bits == bits)
    for rows in (1, 7, 9, 17, 23, 33, 128):
        packed = pack_to_int32(torch.zeros((rows, 3), dtype=torch.int8), bits, packed_dim=0)
        assert zero_point_shapes(fmt, (rows, 3)) == [tuple(packed.shape)]


def _shapes(src: Path) -> dict[str, tuple[int, int]]:
    """module -> [rows, cols] of every packed weight (its weight_shape)."""
    return {k.removesuffix(".weight_shape"): tuple(int(x) for x in v) for f in sorted(src.glob("*.safetensors"))
            for k, v in load_file(f).items() if k.endswith(".weight_shape")}


# -- class 3: group sizes divide the columns -------------------------------------------------------------------


def test_a_group_size_that_does_not_divide_the_columns_is_refused(tmp_path):
    """group_size 32 -> 33: every scale grid still matches (ceil(128 / 33) = 4), but the last group is partial."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    path = variant(W4A16, tmp_path / "in", weights={"group_size": 33})
    refused(path, tmp_path, "quant-group-size", SHARED)
    msg = next(p["message"] for p in problems(path) if p["key"] == SHARED)
    assert "group_size = 33" in msg and "128 columns" in msg
    # the consumer: compressed-tensors refuses to decompress it
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    state = {k.rpartition(".")[2]: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()
             if k.startswith(SHARED + ".")}
    with pytest.raises(ValueError, match="divisble|divisible"):
        PackedQuantizationCompressor.decompress(state, QuantizationScheme.model_validate(cfg))


# -- class 4: activation order ---------------------------------------------------------------------------------


def test_activation_order_group_with_a_permuted_g_idx_is_refused(tmp_path):
    from compressed_tensors.quantization import QuantizationArgs

    g_idx = (torch.randperm(128, generator=torch.Generator().manual_seed(0)) // 32).to(torch.int32)
    path = variant(W4A16, tmp_path / "in", weights={"actorder": "group"}, add={f"{SHARED}.weight_g_idx": g_idx})
    refused(path, tmp_path, "quant-actorder", SHARED)
    assert "actorder = 'group'" in next(p["message"] for p in problems(path) if p["key"] == SHARED)
    weights = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    with pytest.raises(ValueError, match="actorder='group' has been removed"):  # the consumer refuses it too
        QuantizationArgs.model_validate(weights["weights"])


def test_a_g_idx_no_consumer_reads_is_refused_not_copied(tmp_path):
    """Under actorder null a weight_g_idx is read by nobody: before, dequant copied the integer tensor into its
    float output."""
    g_idx = (torch.arange(128) // 32).to(torch.int32)
    path = variant(W4A16, tmp_path / "in", add={f"{SHARED}.weight_g_idx": g_idx})
    refused(path, tmp_path, "quant-actorder", SHARED)


# -- class 7: overlapping config groups ------------------------------------------------------------------------


TARGETS = ["Linear", "re:.*mlp.*", "re:.*down_proj", "re:model\\.layers\\.1\\..*", SHARED, "model.layers.0.mlp.up_proj",
           "re:.*shared_experts.*", "re:.*"]
NAMES = [SHARED, "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_a_proj",
         "model.layers.1.mlp.experts.2.up_proj", "lm_head"]


@pytest.mark.parametrize("seed", range(40))
def test_targets_are_ranked_as_compressed_tensors_ranks_them(seed):
    """``match.ranked`` equals compressed-tensors' ``match_targets`` (whose first entry picks the group)."""
    from compressed_tensors.utils.match import match_targets

    from ckpt_tools.model.quant.match import ranked

    g = torch.Generator().manual_seed(seed)
    targets = [TARGETS[i] for i in torch.randperm(len(TARGETS), generator=g)[: 1 + seed % len(TARGETS)]]
    for name in NAMES:
        assert ranked(name, targets) == match_targets(name, torch.nn.Linear(1, 1), targets), (name, targets)


def test_the_group_vllm_picks_is_vllms_own_pick():
    """``match.first_listed`` equals vLLM 0.32's ``find_matched_target`` (its venv) over the same target lists."""
    import subprocess

    from consumer_venv import venv_env, vllm_python

    from ckpt_tools.model.quant.match import first_listed

    g = torch.Generator().manual_seed(1)
    cases = [(name, [TARGETS[i] for i in torch.randperm(len(TARGETS), generator=g)[: 1 + k % len(TARGETS)]])
             for k in range(40) for name in NAMES]
    script = ("import json, sys, torch\n"
              "from vllm.model_executor.layers.quantization.compressed_tensors.utils import find_matched_target\n"
              "cases = json.load(sys.stdin)\n"
              "print(json.dumps([find_matched_target(n, torch.nn.Linear(1, 1), t) for n, t in cases]))\n")
    done = subprocess.run([str(vllm_python()), "-c", script], input=json.dumps(cases), capture_output=True,
                          text=True, env=venv_env(), timeout=600, check=True)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert [first_listed(n, t) for n, t in cases] == theirs
    assert sum(first_listed(n, t) != ranked_first(n, t) for n, t in cases) > 10  # the two orders do differ


def ranked_first(name: str, targets: list[str]) -> str | None:
    from ckpt_tools.model.quant.match import ranked

    return next(iter(ranked(name, targets)), None)


def _groups(path: Path, groups: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    base = cfg["quantization_config"]["config_groups"]["group_0"]
    cfg["quantization_config"]["config_groups"] = {
        name: {**base, "targets": targets, "weights": {**base["weights"], **weights}}
        for name, (targets, weights) in groups.items()}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def test_a_regex_group_after_a_class_group_decides_its_modules(tmp_path):
    """group_0 targets Linear (groups of 32, as stored), group_1 after it the shared experts by regex (groups of 16):
    both consumers read the shared experts as group_1, whose scales would be [rows, 8]: before, file order read them
    as group_0 and called the checkpoint valid."""
    path = variant(W4A16, tmp_path / "in")
    _groups(path, {"group_0": (["Linear"], {}), "group_1": (["re:.*shared_experts.*"], {"group_size": 16})})
    found = {p["key"]: p for p in problems(path)}
    assert SHARED in found and found[SHARED]["rule"] == "trunk-quant-config", found
    assert "[128, 8]" in found[SHARED]["message"]
    assert {k for k in found if "shared_experts" not in k} == set()
    assert not [p for p in found.values() if p["rule"] == "quant-group-order"]  # the consumers agree
    # the same groups in the other order: the same reading
    _groups(path, {"group_1": (["re:.*shared_experts.*"], {"group_size": 16}), "group_0": (["Linear"], {})})
    assert {p["key"] for p in problems(path)} == set(found)


def test_groups_the_consumers_pick_differently_are_refused(tmp_path):
    """A regex group listed first and an exact-name group after it, both naming the module with different group
    sizes: vLLM takes the first target in config order (the regex, groups of 32, as stored), compressed-tensors the
    exact name (groups of 16): quant-group-order, and the module read as compressed-tensors reads it."""
    path = variant(W4A16, tmp_path / "in")
    _groups(path, {"group_0": (["re:.*down_proj", "Linear"], {}), "group_1": ([SHARED], {"group_size": 16})})
    found = [p for p in problems(path) if p["key"] == SHARED]
    rules = {p["rule"] for p in found}
    assert rules == {"quant-group-order", "trunk-quant-config"}, found
    msg = next(p["message"] for p in found if p["rule"] == "quant-group-order")
    assert "'group_1'" in msg and "'group_0'" in msg and "vLLM" in msg
    run_ckpt("dequant", path, "-o", tmp_path / "out", code=3)
    # alike groups overlapping are no finding: the consumers read the module alike whichever they pick
    _groups(path, {"group_0": (["re:.*down_proj", "Linear"], {}), "group_1": ([SHARED], {"observer": "minmax"})})
    assert problems(path, code=0) == []


def test_a_target_two_groups_list_is_the_later_groups(tmp_path):
    """Both consumers map each target to a group, a later group listing it again taking it (compressed-tensors'
    target_to_scheme, vLLM's target_scheme_map): with Linear in both, the second group decides; before, the first
    group in file order did."""
    path = variant(W4A16, tmp_path / "in")
    _groups(path, {"group_0": (["Linear"], {}), "group_1": (["Linear"], {"group_size": 16})})
    found = problems(path)
    assert SHARED in {p["key"] for p in found if p["rule"] == "trunk-quant-config"}
    assert "quant-group-order" not in {p["rule"] for p in found}  # one map, one answer: the consumers agree
    _groups(path, {"group_1": (["Linear"], {"group_size": 16}), "group_0": (["Linear"], {})})
    assert problems(path, code=0) == []
