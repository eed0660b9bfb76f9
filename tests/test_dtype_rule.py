"""Table facts from release listings (issue 24 item 8): the stored-dtype rule (MiMo-V2's BF16
attention_sink_bias), ERNIE-4.5-300B's transposed mtp_linear_proj, Hy3's layer without shared_head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import run_ckpt

SINK = "model.mtp.layers.1.self_attn.attention_sink_bias"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return dst


def _shard_of(ckpt: Path, key: str) -> Path:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        return ckpt / json.loads(index.read_text())["weight_map"][key]
    return ckpt / "model.safetensors"


def _rewrite(ckpt: Path, key: str, change) -> Path:
    """``key`` replaced by ``change(tensor)`` in its shard, the index's total_size kept true."""
    shard = _shard_of(ckpt, key)
    with safe_open(shard, "pt") as f:
        meta = f.metadata()
    state = load_file(shard)
    old = state[key]
    state[key] = change(old).contiguous()
    save_file(state, shard, metadata=meta)
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        new = state[key]
        data["metadata"]["total_size"] += new.numel() * new.element_size() - old.numel() * old.element_size()
        index.write_text(json.dumps(data))
    return shard


def _dtypes(path: Path) -> dict[str, str]:
    out = {}
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            out.update({k: str(h.get_slice(k).get_dtype()) for k in h.keys()})  # noqa: SIM118
    return out


# -- stored-dtype: MiMo-V2 attention_sink_bias is BF16 ------------------------------------------------------


def test_mimo_v2_fixture_stores_sinks_bf16_and_validates(make_fixture):
    src = make_fixture("mimo_v2")
    dtypes = _dtypes(src)
    sinks = {k: d for k, d in dtypes.items() if k.endswith("attention_sink_bias")}
    assert sinks and set(sinks.values()) == {"BF16"}
    assert any(k.startswith("model.mtp.") for k in sinks) and any(k.startswith("model.layers.") for k in sinks)
    report = json.loads(run_ckpt("validate", src, "--json").output)
    assert report["ok"], report["problems"]


def test_sink_stored_f32_fails_validate_naming_file_key_and_rule(make_fixture, tmp_path):
    src = _copy(make_fixture("mimo_v2"), tmp_path / "f32sink")
    shard = _rewrite(src, SINK, lambda t: t.float())
    result = run_ckpt("validate", src, "--json", code=1)
    report = json.loads(result.output)
    found = [p for p in report["problems"] if p["rule"] == "stored-dtype"]
    assert [(p["key"], Path(p["path"]).name) for p in found] == [(SINK, shard.name)]
    assert "F32" in found[0]["message"] and "BF16" in found[0]["message"]
    assert {p["rule"] for p in report["problems"]} == {"stored-dtype"}
    text = run_ckpt("validate", src, code=1).output
    assert "stored-dtype" in text and SINK in text

    # the gate refuses it in every verb (exit 3, rule named), and --allow-invalid stored-dtype proceeds
    refused = run_ckpt("extract", src, "-o", tmp_path / "out", code=3).output
    assert "stored-dtype" in refused and SINK in refused
    run_ckpt("extract", src, "-o", tmp_path / "out", "--allow-invalid", "stored-dtype")


def test_trunk_sink_is_checked_too(make_fixture, tmp_path):
    src = _copy(make_fixture("mimo_v2"), tmp_path / "trunk")
    key = "model.layers.1.self_attn.attention_sink_bias"
    _rewrite(src, key, lambda t: t.half())
    report = json.loads(run_ckpt("validate", src, "--json", code=1).output)
    assert [(p["rule"], p["key"]) for p in report["problems"]] == [("stored-dtype", key)]


def test_unfixed_dtypes_are_not_checked(make_fixture, tmp_path):
    """dtype without dtype_fixed only says what fixtures write: a BF16 router bias is still valid."""
    src = _copy(make_fixture("deepseek_v3"), tmp_path / "bf16bias")
    _rewrite(src, "model.layers.3.mlp.gate.e_score_correction_bias", lambda t: t.bfloat16())
    assert json.loads(run_ckpt("validate", src, "--json").output)["ok"]


