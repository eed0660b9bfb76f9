"""One quantization path: a block-FP8 weight's companions come from a scheme table (model.quant.codec).

The scheme the checkpoint stores (its scale companion's name) or declares decides; the family table's
one-word ``quantization`` hint is used only where there is no checkpoint (fixtures, the demo). A family
table without a quantization line handles block-FP8 checkpoints byte for byte as one with it, and
DeepSeek-V4's ``.scale`` companions come from the deepseek-v4 scheme table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ckpt_tools.errors import InputError, TableError, UsageError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.config import ConfigView
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.quant.codec import Companion, checkpoint_codec, restack_codec
from ckpt_tools.model.quant.tables import all_schemes
from ckpt_tools.model.tables.loader import all_tables, get_table, mappings_dir

from conftest import run_ckpt as ckpt

FP8_128 = {"moe_intermediate_size": 128, "hidden_size": 128}  # experts' I a multiple of the block: scales fuse


def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """key -> (dtype, shape, bytes) of every safetensors file in ``path``, read from the file format itself."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        data = f.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        for k, meta in header.items():
            start, end = meta["data_offsets"]
            out[k] = (meta["dtype"], meta["shape"], data[8 + n + start:8 + n + end])
    return out


@pytest.fixture
def unhinted(tmp_path, monkeypatch):
    """``unhinted(family)`` -> the name of a user table that is ``family``'s without its quantization line
    (detected by no config: pass --arch)."""

    def make(family: str) -> str:
        data = yaml.safe_load((mappings_dir() / "architectures" / f"{family}.yaml").read_text())
        assert data.pop("quantization")
        name = f"{family}_unhinted"
        data["family"] = name
        data["detect"] = {"architectures": [f"{name}ForTests"], "model_types": [name]}
        tables = tmp_path / "tables"
        tables.mkdir(exist_ok=True)
        (tables / f"{name}.yaml").write_text(yaml.safe_dump(data))
        monkeypatch.setenv("CKPT_TABLES", str(tables))
        assert all_tables()[name].quantization is None
        return name

    return make


def _ref(dtype: str, shape=(256, 256)):
    return SimpleNamespace(dtype=dtype, shape=shape)


def _ckpt(tensors: dict, config: dict | None = None):
    return SimpleNamespace(tensors=tensors, config=ConfigView(config or {}), local_dir=None, root="mem",
                           file_sizes={})


# --------------------------------------------------------------------------- the API


def test_every_family_hint_names_a_scheme_with_a_block_format():
    hinted = {f: t.quantization for f, t in all_tables().items() if t.quantization is not None}
    assert hinted, "no family hints a scheme"
    for family, scheme in hinted.items():
        fmt = checkpoint_codec(hint=scheme)
        assert fmt.scheme == scheme and fmt.how == "hint", family
    assert checkpoint_codec(hint="deepseek-v4").scale_suffix == "scale"
    assert checkpoint_codec(hint="fp8-block").scale_suffix == "weight_scale_inv"


def test_only_single_scale_fixed_tile_fp8_formats_are_block_formats():
    found = {name for name, t in all_schemes().items() if restack_codec(t) is not None}
    # ct-fp8 / modelopt-fp8 carry an optional input_scale and per-tensor / channel tiles; FP4 / int pack codes
    assert found == {"fp8-block", "deepseek-v4"}


def test_a_hint_must_name_a_scheme_with_a_block_format():
    with pytest.raises(UsageError, match="unknown quantization scheme 'no-such-scheme'"):
        checkpoint_codec(hint="no-such-scheme")
    with pytest.raises(InputError, match="'ct-nvfp4' has no block format") as ei:
        checkpoint_codec(hint="ct-nvfp4")
    assert ei.value.rule == "quant-hint"


def test_the_old_quantization_block_is_refused(tmp_path, monkeypatch):
    data = yaml.safe_load((mappings_dir() / "architectures" / "deepseek_v3.yaml").read_text())
    data.update(family="old_block", quantization={"method": "fp8-block", "block": [128, 128],
                                                   "scale_suffix": "weight_scale_inv"},
                detect={"architectures": ["OldBlockForTests"], "model_types": ["old_block"]})
    (tmp_path / "old_block.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv("CKPT_TABLES", str(tmp_path))
    with pytest.raises(TableError, match="field quantization"):
        all_tables()


def test_storage_decides_before_the_configuration_and_the_hint():
    v3 = {"a.weight": _ref("F8_E4M3"), "a.weight_scale_inv": _ref("F32", (2, 2))}
    v4 = {"a.weight": _ref("F8_E4M3"), "a.scale": _ref("F8_E8M0", (2, 2))}
    declared = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 128]}}
    assert checkpoint_codec(_ckpt(v3), hint="deepseek-v4").scheme == "fp8-block"
    got = checkpoint_codec(_ckpt(v4), hint="fp8-block")
    assert (got.scheme, got.scale_suffix, got.how) == ("deepseek-v4", "scale", "stored")
    # the block the configuration declares for the stored scheme's table
    assert checkpoint_codec(_ckpt(v3, declared)).block == (64, 128)
    # nothing stored: the declaration, then the hint, then the default
    assert checkpoint_codec(_ckpt({}, declared)).how == "declared"
    assert checkpoint_codec(_ckpt({"a.weight": _ref("BF16")}), hint="deepseek-v4").how == "hint"
    assert checkpoint_codec(_ckpt({})).scheme == "fp8-block"


