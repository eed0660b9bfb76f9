"""`ckpt graft SOURCE TARGET -o OUT`: quantized trunks that lost (or mangled) their MTP get the release's back.

TARGETs are the quantized fixtures (compressed-tensors' own compressors, ModelOpt's layout) with MTP
dropped (count kept or zeroed) or mangled; SOURCE is the BF16 fixture they were made from. The
output's MTP tensors are the source's bytes, everything else is the target's bytes, and the
consumers' own matchers (compressed-tensors ``match_name``, ModelOpt's fnmatch) say every MTP linear
module, under its checkpoint name and the engines' fused names, is left unquantized.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from pathlib import Path

import pytest
from test_integrity_output import interrupt_after, visible

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.tables.loader import get_table
from ckpt_tools.testing import FixtureOptions, make_checkpoint
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

from conftest import run_ckpt as ckpt
from conftest import tree_hash

pytest.importorskip("compressed_tensors", reason="compressed-tensors comes with the test extra")
from compressed_tensors.utils.match import match_name  # noqa: E402

MTP_PREFIX = {"deepseek_v3": "model.layers.3.", "qwen3_5_moe": "mtp."}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(family, scheme, **QuantOptions)`` -> a quantized fixture (cached); ``build(family)``: the BF16 source."""
    cache: dict = {}

    def make(family: str, scheme: str | None = None, **kw) -> Path:
        key = (family, scheme, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp("g")
            if scheme is None:  # the release: experts per expert, as the quantized fixtures were made from
                cache[key] = make_checkpoint(family, d, FixtureOptions(expert_layout="per-expert", **kw))
            else:
                cache[key] = make_quantized_checkpoint(family, d, QuantOptions(scheme, **kw))
        return cache[key]

    return make


def _open(path: Path) -> Checkpoint:
    return Checkpoint.open(str(path))


def _is_mtp(key: str, family: str) -> bool:
    return key.startswith(MTP_PREFIX[family])


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _index(out: Path) -> dict[str, str]:
    return json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]


def _mtp_linears(src: Checkpoint, family: str) -> list[str]:
    """Every MTP Linear module of the source (the table's linear weights) and the engines' fused names of its
    shards (the family table's fused_modules; routed experts are loaded per expert, never fused)."""
    from ckpt_tools.model.mtp import open_mtp

    fused = get_table(family).fused_modules
    mods = {s.key.removesuffix(".weight") for s in open_mtp(src).present
            if s.kind == "linear" and s.key.endswith(".weight") and len(s.shape) == 2}
    for m in [m for m in mods if ".experts." not in m]:
        parent, _, leaf = m.rpartition(".")
        for name, shards in fused.items():
            if leaf in shards and all(f"{parent}.{s}" in mods for s in shards):
                mods.add(f"{parent}.{name}")
    return sorted(mods)


def _assert_grafted(src_dir: Path, target_dir: Path, out: Path, family: str) -> None:
    """MTP = the source's bytes; every other tensor and every untouched shard = the target's bytes."""
    src, tgt, res = _open(src_dir), _open(target_dir), _open(out)
    mtp = {k for k in src.tensors if _is_mtp(k, family)}
    assert {k for k in res.tensors if _is_mtp(k, family)} == mtp
    for k in mtp:
        assert res.tensors[k].dtype == src.tensors[k].dtype and res.tensors[k].read() == src.tensors[k].read(), k
    trunk = {k for k in tgt.tensors if not _is_mtp(k, family)}
    assert {k for k in res.tensors if not _is_mtp(k, family)} == trunk
    for k in trunk:
        assert res.tensors[k].read() == tgt.tensors[k].read(), k
    index = _index(out)
    assert set(index) == set(res.tensors)  # one entry per key, no duplicate
    untouched = {name for name, keys in tgt.shard_keys.items() if not any(_is_mtp(k, family) for k in keys)}
    assert untouched, "every target shard holds MTP tensors"
    for name in untouched:
        assert _sha(out / name) == _sha(target_dir / name), name


