"""`ckpt probe` measures only a verifier loaded as stored (issue 24, item 1).

transformers 5.24 has no quantizer for ModelOpt (``quant_method: modelopt``): it logs "Unknown
quantization type ... skip the quantization", loads the F8_E4M3 codes as values and drops every
``weight_scale``; its MtpModel ignores unexpected keys. probe used to report depth-1 agreement
0.0625 (KL 2.74) for the ModelOpt FP8 copy of the tiny trained verifier, whose bf16 original
agrees at 1.0. Now the trunk and MTP are dequantized by our decoders (and the report says so),
and whatever neither transformers nor a decoder loads as stored is refused (exit 3, probe-load).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
import probe_quantized  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools.errors import InputError  # noqa: E402
from ckpt_tools.io.checkpoint import Checkpoint  # noqa: E402
from ckpt_tools.model.quant import detect_scheme  # noqa: E402
from ckpt_tools.ops.probe import load as probe_load  # noqa: E402
from ckpt_tools.ops.probe import state as probe_state  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEQUANTIZED = "dequantized by ckpt-tools (modelopt-fp8)"


@pytest.fixture(scope="module")
def trained() -> Path:
    d, _ = probe_model.build(CACHE)
    return d


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return probe_model.write_prompts(tmp_path_factory.mktemp("prompts"), 4, 6, seed=7)


@pytest.fixture(scope="module")
def modelopt(trained, tmp_path_factory) -> Path:
    return probe_quantized.modelopt_fp8(trained, tmp_path_factory.mktemp("modelopt") / "fp8")


def probe_json(verifier, prompts, code: int = 0):
    r = ckpt("probe", verifier, "--prompts", prompts, "--max-new-tokens", 16, "--json", code=code)
    return json.loads(r.stdout) if code == 0 else r


def test_transformers_skips_modelopt_and_probe_sees_it(modelopt):
    """What transformers does with the ModelOpt config (the reason for all this): no quantizer, FP8 codes loaded
    as values, every weight_scale unexpected. probe asks transformers' own quantizer mapping, not its log text."""
    config = transformers.AutoConfig.from_pretrained(modelopt)
    assert config.quantization_config["quant_method"] == "modelopt"
    assert probe_load.transformers_quantizer(config) is None and probe_load.declared_quantization(config)
    with probe_load.captured_warnings() as said:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(modelopt, output_loading_info=True)
    assert getattr(model, "hf_quantizer", None) is None
    assert "model.layers.0.self_attn.q_a_proj.weight_scale" in info["unexpected_keys"]
    assert any("Unknown quantization type" in s and "skip the quantization" in s for s in said)


def test_modelopt_fp8_verifier_measures_like_the_original(trained, modelopt, prompts):
    """(a) the unscaled load is not what is measured, (b) the dequantized one agrees like the original.

    Threshold: per-tensor e4m3 keeps 3 mantissa bits (relative error <= 2**-4 per weight), which moves a
    logit by a few percent; the tiny verifier's greedy tokens are confident (the original agrees at 1.0), so
    the FP8 copy must agree within 0.1 of it. The unscaled load measured 0.0625, far outside."""
    base = probe_json(trained, prompts)
    fp8 = probe_json(modelopt, prompts)
    [b], [q] = base["drafts"], fp8["drafts"]
    print(f"bf16 verifier: agreement {b['agreement']} kl {b['kl']}; ModelOpt FP8 ({fp8['loaded']}): "
          f"agreement {q['agreement']} kl {q['kl']}")
    assert base["loaded"] == "as stored by transformers" and base["mtp_loaded"] == probe_load.MTP_AS_STORED
    assert fp8["loaded"] == fp8["mtp_loaded"] == DEQUANTIZED
    assert b["agreement"][0] >= 0.8 and abs(q["agreement"][0] - b["agreement"][0]) <= 0.1
    assert q["kl"][0] < 0.25 and q["greedy_equal"] is True