def test_companions_name_role_and_shape():
    fmt = checkpoint_codec(hint="deepseek-v4")
    assert fmt.companions("m.wq_b.weight", (300, 129)) == [Companion("m.wq_b.scale", "scale", (3, 2))]
    assert fmt.companions("m.experts.gate_up_proj", (4, 256, 128)) == [
        Companion("m.experts.gate_up_proj_scale", "scale", (4, 2, 1))]
    assert checkpoint_codec().scale_key("x.weight") == "x.weight_scale_inv"


# --------------------------------------------------------------------------- the verbs, byte for byte


def test_block_fp8_without_a_quantization_line_extracts_and_fuses_the_same(make_fixture, tmp_path, unhinted):
    src = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_128)
    arch = unhinted("deepseek_v3")
    view = open_mtp(Checkpoint.open(src), get_table(arch))
    assert view.codec.how == "stored" and view.codec.scheme == "fp8-block"
    # every FP8 linear is a quantized module like any other scheme's, its scale named by the table
    fp8 = {s.key for s in view.present if view.ckpt.tensors[s.key].dtype == "F8_E4M3"}
    assert view.complete() and fp8 and set(view.quantized) == fp8
    assert all(st.scheme == "fp8-block" and set(st.tensors) == {"weight", "weight_scale_inv"}
               for st in view.quantized.values())
    for args in ((), ("--dequant", "bf16")):
        tag = "-".join(args) or "fp8"
        ckpt("extract", src, "-o", tmp_path / f"a-{tag}", *args)
        ckpt("extract", src, "-o", tmp_path / f"b-{tag}", "--arch", arch, *args)
        a, b = raw_tensors(tmp_path / f"a-{tag}"), raw_tensors(tmp_path / f"b-{tag}")
        assert a == b and a
        assert any(k.endswith("weight_scale_inv") for k in a) == (not args)
    ckpt("fuse-experts", src, "-o", tmp_path / "fa")
    ckpt("fuse-experts", src, "-o", tmp_path / "fb", "--arch", arch)
    fused = raw_tensors(tmp_path / "fa")
    assert fused == raw_tensors(tmp_path / "fb")
    assert "model.layers.3.mlp.experts.gate_up_proj_scale_inv" in fused
    ckpt("unfuse-experts", tmp_path / "fb", "-o", tmp_path / "back", "--arch", arch)
    assert raw_tensors(tmp_path / "back") == raw_tensors(src)


def test_block_fp8_without_a_quantization_line_stitches_the_same(make_fixture, tmp_path, unhinted):
    verifier = make_fixture("deepseek_v3", fp8=True)
    arch = unhinted("deepseek_v3")
    ckpt("extract", verifier, "-o", tmp_path / "draft")
    ckpt("stitch", tmp_path / "draft", verifier, "-o", tmp_path / "a")
    ckpt("stitch", tmp_path / "draft", verifier, "-o", tmp_path / "b", "--arch", arch)
    a = raw_tensors(tmp_path / "a")
    assert a == raw_tensors(tmp_path / "b") == raw_tensors(verifier)


def _extracted_alike(src: Path, arch: str, tmp_path: Path):
    """(args, tensors) of ``extract`` as stored and with ``--dequant bf16``, each the same detected and under
    ``--arch arch`` (asserted here)."""
    for args in ((), ("--dequant", "bf16")):
        tag = "-".join(args) or "fp8"
        ckpt("extract", src, "-o", tmp_path / f"a-{tag}", *args)
        ckpt("extract", src, "-o", tmp_path / f"b-{tag}", "--arch", arch, *args)
        a = raw_tensors(tmp_path / f"a-{tag}")
        assert a == raw_tensors(tmp_path / f"b-{tag}")
        yield args, a