# ---------------------------------------------------------------------------
# the acceptance cases: bf16 MTP into compressed-tensors FP8 / NVFP4 trunks that lost it


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe"])
@pytest.mark.parametrize(("scheme", "count"), [("ct-fp8-block", "kept"), ("ct-fp8-channel", "zero"),
                                               ("ct-nvfp4", "kept"), ("ct-nvfp4", "zero")])
def test_graft_restores_a_dropped_mtp_into_a_compressed_tensors_trunk(build, family, scheme, count, tmp_path):
    src, target = build(family), build(family, scheme, mtp="dropped", mtp_count=count)
    before = tree_hash(target)
    # what graft repairs: mtp-missing (count kept), or a note that the quantizer may have dropped MTP (zero)
    r = ckpt("validate", target, code=1 if count == "kept" else 0)
    assert ("mtp-missing" if count == "kept" else "mtp-none") in r.output
    out = tmp_path / "out"
    ckpt("graft", src, target, "-o", out)
    assert tree_hash(target) == before
    _assert_grafted(src, target, out, family)
    config = json.loads((out / "config.json").read_text())
    cv = _open(out).config
    assert cv.get("num_nextn_predict_layers" if family == "deepseek_v3" else "mtp_num_hidden_layers") == 1
    ignore = config["quantization_config"]["ignore"]
    modules = _mtp_linears(_open(src), family)
    assert [m for m in modules if any(m.endswith(f) for f in get_table(family).fused_modules)]  # fused names too
    assert not [m for m in modules if not any(match_name(m, i) for i in ignore)]
    # the trunk stays quantized: no trunk module became ignored
    trunk = {k.removesuffix(".weight_packed").removesuffix(".weight") for k in _open(target).tensors
             if k.endswith((".weight_packed", ".weight")) and not _is_mtp(k, family)}
    before_ignore = json.loads((target / "config.json").read_text())["quantization_config"]["ignore"]
    assert {m for m in trunk if any(match_name(m, i) for i in ignore)} == \
        {m for m in trunk if any(match_name(m, i) for i in before_ignore)}
    ckpt("validate", out)
    report = json.loads((out / "graft-report.json").read_text())
    assert report["totals"]["added"] == len([k for k in _open(src).tensors if _is_mtp(k, family)])
    assert report["quant_config"]["changes"] and not report["quant_config"]["unfixable"]
    assert report["mtp_count"]["after"] == 1 and report["mtp_count"]["before"] == (1 if count == "kept" else 0)


