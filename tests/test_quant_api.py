"""The quantization model layer: scheme tables, detection, storage, declarations, exclusion entries.

Matching is held against the consumers' own code where it is installable: compressed-tensors'
``match_name`` and transformers' ``should_convert_module``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_tools.errors import InputError, TableError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.quant import (
    all_schemes,
    declaration,
    declared,
    detect_in,
    detect_scheme,
    exclusion_entries,
    module_storage,
    quant_files,
)
from ckpt_tools.model.quant.match import excluded, match_one

pytest.importorskip("compressed_tensors")
from quant_helpers import ct, scheme_for, write_quantized  # noqa: E402

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:^model\\.layers\\.3\\.mlp\\..*", "model.layers.3.eh_proj"]


@pytest.fixture(scope="module")
def quantized(make_fixture, tmp_path_factory):
    src = make_fixture("deepseek_v3")
    made: dict[str, Path] = {}

    def build(preset: str, **weights) -> Path:
        if preset not in made:
            made[preset] = write_quantized(src, tmp_path_factory.mktemp(preset.lower()),
                                           scheme_for(preset, weights or None), list(IGNORE))
        return made[preset]

    return build


def test_every_shipped_table_loads_and_names_its_formats():
    schemes = all_schemes()
    assert {"ct-fp8", "ct-int8", "ct-pack", "ct-nvfp4", "ct-mxfp4", "modelopt-fp8", "modelopt-nvfp4", "fp8-block",
            "deepseek-v4", "quark-mxfp4"} <= set(schemes)
    for t in schemes.values():
        assert t.storage and t.declared_in


@pytest.mark.parametrize(("patch", "field"), [
    ({"storage": [{"name": "x", "label": "x", "weight": {"dtypes": ["F8_E4M3"]},
                   "decoder": {"codes": "e4m3", "scale": {"tensor": "nope", "granularity": "[1, 1]"}}}]},
     "storage.0"),
    ({"storage": [{"name": "x", "label": "x", "weight": {"dtypes": ["F8_E4M3"]},
                   "tensors": [{"suffix": "s", "dtypes": ["F32"]}],
                   "decoder": {"codes": "e4m3", "scale": {"tensor": "s", "granularity": "[1, width]"}}}]},
     "storage[0].decoder.scale.granularity"),
    ({"declared_in": [{"match": {"quant_method": ["x"]}, "exclude": [{"field": "ignore", "matcher": "glob"}]}]},
     "declared_in.0.exclude.0.matcher"),
])
def test_a_broken_table_names_its_file_and_field(tmp_path, monkeypatch, patch, field):
    import yaml

    from ckpt_tools.model.quant import tables

    base = yaml.safe_load((tables.quant_dirs()[0] / "ct-fp8.yaml").read_text())
    base.update(patch)
    base["scheme"] = "broken"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(base))
    monkeypatch.setenv("CKPT_QUANT_TABLES", str(tmp_path))
    tables._load.cache_clear()
    try:
        with pytest.raises(TableError) as e:
            tables.all_schemes()
        assert "broken.yaml" in str(e.value) and field in str(e.value), str(e.value)
    finally:
        monkeypatch.delenv("CKPT_QUANT_TABLES")
        tables._load.cache_clear()


@pytest.mark.parametrize(("preset", "weights", "scheme", "label"), [
    ("NVFP4", {}, "ct-nvfp4", "NVFP4"),
    ("FP8_DYNAMIC", {}, "ct-fp8", "FP8 channel"),
    ("FP8_BLOCK", {"block_structure": [32, 32]}, "ct-fp8", "FP8 block"),
    ("W4A16_ASYM", {"group_size": 32}, "ct-pack", "INT4 group 32"),
    ("W8A16", {"group_size": 32}, "ct-pack", "INT8 group 32"),
    ("MXFP4", {}, "ct-mxfp4", "MXFP4"),
    ("W8A8", {}, "ct-int8", "INT8 channel"),
])
def test_compressed_tensors_schemes_are_detected_and_stored_modules_recognised(quantized, preset, weights, scheme,
                                                                              label):
    ck = Checkpoint.open(quantized(preset, **weights))
    qs = detect_scheme(ck)
    assert qs is not None and qs.name == scheme
    st = module_storage(ck, qs, "model.layers.1.mlp.experts.0.down_proj")
    assert st.state == "quantized" and st.scheme == scheme and st.label.startswith(label), st
    assert st.complete and st.shape == (64, 32)
    bf16 = module_storage(ck, qs, "model.layers.3.eh_proj")
    assert bf16.state == "unquantized" and bf16.label == "BF16"
    assert module_storage(ck, qs, "model.layers.9.eh_proj").state == "absent"


def test_a_module_missing_its_scale_says_which(quantized, tmp_path):
    from safetensors.torch import load_file, save_file

    src = quantized("NVFP4")
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.self_attn.o_proj.weight_scale"]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    ck = Checkpoint.open(tmp_path)
    st = module_storage(ck, detect_scheme(ck), "model.layers.1.self_attn.o_proj")
    assert st.state == "quantized" and st.missing == ("model.layers.1.self_attn.o_proj.weight_scale",)


NAMES = ["lm_head", "model.layers.1.mlp.gate", "model.layers.1.mlp.gate_proj", "model.layers.3.mlp.experts.0.up_proj",
         "model.layers.3.eh_proj", "model.layers.3.self_attn.q_a_proj", "mtp.fc", "model.layers.31.mlp.down_proj"]


def test_declared_agrees_with_compressed_tensors_match_name(quantized):
    match_name = ct()["match_name"]
    ck = Checkpoint.open(quantized("NVFP4"))
    qs = detect_scheme(ck)
    ignore = qs.declarations[0].section["ignore"]
    for name in NAMES:
        ours = declared(qs, None, name)
        theirs = any(match_name(name, i) for i in ignore)
        assert ours == ("excluded" if theirs else "quantized"), name


def test_fused_names_are_judged_by_their_shards_as_the_library_does():
    match_name = ct()["match_name"]
    files = {"config.json": {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                   "strategy": "channel"}}},
        "ignore": ["re:^mtp\\.layers\\.0\\.self_attn\\.[qkv]_proj$", "mtp.layers.0.mlp.gate_proj",
                   "re:.*o_proj$"]}}}
    qs = detect_in(files)
    for name, want in [("mtp.layers.0.self_attn.qkv_proj", "excluded"), ("mtp.layers.0.mlp.gate_up_proj", "conflict"),
                       ("mtp.layers.1.self_attn.qkv_proj", "quantized"), ("mtp.layers.0.self_attn.o_proj", "excluded")]:
        assert declared(qs, None, name, FUSED) == want, name
        if want != "conflict":  # the library's any-shard rule agrees wherever the shards agree
            assert any(match_name(name, i, FUSED) for i in files["config.json"]["quantization_config"]["ignore"]) \
                == (want == "excluded"), name


def test_exclusion_entries_make_every_module_ignored_for_the_library(quantized):
    match_name = ct()["match_name"]
    ck = Checkpoint.open(quantized("FP8_DYNAMIC"))
    qs = detect_scheme(ck)
    mtp = ["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj",
           "model.layers.3.self_attn.o_proj", "model.layers.3.mlp.experts.0.gate_proj", "model.layers.3.eh_proj"]
    before = [declared(qs, None, m) for m in mtp]
    assert "quantized" in before
    patch = exclusion_entries(qs, mtp, FUSED)
    assert patch.files == ["config.json"]
    files = patch.apply(quant_files(ck))
    ignore = files["config.json"]["quantization_config"]["ignore"]
    assert "model.layers.3.self_attn.qkv_proj" in ignore  # the fused name too (SGLang matches it alone)
    assert not any("mlp" in e for e in ignore[len(qs.declarations[0].section["ignore"]):])  # re: covers them
    assert ignore[: len(qs.declarations[0].section["ignore"])] == qs.declarations[0].section["ignore"]
    for m in mtp + ["model.layers.3.self_attn.qkv_proj"]:
        assert declared(qs, files, m, FUSED) == "excluded", m
        assert any(match_name(m, i, FUSED) for i in ignore), m
    assert declared(qs, files, "model.layers.1.self_attn.o_proj") == "quantized"  # nothing else changed
    assert not exclusion_entries(detect_in(files), mtp, FUSED).changes  # idempotent


def _modelopt(tmp_path: Path, ct_dir: Path, mixed: bool) -> Path:
    """compressed-tensors NVFP4 tensors renamed to ModelOpt's layout (the converter's inverse), with both
    ModelOpt configuration files."""
    from safetensors.torch import load_file, save_file

    out = {}
    for k, v in load_file(ct_dir / "model.safetensors").items():
        m, _, p = k.rpartition(".")
        if p == "weight_packed":
            out[f"{m}.weight"] = v
        elif p == "weight_global_scale":
            out[f"{m}.weight_scale_2"] = (1 / v).reshape(())
        else:
            out[k] = v
    save_file(out, tmp_path / "model.safetensors")
    cfg = json.loads((ct_dir / "config.json").read_text())
    quantized = sorted({k.rpartition(".")[0] for k, v in out.items() if k.endswith(".weight_scale_2")})
    exclude = ["lm_head", "model.layers.3.mlp*"]
    if mixed:
        layers = {m: {"quant_algo": "NVFP4", "group_size": 16} for m in quantized}
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                      "quantized_layers": layers, "ignore": exclude}
        hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MIXED_PRECISION",
                                                                 "quantized_layers": layers,
                                                                 "exclude_modules": exclude}}
    else:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "ignore": exclude}
        hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                                 "exclude_modules": exclude}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hq))
    return tmp_path


@pytest.mark.parametrize("mixed", [False, True])
def test_modelopt_nvfp4_both_files_globs_and_mixed_precision(quantized, tmp_path, mixed):
    ck = Checkpoint.open(_modelopt(tmp_path, quantized("NVFP4"), mixed))
    qs = detect_scheme(ck)
    assert qs.name == "modelopt-nvfp4" and [d.file for d in qs.declarations] == ["config.json",
                                                                                 "hf_quant_config.json"]
    st = module_storage(ck, qs, "model.layers.1.self_attn.o_proj")
    assert st.state == "quantized" and st.scheme == "modelopt-nvfp4" and st.complete, st
    assert declared(qs, None, "model.layers.3.mlp.experts.1.down_proj") == "excluded"  # glob
    assert declared(qs, None, "model.layers.3.eh_proj") == ("excluded" if mixed else "quantized")
    patch = exclusion_entries(qs, ["model.layers.3.eh_proj", "model.layers.1.self_attn.o_proj"])
    assert patch.files == ["config.json", "hf_quant_config.json"]
    files = patch.apply(quant_files(ck))
    for m in ("model.layers.3.eh_proj", "model.layers.1.self_attn.o_proj"):
        assert declared(qs, files, m) == "excluded"
    if mixed:
        layers = files["hf_quant_config.json"]["quantization"]["quantized_layers"]
        assert "model.layers.1.self_attn.o_proj" not in layers
    # one file repaired and not the other: consumers disagree
    half = {**quant_files(ck), "config.json": files["config.json"]}
    d = declaration(qs, half, "model.layers.1.self_attn.o_proj")
    assert d.state == "conflict" and "disagree" in d.reason


def test_transformers_patterns_match_as_should_convert_module_does():
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = ["model.layers.61", "eh_proj", "re_only.*", "mlp.gate", "model.layers.1.self_attn"]
    names = ["model.layers.61.self_attn.q_a_proj", "model.layers.611.mlp", "model.layers.6.eh_proj",
             "mlp.gate_proj", "x.mlp.gate", "model.layers.1.self_attn", "model.layers.1.self_attn.o_proj",
             "re_only.thing", "model.layers.1.self_attn_x"]
    for n in names:
        for p in patterns:
            assert match_one("transformers", n, p) == (not should_convert_module(n, [p])), (n, p)


def test_modelopt_globs_are_fnmatch():
    assert excluded("modelopt", "mtp.fc", ["mtp.layers.0*"]) is False  # vLLM #38832: mtp.fc stays NVFP4
    assert excluded("modelopt", "mtp.fc", ["*mtp*"]) is True
    assert excluded("modelopt", "model.layers.0.self_attn.qkv_proj", ["*q_proj", "*k_proj", "*v_proj"], FUSED) is True
    assert excluded("modelopt", "model.layers.0.self_attn.qkv_proj", ["*q_proj"], FUSED) is None


def test_no_quantization_is_none_and_an_unknown_one_is_refused(make_fixture, tmp_path):
    assert detect_scheme(Checkpoint.open(make_fixture("deepseek_v3"))) is None
    with pytest.raises(InputError) as e:
        detect_in({"config.json": {"quantization_config": {"quant_method": "awq", "bits": 4}}})
    assert e.value.rule == "quant-unknown" and "awq" in str(e.value)
    with pytest.raises(InputError) as e:
        detect_in({"config.json": {"quantization_config": {
            "quant_method": "compressed-tensors", "format": "marlin-24",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}}})
    assert e.value.rule == "quant-unknown" and "marlin-24" in str(e.value)


def test_deepseek_v4_is_told_from_block_fp8_by_its_scales(make_fixture):
    fp8 = Checkpoint.open(make_fixture("deepseek_v3", fp8=True))
    qs = detect_scheme(fp8)
    assert qs.name == "fp8-block"
    st = module_storage(fp8, qs, "model.layers.1.self_attn.q_a_proj")
    assert st.state == "quantized" and st.complete and st.label == "FP8 block [128, 128]"

    class Ref:
        def __init__(self, dtype, shape):
            self.dtype, self.shape, self.key = dtype, shape, ""

    tensors = {"mtp.0.attn.wq_a.weight": Ref("F8_E4M3", (32, 64)), "mtp.0.attn.wq_a.scale": Ref("F8_E8M0", (1, 1)),
               "mtp.0.ffn.experts.0.w1.weight": Ref("I8", (32, 32)),
               "mtp.0.ffn.experts.0.w1.scale": Ref("F8_E8M0", (32, 2))}
    for k, r in tensors.items():
        r.key = k
    files = {"config.json": {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                     "weight_block_size": [128, 128]}}}
    qs = detect_in(files, tensors)
    assert qs.name == "deepseek-v4"

    class Ck:
        pass

    ck = Ck()
    ck.tensors = tensors
    st = module_storage(ck, qs, "mtp.0.ffn.experts.0.w1")
    assert (st.format, st.shape, st.complete) == ("fp4-experts", (32, 64), True), st
    assert module_storage(ck, qs, "mtp.0.attn.wq_a").format == "fp8-block"


def test_a_missing_extra_is_one_error_naming_it(monkeypatch):
    import builtins

    from ckpt_tools.errors import UsageError, extra_module

    real = builtins.__import__

    def no_ct(name, *a, **kw):
        if name.startswith("compressed_tensors"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ct)
    with pytest.raises(UsageError) as e:
        extra_module("compressed_tensors", "graft --dequant-trunk", "compressed-tensors", "ckpt-tools[quant]")
    assert "ckpt-tools[quant]" in str(e.value) and e.value.exit_code == 2


@pytest.mark.parametrize("mixed", [False, True])
def test_subtree_entries_exclude_a_whole_mtp_layer_for_every_matcher(quantized, tmp_path, mixed):
    """One entry per MTP prefix where the list's matcher has a subtree form; exact names elsewhere."""
    match_name = ct()["match_name"]
    mtp = ["model.layers.3.self_attn.q_a_proj", "model.layers.3.mlp.experts.0.gate_proj", "model.layers.3.eh_proj"]
    ck = Checkpoint.open(quantized("FP8_DYNAMIC"))
    qs = detect_scheme(ck)
    files = exclusion_entries(qs, mtp, FUSED, subtrees=["model.layers.3."]).apply(quant_files(ck))
    ignore = files["config.json"]["quantization_config"]["ignore"]
    assert ignore[len(IGNORE):] == ["re:^model\\.layers\\.3\\..*"]  # one entry covers every module under it
    for m in mtp + ["model.layers.3.self_attn.fused_qkv_a_proj", "model.layers.3.mlp.experts.7.up_proj"]:
        assert declared(qs, files, m, FUSED) == "excluded" and any(match_name(m, i) for i in ignore), m
    assert declared(qs, files, "model.layers.31.mlp.down_proj") == "quantized"  # a prefix, not a substring
    mo = Checkpoint.open(_modelopt(tmp_path, quantized("NVFP4"), mixed))
    qm = detect_scheme(mo)
    files = exclusion_entries(qm, mtp, FUSED, subtrees=["model.layers.3"]).apply(quant_files(mo))
    assert "model.layers.3.*" in files["hf_quant_config.json"]["quantization"]["exclude_modules"]
    for m in mtp:
        assert declared(qm, files, m, FUSED) == "excluded", m
    fp8 = detect_in({"config.json": {"quantization_config": {"quant_method": "fp8", "ignored_layers": ["lm_head"]}}})
    files = exclusion_entries(fp8, mtp, FUSED, subtrees=["model.layers.3"]).apply(fp8.files)
    q = files["config.json"]["quantization_config"]
    assert q["ignored_layers"][1:] == [*mtp, "model.layers.3.mlp.experts.0.gate_up_proj"]  # exact names only
    assert "modules_to_not_convert" not in q  # written where the config already lists exclusions