def test_deepseek_v4_scale_companions_come_from_its_scheme_table(make_fixture, tmp_path, unhinted):
    src = make_fixture("deepseek_v4", fp8=True)
    stored = raw_tensors(src)
    scales = {k for k in stored if k.endswith(".scale")}
    assert scales and not any(k.endswith("weight_scale_inv") for k in stored)
    arch = unhinted("deepseek_v4")  # no hint: the `.scale` tensors alone say deepseek-v4
    view = open_mtp(Checkpoint.open(src), get_table(arch))
    fmt = view.codec
    assert (fmt.scheme, fmt.scale_suffix, fmt.how) == ("deepseek-v4", "scale", "stored")
    assert view.complete() and not view.missing_scales
    assert view.quantized and all(st.scheme == "deepseek-v4" and set(st.tensors) == {"weight", "scale"}
                                  for st in view.quantized.values())
    for args, a in _extracted_alike(src, arch, tmp_path):
        assert {k for k in a if k.endswith(".scale")} == ({k for k in scales if k in a} if not args else set())
        assert any(k.endswith(".scale") for k in a) == (not args)
    manifest = json.loads((tmp_path / "b-fp8" / "ckpt_manifest.json").read_text())
    assert manifest["source_quantization"]["scale_suffix"] == "scale"


def test_deepseek_v4_release_layout_reads_through_its_scheme_table(tmp_path, unhinted):
    """The release layout (UE8M0 `.scale` on FP8 weights, FP4 experts): extracted natively and dequantized the
    same under a table that hints nothing."""
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    src = make_quantized_checkpoint("deepseek_v4", tmp_path / "v4", QuantOptions("fp8-ue8m0-fp4-experts"))
    arch = unhinted("deepseek_v4")
    view = open_mtp(Checkpoint.open(src), get_table(arch))
    fmt = view.codec
    assert (fmt.scheme, fmt.scale_suffix, fmt.how) == ("deepseek-v4", "scale", "stored")
    assert "F8_E8M0" in fmt.scale_dtypes and view.complete()
    for args, a in _extracted_alike(src, arch, tmp_path):
        assert any(d == "F8_E8M0" and k.endswith(".scale") for k, (d, _, _) in a.items()) == (not args)


@pytest.mark.parametrize("scheme", ["ct-fp8-channel", "ct-nvfp4"])
def test_experts_of_another_scheme_are_refused_naming_the_rule(tmp_path, scheme):
    pytest.importorskip("compressed_tensors")
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    src = make_quantized_checkpoint("deepseek_v3", tmp_path / "q", QuantOptions(scheme))
    result = ckpt("fuse-experts", src, "-o", tmp_path / "f", code=None)
    out = result.output
    assert result.exit_code != 0
    assert "[expert-quant-scheme]" in out and f"scheme table {scheme.removesuffix('-channel')}" in out
    assert "`ckpt dequant` them first" in out and not (tmp_path / "f" / "model.safetensors").exists()


@pytest.mark.parametrize("extra", [[], ["--mtp-quant", "deepseek-v4"]])
def test_deepseek_v4_graft_keeps_its_scale_companions(make_fixture, tmp_path, extra):
    """F32 `.scale` companions (a fixture, a trainer's export) say deepseek-v4 as the release's F8_E8M0 ones do:
    the config's declaration, the stored MTP and --mtp-quant deepseek-v4 (its table's encoder) agree."""
    from ckpt_tools.model.quant import detect_scheme

    src = make_fixture("deepseek_v4", fp8=True)
    target = make_fixture("deepseek_v4", fp8=True, drop_mtp=True)
    assert detect_scheme(Checkpoint.open(target)).name == "deepseek-v4"
    ckpt("graft", src, target, "-o", tmp_path / "out", *extra)
    out, source = raw_tensors(tmp_path / "out"), raw_tensors(src)
    mtp = {k for k in source if k.startswith("mtp.")}
    assert any(k.endswith(".scale") for k in mtp) and not any(k.endswith("weight_scale_inv") for k in out)
    assert {k: out[k] for k in mtp} == {k: source[k] for k in mtp}


# --------------------------------------------------------------------------- one dequantizer