def test_modelopt_nvfp4_target_gets_its_exclude_modules_repaired(build, tmp_path):
    family = "qwen3_5_moe"
    src, target = build(family), build(family, "modelopt-nvfp4", mtp="dropped")
    out = tmp_path / "out"
    ckpt("graft", src, target, "-o", out)
    _assert_grafted(src, target, out, family)
    exclude = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    modules = _mtp_linears(_open(src), family)
    assert "mtp.fc" in modules
    assert not [m for m in modules if not any(fnmatch.fnmatch(m, p) for p in exclude)]
    before = json.loads((target / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert set(before) <= set(exclude)
    ckpt("validate", out)


def test_source_with_fused_experts_is_restacked_into_the_trunks_layout(build, tmp_path):
    """Qwen3.5-MoE ships fused experts; the quantized trunk stores them per expert: so does the grafted MTP."""
    family = "qwen3_5_moe"
    shipped = make_checkpoint(family, tmp_path / "shipped", FixtureOptions())
    target = build(family, "ct-nvfp4", mtp="dropped")
    assert any(k.startswith("mtp.") and k.endswith("experts.gate_up_proj") for k in _open(shipped).tensors)
    out, per_expert = tmp_path / "out", tmp_path / "per-expert"
    ckpt("graft", shipped, target, "-o", out)
    ckpt("unfuse-experts", shipped, "-o", per_expert)
    _assert_grafted(per_expert, target, out, family)  # the release's bytes, restacked as unfuse-experts does
    ckpt("validate", out)


# ---------------------------------------------------------------------------
# storage options


def test_mtp_quant_fp8_block_into_a_deepseek_block_fp8_target(make_fixture, tmp_path):
    import torch
    from safetensors.torch import load_file

    from quant_helpers import fp8_dequant as dequantize

    src = make_fixture("deepseek_v3")
    target = make_fixture("deepseek_v3", fp8=True, drop_mtp=True)
    out = tmp_path / "out"
    ckpt("graft", src, target, "-o", out, "--mtp-quant", "fp8-block")
    res, s = {}, {}
    for p in out.glob("*.safetensors"):
        res.update(load_file(p))
    for p in Path(src).glob("*.safetensors"):
        s.update(load_file(p))
    fp8 = [k for k in res if _is_mtp(k, "deepseek_v3") and res[k].dtype == torch.float8_e4m3fn]
    assert fp8 and all(res[k.removesuffix(".weight") + ".weight_scale_inv"].dtype == torch.float32 for k in fp8)
    assert "model.layers.3.eh_proj.weight" not in fp8  # the table leaves the fusion unquantized, as the release
    assert {k for k in res if _is_mtp(k, "deepseek_v3") and k not in fp8 and not k.endswith("_scale_inv")} == \
        {k for k in s if _is_mtp(k, "deepseek_v3") and k not in fp8}
    for k in fp8:
        w = dequantize(res[k], res[k.removesuffix(".weight") + ".weight_scale_inv"], (128, 128))
        ref = s[k].float()
        assert float((w - ref).norm() / ref.norm()) < 0.05, k
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["quantization_config"]["quant_method"] == "fp8"
    ckpt("validate", out)


def test_mtp_quant_into_a_scheme_that_cannot_declare_it_is_refused(build, tmp_path):
    r = ckpt("graft", build("deepseek_v3"), build("deepseek_v3", "ct-nvfp4", mtp="dropped"), "-o", tmp_path / "o",
             "--mtp-quant", "fp8-block", code=3)
    assert "[mtp-quant-config]" in r.output and not (tmp_path / "o").exists()


def test_a_source_storage_the_target_config_cannot_declare_is_refused_and_mtp_dtype_fits_it(make_fixture, build,
                                                                                             tmp_path):
    """DeepSeek's block FP8 (weight_scale_inv) is not what a compressed-tensors config declares: as stored it is
    refused (rule named, the way out said); --mtp-dtype bf16 dequantizes it into an MTP the config excludes."""
    src, target = make_fixture("deepseek_v3", fp8=True), build("deepseek_v3", "ct-fp8-block", mtp="dropped")
    r = ckpt("graft", src, target, "-o", tmp_path / "o", code=3)
    assert "[mtp-quant-config]" in r.output and "--mtp-dtype bf16" in r.output and not (tmp_path / "o").exists()
    ckpt("graft", src, target, "-o", tmp_path / "o", "--mtp-dtype", "bf16")
    res = _open(tmp_path / "o")
    assert {res.tensors[k].dtype for k in res.tensors if _is_mtp(k, "deepseek_v3")} == {"BF16", "F32"}
    ckpt("validate", tmp_path / "o")


def test_mtp_dtype_dequantizes_a_quantized_source(build, tmp_path):
    """A quantized checkpoint that kept its MTP (NVFP4) is a source too: --mtp-dtype bf16 dequantizes it, with
    the values `extract --dequant bf16` gives."""
    family = "deepseek_v3"
    src, target = build(family, "ct-nvfp4"), build(family, "ct-fp8-channel", mtp="dropped")
    out, draft = tmp_path / "out", tmp_path / "draft"
    ckpt("graft", src, target, "-o", out, "--mtp-dtype", "bf16")
    ckpt("extract", src, "-o", draft, "--dequant", "bf16")
    res, d = _open(out), _open(draft)
    mtp = {k for k in res.tensors if _is_mtp(k, family)}
    assert mtp == set(d.tensors) and all(res.tensors[k].dtype in ("BF16", "F32") for k in mtp)
    assert all(res.tensors[k].read() == d.tensors[k].read() for k in mtp)
    ckpt("validate", out)


def test_default_storage_copies_a_quantized_source_as_stored_when_the_target_declares_it(build, tmp_path):
    family = "qwen3_5_moe"
    src, target = build(family, "ct-nvfp4"), build(family, "ct-nvfp4", mtp="dropped", mtp_count="zero")
    out = tmp_path / "out"
    ckpt("graft", src, target, "-o", out)
    res, s = _open(out), _open(src)
    assert "mtp.fc.weight_packed" in res.tensors
    assert all(res.tensors[k].read() == s.tensors[k].read() for k in s.tensors if _is_mtp(k, family))
    ckpt("validate", out)


# ---------------------------------------------------------------------------
# mangled targets


@pytest.mark.parametrize("mangled", [
    {"mtp": "quantized", "drop_keys": ("model.layers.3.self_attn.o_proj.weight_scale",
                                       "model.layers.3.mlp.experts.1.*")},
    {"mtp": "bf16", "mtp_exclude": "no-fusion"},
])
def test_a_mangled_mtp_is_replaced(build, mangled, tmp_path):
    family = "deepseek_v3"
    src, target = build(family), build(family, "ct-nvfp4", **mangled)
    out = tmp_path / "out"
    r = ckpt("graft", src, target, "-o", out, "--json")
    _assert_grafted(src, target, out, family)
    report = json.loads(r.stdout)
    had = {k for k in _open(target).tensors if _is_mtp(k, family)}
    statuses = {t["key"]: t["status"] for t in report["tensors"]}
    assert {k for k, s in statuses.items() if s in ("replaced", "removed")} == had
    assert all(statuses[k] == "removed" for k in had if k not in _open(src).tensors)
    ckpt("validate", out)


# ---------------------------------------------------------------------------
# refusals, dry run, resume


def test_source_of_another_family_is_refused(build, tmp_path):
    r = ckpt("graft", build("qwen3_5_moe"), build("deepseek_v3", "ct-nvfp4", mtp="dropped"), "-o", tmp_path / "o",
             code=3)
    assert "[wrong-family]" in r.output and not (tmp_path / "o").exists()


def test_source_without_mtp_is_refused(build, make_fixture, tmp_path):
    r = ckpt("graft", make_fixture("deepseek_v3", drop_mtp=True), build("deepseek_v3", "ct-nvfp4", mtp="dropped"),
             "-o", tmp_path / "o", code=3)
    assert "[no-mtp]" in r.output


def test_source_of_another_size_is_refused(build, make_fixture, tmp_path):
    other = make_fixture("deepseek_v3", config_overrides={"vocab_size": 512})
    r = ckpt("graft", other, build("deepseek_v3", "ct-nvfp4", mtp="dropped"), "-o", tmp_path / "o", code=3)
    assert "[source-mismatch]" in r.output and "vocab" in r.output


def test_target_with_another_inconsistency_is_still_refused(build, tmp_path):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(build("deepseek_v3", "ct-nvfp4", mtp="dropped"), target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    key = next(k for k in index["weight_map"] if k.startswith("model.layers.1.") and k.endswith("o_proj.weight_packed"))
    del index["weight_map"][key]  # a trunk tensor the index does not list
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    r = ckpt("graft", build("deepseek_v3"), target, "-o", tmp_path / "o", code=3)
    assert "[unindexed-key]" in r.output


def test_output_inside_an_input_is_refused(build, tmp_path):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(build("deepseek_v3", "ct-nvfp4", mtp="dropped"), target)
    before = tree_hash(target)
    r = ckpt("graft", build("deepseek_v3"), target, "-o", target / "out", code=None)
    assert r.exit_code in (2, 4) and tree_hash(target) == before


def test_dry_run_writes_nothing(build, tmp_path):
    out = tmp_path / "o"
    r = ckpt("graft", build("deepseek_v3"), build("deepseek_v3", "ct-nvfp4", mtp="dropped"), "-o", out, "--dry-run",
             "--report", tmp_path / "report.json")
    assert not out.exists() and "added" in r.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "graft" and report["quant_config"]["changes"]


def test_resume_after_an_interruption_gives_the_same_bytes(build, tmp_path, monkeypatch):
    src, target = build("deepseek_v3"), build("deepseek_v3", "ct-nvfp4", mtp="dropped")
    ref, out = tmp_path / "ref", tmp_path / "out"
    ckpt("graft", src, target, "-o", ref)
    with monkeypatch.context() as m:
        interrupt_after(m, 2, "copy_whole_file")  # a target shard copied into place, the next one not
        ckpt("graft", src, target, "-o", out, code=130)
    assert not (out / "model.safetensors.index.json").exists()
    r = ckpt("graft", src, target, "-o", out, code=4)
    assert "--resume" in r.output
    ckpt("graft", src, target, "-o", out, "--resume")
    assert visible(out) == visible(ref)


# ---------------------------------------------------------------------------
# a real consumer: transformers loads the grafted DeepSeek-V3 (its trunk dequantized by compressed-tensors)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # the dequantize=True load option
def test_transformers_loads_the_grafted_mtp_after_dequantizing_the_trunk(tmp_path):
    """The release: a tiny 61-layer DeepSeek-V3 transformers wrote, with its MTP layer 61. The quantizer: the
    trunk (MTP dropped, count 0) compressed to FP8 by compressed-tensors, which ignores lm_head and routers.
    After graft, transformers loads the trunk with compressed-tensors decompressing it, `MtpModel` loads the
    grafted layer exactly, and `generate(use_mtp=True)` gives plain greedy decoding's tokens."""
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import save_file
    from test_consumer_transformers import tiny_config

    from ckpt_tools.io.config import ConfigView
    from ckpt_tools.model.tables.resolve import resolve
    from ckpt_tools.testing.fixtures import spec_values

    import quant_helpers as qh

    release = tmp_path / "release"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(tiny_config())
    model.save_pretrained(release, max_shard_size="400KB")
    res = resolve(get_table("deepseek_v3"), ConfigView(json.loads((release / "config.json").read_text())))
    mtp = {s.key: torch.from_numpy(spec_values(s, 7, zero_centred=False)).to(
        torch.float32 if s.dtype == "F32" else torch.bfloat16) for s in res.mtp_specs() if not s.copy_of}
    save_file(mtp, str(release / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((release / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    (release / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    trunk, target, out = tmp_path / "trunk", tmp_path / "target", tmp_path / "out"
    ckpt("extract", release, "--drop-mtp", "-o", trunk)
    qh.write_quantized(trunk, target, qh.scheme_for("FP8_DYNAMIC"), ["lm_head", "re:.*mlp.gate$"])
    ckpt("graft", release, target, "-o", out)
    ckpt("validate", out)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    modules = _mtp_linears(_open(release), "deepseek_v3")
    assert "model.layers.61.self_attn.fused_qkv_a_proj" in modules
    assert not [m for m in modules if not any(match_name(m, i) for i in ignore)]

    main = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    o_proj = main.model.layers[5].self_attn.o_proj
    ref = model.model.layers[5].self_attn.o_proj.weight.detach().float()
    assert type(o_proj) is torch.nn.Linear
    assert float((o_proj.weight.detach() - ref).norm() / ref.norm()) < 0.05  # the FP8 error, decompressed
    from transformers.modeling_layers import MtpModel

    layer = dict(MtpModel.from_pretrained(main).layers[0].named_parameters())
    assert torch.equal(layer["eh_proj.weight"].float(), mtp["model.layers.61.eh_proj.weight"].float())
    assert torch.equal(layer["mtp_block.self_attn.kv_b_proj.weight"].float(),
                       mtp["model.layers.61.self_attn.kv_b_proj.weight"].float())
    ids = torch.tensor([[1, 5, 9, 17, 33, 62]])
    plain = main.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(plain, main.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True))


def test_hardlink_links_the_untouched_target_shards(build, tmp_path):
    src, target = build("deepseek_v3"), build("deepseek_v3", "ct-nvfp4", mtp="dropped")
    out = tmp_path / "out"
    ckpt("graft", src, target, "-o", out, "--link", "hardlink", "--plan-json", tmp_path / "plan.json")
    shards = sorted(p.name for p in target.glob("*.safetensors"))
    assert shards and all((out / n).stat().st_ino == (target / n).stat().st_ino for n in shards)
    assert json.loads((tmp_path / "plan.json").read_text())
    ckpt("validate", out)


def _scales(out: Path, prefix: str) -> dict:
    from safetensors.torch import load_file

    found = {}
    for p in out.glob("*.safetensors"):
        found.update({k: v for k, v in load_file(p).items() if k.startswith(prefix) and k.endswith("_scale_inv")})
    return found


def test_mtp_quant_into_a_ue8m0_target_writes_power_of_two_scales(build, tmp_path):
    """scale_fmt ue8m0 (DeepSeek-V3.1 / V3.2): engines may read the scales as UE8M0, so re-quantized MTP
    weights get power-of-two scales too (2 ** ceil(log2(amax / 448))), not arbitrary float32 ones."""
    import torch

    target = build("deepseek_v3", "fp8-block-ue8m0", mtp="dropped")
    out = tmp_path / "out"
    ckpt("graft", build("deepseek_v3"), target, "-o", out, "--mtp-quant", "fp8-block")
    scales = _scales(out, "model.layers.3.")
    assert scales and all(bool((torch.frexp(s)[0] == 0.5).all()) for s in scales.values())
    trunk = _scales(target, "model.layers.0.")
    assert trunk and all(bool((torch.frexp(s)[0] == 0.5).all()) for s in trunk.values())  # as the trunk's
    ckpt("validate", out)


def _judged_in(monkeypatch, root: Path) -> list[str]:
    """Keys of ``root``'s scales that quant-scale-value reads (scale_values.judge), recorded as it runs."""
    from ckpt_tools.model.quant import scale_values

    seen: list[str] = []
    judge = scale_values.judge

    def spy(refs, *a, **kw):
        seen.extend(r.key for r, _ in refs if Path(r.file).parent.resolve() == root.resolve())
        return judge(refs, *a, **kw)

    monkeypatch.setattr(scale_values, "judge", spy)
    return seen


def test_output_check_reads_only_the_scales_no_gate_read(build, tmp_path, monkeypatch):
    """The target's shards are copied whole, their scales read by the target's gate: the output check does not
    read them again (issue 43); the MTP scales graft encodes (--mtp-quant), which no gate saw, it still reads."""
    src, target = build("deepseek_v3"), build("deepseek_v3", "fp8-block-ue8m0", mtp="dropped")
    out = tmp_path / "out"
    judged = _judged_in(monkeypatch, out)
    ckpt("graft", src, target, "-o", out, "--mtp-quant", "fp8-block")
    mtp = [k for k in judged if _is_mtp(k, "deepseek_v3")]
    assert len(mtp) > 4 and all(k.endswith("weight_scale_inv") for k in mtp), mtp
    assert sorted(judged) == sorted(mtp), [k for k in judged if k not in mtp][:3]
    assert json.loads((out / "graft-report.json").read_text())["validation"]["ok"]


def test_output_check_still_reads_scales_the_gate_let_through(build, tmp_path):
    """--allow-invalid quant-scale-value: the gate found a zero scale in a trunk shard and let it through, so the
    output check reads it again and lists it as allowed."""
    import shutil
    import struct

    target = tmp_path / "target"
    shutil.copytree(build("deepseek_v3", "ct-nvfp4", mtp="dropped"), target)
    with Checkpoint.open(str(target)) as c:
        ref = next(r for k, r in c.tensors.items() if k.startswith("model.layers.1.") and k.endswith("weight_scale"))
        where, at = Path(ref.file), ref.offset
    with where.open("r+b") as f:
        f.seek(at)
        f.write(b"\x00" * len(struct.pack("<e", 0)))  # one FP8 / half scale byte pattern: zero
    ckpt("graft", build("deepseek_v3"), target, "-o", tmp_path / "refused", code=3)
    out = tmp_path / "out"
    ckpt("graft", build("deepseek_v3"), target, "-o", out, "--allow-invalid", "quant-scale-value")
    allowed = json.loads((out / "graft-report.json").read_text())["validation"]["allowed"]
    assert [a["key"] for a in allowed] == [ref.key], allowed