def test_compressed_tensors_fp8_trunk_loads_as_stored_and_its_mtp_is_dequantized(trained, prompts, tmp_path):
    """transformers' compressed-tensors quantizer loads an FP8_DYNAMIC trunk on CPU (every tensor used: checked);
    MtpModel.from_pretrained applies no quantizer, so the MTP layer is dequantized by our ct-fp8 decoder."""
    ct = probe_quantized.ct_fp8_dynamic(trained, tmp_path / "ct")
    assert probe_load.transformers_quantizer(transformers.AutoConfig.from_pretrained(ct)) == "compressed-tensors"
    out = probe_json(ct, prompts)
    [q] = out["drafts"]
    print(f"compressed-tensors FP8_DYNAMIC ({out['loaded']}; MTP {out['mtp_loaded']}): "
          f"agreement {q['agreement']} kl {q['kl']}")
    assert out["loaded"] == "as stored by transformers (quantizer compressed-tensors)"
    assert out["mtp_loaded"] == "dequantized by ckpt-tools (ct-fp8)"
    assert q["agreement"][0] >= 0.9 and q["kl"][0] < 0.25 and q["greedy_equal"] is True


def test_a_tensor_no_decoder_reads_is_refused(modelopt, prompts, tmp_path):
    """(c) an integer tensor no decoder can read (it looks like compressed-tensors int8 codes, but has no scale):
    refused before anything loads, naming it."""
    key = "model.layers.5.mlp.extra.weight"
    bad = probe_quantized.add_tensor(modelopt, tmp_path / "bad", key, torch.ones(4, 4, dtype=torch.int8))
    r = probe_json(bad, prompts, code=3)
    assert "[probe-load]" in r.output and key.removesuffix(".weight") in r.output and "missing" in r.output
    assert r.stdout == ""


@pytest.mark.parametrize("key", ["model.layers.0.self_attn.stray.weight", "model.layers.61.stray.weight"])
def test_an_unexpected_tensor_is_refused(trained, prompts, tmp_path, key):
    """(c) a float tensor no parameter takes, in the trunk or under the MTP prefix (which DeepSeek-V3's
    ``_keys_to_ignore_on_load_unexpected`` and MtpModel.from_pretrained would both have ignored)."""
    bad = probe_quantized.add_tensor(trained, tmp_path / "bad", key, torch.zeros(4, 4))
    r = probe_json(bad, prompts, code=3)
    # the MTP layer's key is named as transformers renamed it (layers.0.mtp_block.stray.weight)
    assert "[probe-load]" in r.output and "unexpected" in r.output and "stray.weight" in r.output
    assert r.stdout == ""


def test_a_missing_scale_is_refused(modelopt, tmp_path):
    """A quantized module without its weight_scale is not decoded with a guessed scale."""
    with Checkpoint.open(modelopt) as c:
        tensors = probe_load.stored_tensors(c)
        scheme = detect_scheme(c)
    del tensors["model.layers.0.self_attn.o_proj.weight_scale"]
    with pytest.raises(InputError) as e:
        probe_state.float_state(tensors, scheme, "fp32", str(modelopt))
    assert e.value.rule == "probe-load" and "o_proj" in e.value.message


def test_dequantized_values_are_the_scaled_codes(modelopt):
    """The decoder's values are code * weight_scale (float32), not the codes transformers loaded."""
    from safetensors import safe_open

    key = "model.layers.0.self_attn.q_a_proj"
    with Checkpoint.open(modelopt) as c:
        state, schemes = probe_state.float_state(probe_load.stored_tensors(c), detect_scheme(c), "fp32")
        got = probe_state.materialize(state[f"{key}.weight"])
        f = str(Path(modelopt) / c.tensors[f"{key}.weight"].file)  # file: the shard name, or its path
    assert schemes == ["modelopt-fp8"] and f"{key}.weight_scale" not in state
    with safe_open(f, "pt") as s:
        want = s.get_tensor(f"{key}.weight").float() * s.get_tensor(f"{key}.weight_scale").float()
    assert got.dtype == torch.float32 and torch.equal(got, want)


REAL = REPO / "fixtures" / "producers" / "modelopt-fp8"


@pytest.mark.skipif(not REAL.is_dir(), reason="the real ModelOpt export is not in this tree")
def test_the_real_modelopt_export_is_read_as_transformers_cannot():
    """ModelOpt 0.47's own FP8 export: transformers has no quantizer for it; our decoders read every tensor."""
    assert probe_load.transformers_quantizer(transformers.AutoConfig.from_pretrained(REAL)) is None
    with Checkpoint.open(REAL) as c:
        state, schemes = probe_state.float_state(probe_load.stored_tensors(c), detect_scheme(c), "bf16")
    assert schemes == ["modelopt-fp8"] and all(t.dtype in ("BF16", "F32") for t in state.values())