@pytest.mark.parametrize("out_dtype,band", [("BF16", 3000), ("F16", 3000), ("F32", 1 << 20), ("BF16", 60000)])
def test_the_verbs_decoder_writes_the_block_recipes_bytes(tmp_path, monkeypatch, out_dtype, band):
    """The verbs dequantize block-format weights with model/quant's decoder (Codec.decode): byte for byte
    what model.quant.decode_fp8's kernel (the former block-FP8 recipe's) computes (F32, BF16 and UE8M0 scales, stacks,
    edge tiles), with the same plan-time checks."""
    import numpy as np
    import torch
    from test_fp8 import as_fp8, random_fp8, run_plan, tensor_of, write_refs

    from ckpt_tools.errors import PlanError
    from ckpt_tools.model.quant import decode_fp8 as fp8_decode
    from ckpt_tools.stream.plan import OutputTensor

    from quant_helpers import dequant_array

    monkeypatch.setattr(fp8_decode, "BAND_ELEMS", band)
    rng = np.random.default_rng(11)
    qa, sa = random_fp8(rng, (300, 200), (128, 128), scale_exp=(-12, 0))
    qe, se = random_fp8(rng, (3, 130, 257), (128, 128), scale_exp=(-12, 0))
    e8 = rng.integers(100, 130, (3, 2, 3)).astype(np.uint8)
    refs, _ = write_refs(tmp_path / "in.safetensors", {
        "a.weight": as_fp8(qa), "a.weight_scale_inv": torch.from_numpy(sa),
        "b.weight_scale_inv": torch.from_numpy(sa).bfloat16(),
        "e.weight": as_fp8(qe), "e.weight_scale_inv": torch.from_numpy(se),
        "e8.scale": torch.from_numpy(e8).view(torch.float8_e8m0fnu),
        "bad.weight_scale_inv": torch.ones(2, 2), "f.weight": torch.zeros(300, 200, dtype=torch.bfloat16)})
    pairs = [("a.weight", "a.weight_scale_inv"), ("a.weight", "b.weight_scale_inv"), ("e.weight", "e.weight_scale_inv"),
             ("e.weight", "e8.scale")]
    for name in ("fp8-block", "deepseek-v4"):
        fmt = checkpoint_codec(hint=name)
        codes = {"a.weight": qa, "e.weight": qe}
        scales = {"a.weight_scale_inv": (sa, "F32"), "b.weight_scale_inv": (sa, "F32"),
                  "e.weight_scale_inv": (se, "F32"), "e8.scale": (e8, "F8_E8M0")}
        new, want = [], {}
        for i, (w, sc) in enumerate(pairs):
            if refs[sc].dtype not in fmt.scale_dtypes:
                continue  # deepseek-v4 scales are F8_E8M0 or F32
            a = fmt.decode(tensor_of(refs[w]), tensor_of(refs[sc]), out_dtype)
            assert a.shape == tuple(refs[w].shape) and a.dtype == out_dtype
            assert a.meta["dequantized_from"] == {"dtype": "F8_E4M3", "scale": sc, "block": [128, 128]}
            new.append(OutputTensor(f"t{i}", a.dtype, a.shape, a.recipe))
            sv, sdt = scales[sc]
            if sc == "b.weight_scale_inv":  # stored as BF16: its values rounded to bfloat16, read back
                sv = torch.from_numpy(sa).bfloat16().float().numpy()
            want[f"t{i}"] = dequant_array(codes[w], sv, (128, 128), "F8_E4M3", out_dtype, sdt).tobytes()
        got = run_plan(tmp_path, new, f"new-{name}")
        assert got.keys() == want.keys() and got
        for k in want:
            assert got[k].view(torch.uint8).numpy().tobytes() == want[k], k
    fmt = checkpoint_codec()
    w = tensor_of(refs["a.weight"])
    for scale, dtype, rule in ((refs["bad.weight_scale_inv"], "BF16", "fp8-scale-shape"),
                               (refs["a.weight_scale_inv"], "F8_E4M3", "dequant-dtype")):
        with pytest.raises(PlanError, match=rule):
            fmt.decode(w, tensor_of(scale), dtype)
    with pytest.raises(PlanError, match="not an FP8 matrix"):
        fmt.decode(tensor_of(refs["f.weight"]), tensor_of(refs["a.weight_scale_inv"]), "BF16")


@pytest.mark.parametrize("family, exempt", [
    ("deepseek_v3", {"model.layers.3.eh_proj", "model.layers.3.shared_head.head"}),
    ("glm4_moe", set()),
])
def test_the_release_convention_needs_a_table_that_flags_quantized_modules(make_fixture, tmp_path, family, exempt):
    """Under a declared block-FP8 config, a BF16 MTP module needs no exclusion only where the family table flags
    which modules its quantized releases quantize and leaves this one off (DeepSeek's eh_proj and
    shared head). A table that
    flags none (glm4_moe) says nothing of its releases: every BF16 MTP module must be excluded."""
    from ckpt_tools.model.quant.audit import audit

    src = tmp_path / "declared"
    shutil.copytree(make_fixture(family), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    result = audit(open_mtp(Checkpoint.open(src), get_table(family)))
    assert result.modules
    assert {m.module for m in result.modules if m.exempt} == exempt
    flagged = {f.key for f in result.findings}  # modules, and fused layers named apart
    unexcused = {m.module for m in result.modules if not m.exempt and m.stored.state == "unquantized"}
    assert unexcused and unexcused <= flagged and not flagged & exempt