def test_extract_dtype_keeps_fixed_dtypes_and_says_so(make_fixture, tmp_path):
    src = make_fixture("mimo_v2")
    report = json.loads(run_ckpt("extract", src, "-o", tmp_path / "f32", "--dtype", "fp32", "--json").output)
    dtypes = _dtypes(tmp_path / "f32")
    sinks = {k for k in dtypes if k.endswith("attention_sink_bias")}
    assert sinks and {dtypes[k] for k in sinks} == {"BF16"}
    assert {d for k, d in dtypes.items() if k not in sinks} == {"F32"}
    assert report["kept_dtype"] == {k: "BF16" for k in sinks}
    run_ckpt("validate", tmp_path / "f32")


def test_init_draft_writes_fixed_dtypes_as_fixed(make_fixture, tmp_path):
    src = make_fixture("mimo_v2")
    run_ckpt("init-draft", src, "-o", tmp_path / "init", "--dtype", "fp32")
    dtypes = _dtypes(tmp_path / "init")
    sinks = [k for k in dtypes if k.endswith("attention_sink_bias")]
    assert sinks and {dtypes[k] for k in sinks} == {"BF16"}
    run_ckpt("validate", tmp_path / "init")


def test_dtype_fixed_needs_a_dtype():
    from pydantic import ValidationError

    from ckpt_tools.model.tables.schema import TensorDef

    assert TensorDef(key="a", shape=[1], dtype="BF16", dtype_fixed=True).dtype_fixed
    with pytest.raises(ValidationError, match="dtype_fixed needs a dtype"):
        TensorDef(key="a", shape=[1], dtype_fixed=True)


def test_transformers_loads_mimo_sinks_in_the_model_dtype():
    """Consumer evidence for BF16: transformers keeps only the router bias and gate in F32, not the sinks."""
    from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as m

    assert set(m.MiMoV2FlashPreTrainedModel._keep_in_fp32_modules_strict) == {"e_score_correction_bias",
                                                                              "mlp.gate.weight"}


# -- ERNIE-4.5-300B-A47B-PT: mtp_linear_proj stored transposed does not load --------------------------------


def test_ernie_transposed_mtp_linear_proj_is_misshaped(make_fixture, tmp_path):
    """baidu/ERNIE-4.5-300B-A47B-PT shipped model.mtp_linear_proj.0.weight as [2H, H] (sglang PR #7657);
    vLLM and SGLang load [H, 2H] through a shape-asserting loader, so the table keeps [H, 2H] and validate
    names the transposition."""
    src = _copy(make_fixture("ernie4_5_moe"), tmp_path / "ernie")
    key = "model.mtp_linear_proj.0.weight"
    before = load_file(_shard_of(src, key))[key].shape
    assert before[1] == 2 * before[0]
    _rewrite(src, key, lambda t: t.t())
    report = json.loads(run_ckpt("validate", src, "--json", code=1).output)
    found = [(p["rule"], p["key"]) for p in report["problems"]]
    assert found == [("mtp-misshaped", key)]
    assert "stored transposed" in report["problems"][0]["message"]
    refused = run_ckpt("extract", src, "-o", tmp_path / "out", code=3).output
    assert "mtp-misshaped" in refused and key in refused


def test_misshaped_but_not_transposed_says_nothing_of_transposition(make_fixture, tmp_path):
    src = _copy(make_fixture("ernie4_5_moe"), tmp_path / "ernie")
    key = "model.mtp_linear_proj.0.weight"
    _rewrite(src, key, lambda t: t[:, :-2])
    report = json.loads(run_ckpt("validate", src, "--json", code=1).output)
    assert [p["rule"] for p in report["problems"]] == ["mtp-misshaped"]
    assert "transposed" not in report["problems"][0]["message"]


# -- Hy3: the release ships no layer-N shared_head / embed_tokens -------------------------------------------


def test_hy3_release_layout_validates_without_problems(make_fixture):
    """The release layout (no shared_head.*, no per-layer embed_tokens) is valid; the copy is only a note."""
    src = make_fixture("hy_v3", with_optional=False)
    keys = _dtypes(src)
    assert not [k for k in keys if k.startswith("model.layers.3.") and ("shared_head" in k or "embed_tokens" in k)]
    report = json.loads(run_ckpt("validate", src, "--json").output)
    assert report["ok"], report["problems"]
    assert keys["model.layers.3.mlp.expert_bias"] == "F32"


def test_graft_and_stitch_keep_fixed_dtypes(make_fixture, tmp_path):
    """graft --mtp-dtype fp32 and stitch --dtype draft cast float MTP values, but not a dtype the release fixes."""
    full = make_fixture("mimo_v2")
    trunk, grafted = tmp_path / "trunk", tmp_path / "grafted"
    run_ckpt("extract", full, "-o", trunk, "--drop-mtp")
    run_ckpt("graft", full, trunk, "-o", grafted, "--mtp-dtype", "fp32")
    dtypes = _dtypes(grafted)
    assert dtypes[SINK] == "BF16" and dtypes["model.mtp.layers.1.eh_proj.weight"] == "F32"
    run_ckpt("validate", grafted)

    draft, kept = tmp_path / "draft", tmp_path / "kept"
    run_ckpt("extract", full, "-o", draft, "--dtype", "fp32")
    _rewrite(draft, SINK, lambda t: t.float())  # a draft trained in F32 throughout
    run_ckpt("stitch", draft, full, "-o", kept, "--dtype", "draft")
    dtypes = _dtypes(kept)
    assert dtypes[SINK] == "BF16" and dtypes["model.mtp.layers.1.eh_proj.weight"] == "F32"
    run_ckpt("validate", kept)


# -- a dtype the table pins, kept by every verb on every option (issue 40, class 11) -----------------------------

PRODUCERS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
BASE = PRODUCERS / "transformers-deepseek_v3"  # transformers' own save: the router bias F32, the rest BF16
BIAS = "model.layers.2.mlp.gate.e_score_correction_bias"  # deepseek_v3.yaml: dtype: F32


def _pinned_case(case: str, tmp_path: Path) -> tuple[Path, dict]:
    """Run one verb with one dtype option over the real producers' checkpoints; (its output, its --json)."""
    out = tmp_path / "out"
    if case == "graft --mtp-dtype":  # a source whose config says float32: the model dtype is the pin's
        src = _copy(BASE, tmp_path / "src")
        config = json.loads((src / "config.json").read_text())
        config["dtype"] = "float32"
        (src / "config.json").write_text(json.dumps(config))
        args = ["graft", src, PRODUCERS / "modelopt-fp8", "-o", out, "--mtp-dtype", "bf16"]
    elif case == "extract --dtype":
        args = ["extract", BASE, "-o", out, "--dtype", "bf16"]
    elif case == "extract --dequant --dtype":
        grafted = tmp_path / "grafted"
        run_ckpt("graft", BASE, PRODUCERS / "modelopt-fp8", "-o", grafted)
        args = ["extract", grafted, "-o", out, "--dequant", "bf16", "--dtype", "fp16"]
    elif case == "init-draft --dtype":
        args = ["init-draft", BASE, "-o", out, "--dtype", "bf16"]
    elif case == "stitch --dtype draft":  # a draft trained in BF16 throughout, its bias included
        draft = tmp_path / "draft"
        run_ckpt("extract", BASE, "-o", draft)
        _rewrite(draft, BIAS, lambda t: t.bfloat16())
        args = ["stitch", draft, BASE, "-o", out, "--dtype", "draft"]
    else:  # dequant --dtype
        grafted = tmp_path / "grafted"
        run_ckpt("graft", BASE, PRODUCERS / "modelopt-fp8", "-o", grafted)
        args = ["dequant", grafted, "-o", out, "--dtype", "bf16"]
    return out, json.loads(run_ckpt(*args, "--json").stdout)


@pytest.mark.parametrize("case", ["graft --mtp-dtype", "extract --dtype", "extract --dequant --dtype",
                                  "init-draft --dtype", "stitch --dtype draft", "dequant --dtype"])
def test_a_pinned_dtype_is_kept_by_every_verb_on_every_option(case, tmp_path):
    out, report = _pinned_case(case, tmp_path)
    dtypes = _dtypes(out)
    assert dtypes[BIAS] == "F32", (case, dtypes[BIAS])  # transformers keeps it F32 strictly, vLLM builds it F32
    asked = "F16" if "--dequant" in case else "BF16"
    assert asked in {d for k, d in dtypes.items() if k != BIAS}  # the option took effect on the rest
    if case.startswith("extract"):
        assert report["kept_dtype"] == {BIAS: "F32"}  # and says what it kept
    run_ckpt("validate", out)
