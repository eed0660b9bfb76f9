"""`ckpt extract --format gguf`: the MTP sidecar llama.cpp loads beside a trunk GGUF, read back with gguf.GGUFReader.

Names, shapes and types are those llama.cpp's converter gives (experts stacked, MLA's kv_b_proj split, norms,
1-D tensors and routers F32); values equal the source's (exactly in F32, to F16 rounding in F16, Q8_0 bytes
equal to gguf.quants' quantizer); metadata and vocabulary come from the trunk. A trunk that does not match is
refused with exit 3 before anything is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.testing import make_checkpoint
from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

ROOT = Path(__file__).resolve().parent.parent


def _ckpt(tmp_path_factory, family: str, **kw) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp(family)
    src = make_checkpoint(family, d / "src", **kw)
    trunk = write_trunk_gguf(src, d / "trunk.gguf")
    return src, trunk


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return _ckpt(tmp_path_factory, "glm4_moe")


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    return _ckpt(tmp_path_factory, "deepseek_v3")


def _extract(src, trunk, out, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ckpt_tools", "extract", str(src), "--format", "gguf", "--gguf-trunk", str(trunk),
           "-o", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def _read(out: Path):
    files = sorted(out.glob("mtp-*.gguf"))
    assert len(files) == 1, list(out.iterdir())
    return gguf.GGUFReader(files[0])


def _tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def _source(src: Path, key: str) -> np.ndarray:
    from ckpt_tools.arrays import decode_floats

    with Checkpoint.open(src) as ck:
        ref = ck.tensors[key]
        return decode_floats(bytearray(ref.read()), ref.dtype).astype(np.float32).reshape(ref.shape)


def _values(t) -> np.ndarray:
    shape = tuple(reversed(t.shape.tolist()))
    if t.tensor_type.name in ("F32", "F16"):
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)


GLM_MTP = {"blk.3.nextn." + n for n in ("eh_proj.weight", "embed_tokens.weight", "enorm.weight", "hnorm.weight",
                                        "shared_head_head.weight", "shared_head_norm.weight")}


def test_glm_sidecar_layout_metadata_and_f32_values(glm, tmp_path):
    src, trunk = glm
    r = _extract(src, trunk, tmp_path / "out", "--gguf-type", "f32")
    assert r.returncode == 0, r.stderr
    reader = _read(tmp_path / "out")
    fields = reader.fields
    assert fields["general.architecture"].contents() == "glm4moe"
    assert fields["glm4moe.block_count"].contents() == 4  # 3 trunk layers + 1 MTP
    assert fields["glm4moe.nextn_predict_layers"].contents() == 1
    trunk_reader = gguf.GGUFReader(trunk)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.model", "tokenizer.ggml.pre", "glm4moe.embedding_length",
                "glm4moe.expert_count", "general.name"):
        assert fields[key].contents() == trunk_reader.fields[key].contents(), key
    ts = _tensors(reader)
    assert set(ts) >= GLM_MTP
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= set(ts)
    # nothing of the trunk's own layers
    assert not [n for n in ts if n.startswith(("blk.0.", "blk.1.", "blk.2."))]
    exps = ts["blk.3.ffn_gate_exps.weight"]
    assert tuple(reversed(exps.shape.tolist())) == (4, 32, 64)  # [experts, moe_inter, hidden], stacked
    want = np.stack([_source(src, f"model.layers.3.mlp.experts.{e}.gate_proj.weight") for e in range(4)])
    np.testing.assert_array_equal(_values(exps), want)
    np.testing.assert_array_equal(_values(ts["blk.3.nextn.eh_proj.weight"]),
                                  _source(src, "model.layers.3.eh_proj.weight"))
    np.testing.assert_array_equal(_values(ts["blk.3.exp_probs_b.bias"]),
                                  _source(src, "model.layers.3.mlp.gate.e_score_correction_bias"))
    np.testing.assert_array_equal(_values(ts["token_embd.weight"]), _source(src, "model.embed_tokens.weight"))
    assert all(t.tensor_type.name == "F32" for t in ts.values())
    manifest = json.loads((tmp_path / "out" / "ckpt_manifest.json").read_text())
    assert manifest["kind"] == "mtp-gguf-sidecar" and manifest["llama_cpp_arch"] == "glm4moe"
    assert set(manifest["tensor_blake3"]) == set(ts)


def test_glm_sidecar_f16_types_as_llama_cpp_converter(glm, tmp_path):
    src, trunk = glm
    r = _extract(src, trunk, tmp_path / "out")  # default: f16
    assert r.returncode == 0, r.stderr
    ts = _tensors(_read(tmp_path / "out"))
    types = {n: t.tensor_type.name for n, t in ts.items()}
    # the converter keeps norms, 1-D tensors, biases and the router F32; every other matrix F16
    for n in ("blk.3.nextn.enorm.weight", "blk.3.attn_norm.weight", "blk.3.attn_q.bias", "blk.3.ffn_gate_inp.weight",
              "blk.3.exp_probs_b.bias", "output_norm.weight", "blk.3.attn_q_norm.weight"):
        assert types[n] == "F32", n
    for n in ("blk.3.nextn.eh_proj.weight", "blk.3.ffn_down_exps.weight", "token_embd.weight", "output.weight",
              "blk.3.attn_q.weight"):
        assert types[n] == "F16", n
    src_v = _source(src, "model.layers.3.self_attn.o_proj.weight")
    np.testing.assert_array_equal(_values(ts["blk.3.attn_output.weight"]), src_v.astype(np.float16).astype(np.float32))
    assert (tmp_path / "out").joinpath("ckpt_manifest.json").is_file()


def test_deepseek_v3_sidecar_splits_kv_b_and_q8_0_bytes_equal_gguf_quants(dsv3, tmp_path):
    src, trunk = dsv3
    r = _extract(src, trunk, tmp_path / "out", "--gguf-type", "q8_0")
    assert r.returncode == 0, r.stderr
    reader = _read(tmp_path / "out")
    assert reader.fields["general.architecture"].contents() == "deepseek2"
    assert reader.fields["deepseek2.nextn_predict_layers"].contents() == 1
    ts = _tensors(reader)
    assert set(ts) >= GLM_MTP
    assert "blk.3.attn_kv_b.weight" not in ts
    kv_b = _source(src, "model.layers.3.self_attn.kv_b_proj.weight").reshape(4, 8 + 8, 16)  # heads, nope+v, rank
    k_b, v_b = ts["blk.3.attn_k_b.weight"], ts["blk.3.attn_v_b.weight"]
    assert tuple(reversed(k_b.shape.tolist())) == (4, 16, 8)  # per head transposed: [heads, kv_lora, nope]
    assert tuple(reversed(v_b.shape.tolist())) == (4, 8, 16)
    # rows of 8 do not split into Q8_0 blocks of 32: F16, as the converter falls back
    assert k_b.tensor_type.name == "F16"
    np.testing.assert_array_equal(_values(k_b), kv_b[:, :8, :].transpose(0, 2, 1).astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(_values(v_b), kv_b[:, 8:, :].astype(np.float16).astype(np.float32))
    eh = ts["blk.3.nextn.eh_proj.weight"]
    assert eh.tensor_type.name == "Q8_0"
    want = gguf.quants.quantize(_source(src, "model.layers.3.eh_proj.weight"), gguf.GGMLQuantizationType.Q8_0)
    assert bytes(np.asarray(eh.data)) == want.tobytes()
    down = ts["blk.3.ffn_down_exps.weight"]
    stacked = np.stack([_source(src, f"model.layers.3.mlp.experts.{e}.down_proj.weight") for e in range(4)])
    assert bytes(np.asarray(down.data)) == gguf.quants.quantize(stacked, gguf.GGMLQuantizationType.Q8_0).tobytes()


def test_quantized_source_is_decoded_as_extract_dequant_decodes(tmp_path_factory, tmp_path):
    from ckpt_tools.api.writing import extract

    src, trunk = _ckpt(tmp_path_factory, "deepseek_v3", fp8=True)
    with Checkpoint.open(src) as ck:
        assert ck.tensors["model.layers.3.self_attn.q_a_proj.weight"].dtype == "F8_E4M3"
    r = _extract(src, trunk, tmp_path / "out", "--gguf-type", "f32")
    assert r.returncode == 0, r.stderr
    ts = _tensors(_read(tmp_path / "out"))
    extract(src, tmp_path / "native", dequant="fp32")
    with Checkpoint.open(tmp_path / "native") as ck:
        native = {k: ref.numpy() for k, ref in ck.tensors.items() if ref.dtype == "F32"}
    np.testing.assert_array_equal(_values(ts["blk.3.attn_q_a.weight"]),
                                  native["model.layers.3.self_attn.q_a_proj.weight"])
    stacked = np.stack([native[f"model.layers.3.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
    np.testing.assert_array_equal(_values(ts["blk.3.ffn_up_exps.weight"]), stacked)


@pytest.mark.parametrize("key,value,named", [
    ("glm4moe.embedding_length", 128, "trunk 128, source hidden = 64"),
    ("glm4moe.block_count", 5, "trunk 5, source num_layers = 3"),
    ("glm4moe.expert_count", 8, "trunk 8, source experts = 4"),
    ("glm4moe.attention.head_count", 8, "trunk 8, source heads = 4"),
    ("glm4moe.vocab_size", 300, "trunk 300, source vocab = 256"),
    ("glm4moe.attention.head_count", [8, 8, 8], "no trunk layer has heads = 4"),  # per layer (as Step-3.5's)
])
def test_mismatched_trunk_is_refused_and_nothing_written(glm, tmp_path, key, value, named):
    src, _ = glm
    bad = write_trunk_gguf(src, tmp_path / "bad.gguf", overrides={key: value})
    r = _extract(src, bad, tmp_path / "out")
    assert r.returncode == 3, r.stderr
    assert named in r.stderr and "gguf-trunk-mismatch" in r.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_per_layer_head_count_holding_the_sources_heads_is_accepted(glm, tmp_path):
    """Step-3.5's trunks give heads per layer (its sliding layers have their own): the source's count must be some
    layer's, checked, not skipped."""
    src, _ = glm
    trunk = write_trunk_gguf(src, tmp_path / "t.gguf", overrides={"glm4moe.attention.head_count": [4, 8, 4]})
    r = _extract(src, trunk, tmp_path / "out")
    assert r.returncode == 0, r.stderr


def test_trunk_of_another_architecture_is_refused(glm, dsv3, tmp_path):
    src, _ = glm
    r = _extract(src, dsv3[1], tmp_path / "out")
    assert r.returncode == 3
    assert "trunk 'deepseek2'" in r.stderr and "'glm4moe'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_trunk_without_vocabulary_is_refused(glm, tmp_path):
    src, _ = glm
    bad = write_trunk_gguf(src, tmp_path / "novocab.gguf",
                           drop=("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
    r = _extract(src, bad, tmp_path / "out")
    assert r.returncode == 3 and "tokenizer" in r.stderr
    assert not (tmp_path / "out").exists()


def test_options_that_do_not_apply_are_usage_errors(glm, tmp_path):
    src, trunk = glm
    r = _extract(src, trunk, tmp_path / "out", "--dequant", "bf16")
    assert r.returncode == 2 and "--dequant" not in r.stdout
    r = _extract(src, trunk, tmp_path / "out", "--gguf-type", "q4_k")
    assert r.returncode == 2
    assert not (tmp_path / "out").exists()


def test_hf_source_fetches_only_the_mtp_and_shared_bytes(monkeypatch, tmp_path, tmp_path_factory):
    """From hf:// (the test Hub): the same sidecar as from the local copy, and the bytes fetched are the MTP
    layer's, the shared embedding / final norm / head and the headers, config and index."""
    from ckpt_tools.api.writing import extract_gguf

    from hubserver import serve_hub

    src, trunk = _ckpt(tmp_path_factory, "deepseek_v3", fp8=True)
    gen = serve_hub(monkeypatch, tmp_path)
    hub = next(gen)
    try:
        hub.state.add_repo("org/verifier", src)
        local = Path(extract_gguf(src, tmp_path / "local", trunk).path)
        hub.state.stats.reset()
        remote = Path(extract_gguf("hf://org/verifier", tmp_path / "remote", trunk).path)
        served = hub.state.stats.served
    finally:
        gen.close()
    assert local.read_bytes() == remote.read_bytes()
    with Checkpoint.open(src) as ck:
        from ckpt_tools.model.mtp import open_mtp

        view = open_mtp(ck)
        mtp = sum(ck.tensors[s.key].nbytes for s in view.present)
        scales = sum(ref.nbytes for k, ref in ck.tensors.items() if k.endswith("_scale_inv")
                     and k.startswith("model.layers.3."))
        shared = sum(ck.tensors[k].nbytes for k in ("model.embed_tokens.weight", "model.norm.weight",
                                                     "lm_head.weight"))
        # the headers, and the small files opening a checkpoint reads (config, index, generation / tokenizer config)
        meta = ck.header_bytes() + sum(f.stat().st_size for f in src.iterdir() if f.suffix != ".safetensors")
    assert mtp + shared <= served <= mtp + scales + shared + meta, (served, mtp, shared, meta)


def test_a_native_draft_goes_straight_to_a_sidecar_with_the_trunks_shared_tensors(glm, tmp_path):
    """A draft (MTP layers only, e.g. finetuned, in the verifier's names) has no embedding, final norm or head:
    the sidecar carries the trunk's own, byte for byte and in the trunk's type; its MTP tensors are the draft's."""
    from ckpt_tools.api.writing import extract

    src, trunk = glm
    extract(src, tmp_path / "draft")
    with Checkpoint.open(tmp_path / "draft") as ck:
        assert "model.embed_tokens.weight" not in ck.tensors
    r = _extract(tmp_path / "draft", trunk, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    ts = _tensors(_read(tmp_path / "out"))
    trunk_ts = _tensors(gguf.GGUFReader(trunk))
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        assert ts[name].tensor_type == trunk_ts[name].tensor_type  # F32 in this trunk, though the sidecar is F16
        assert np.asarray(ts[name].data).tobytes() == np.asarray(trunk_ts[name].data).tobytes()
    full = tmp_path / "full"
    assert _extract(src, trunk, full).returncode == 0
    full_ts = _tensors(_read(full))
    assert sorted(ts) == sorted(full_ts)
    for name, t in full_ts.items():
        if name.startswith("blk."):
            assert np.asarray(ts[name].data).tobytes() == np.asarray(t.data).tobytes(), name
    manifest = json.loads((tmp_path / "out" / "ckpt_manifest.json").read_text())
    assert manifest["tensors"]["token_embd.weight"]["from_trunk"] is True


def test_a_family_without_a_llama_cpp_section_is_refused(glm, tmp_path):
    from ckpt_tools.model.tables.loader import all_tables

    family = next(n for n, t in sorted(all_tables().items()) if t.kind == "mtp" and t.llama_cpp is None)
    src = make_checkpoint(family, tmp_path / "src")
    r = _extract(src, glm[1], tmp_path / "out")
    assert r.returncode == 3 and "gguf-family" in r.stderr and family in r.stderr
    assert not (tmp_path / "out").exists()


def test_mimo_flash_mtp_q_k_v_are_joined_into_attn_qkv(tmp_path):
    """MiMo-V2-Flash keeps its MTP q / k / v apart; llama.cpp's mimo2 MTP graph drafts only with attn_qkv (its
    converter does not join them, and llama.cpp aborts on that sidecar): ours holds attn_qkv, their rows end to
    end, and no attn_q / attn_k / attn_v in the MTP blocks."""
    src = make_checkpoint("mimo_v2", tmp_path / "src")
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf")
    assert _extract(src, trunk, tmp_path / "out", "--gguf-type", "f32").returncode == 0
    ts = _tensors(_read(tmp_path / "out"))
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for i in range(3):
        base = f"model.mtp.layers.{i}.self_attn."
        whole = np.concatenate([_source(src, f"{base}{p}_proj.weight") for p in "qkv"], axis=0)
        assert np.asarray(ts[f"blk.{layers + i}.attn_qkv.weight"].data).tobytes() == whole.astype(np.float32).tobytes()
        assert not {f"blk.{layers + i}.attn_{p}.weight" for p in "qkv"} & set(ts)


def test_qwen4_exp_eh_proj_is_its_two_projections_side_by_side_and_the_indexer_split_by_rows(tmp_path, monkeypatch):
    """Qwen4-Exp has no [H, 2H] fusion: llama.cpp's eh_proj is [fc_embedding | fc_hidden] (each row both rows side
    by side, its converter's torch.cat dim 1), read a band of rows at a time; the QSA indexer's index_qk_proj is
    split by rows into indexer q ([heads * dim] rows) and k (the rest), its layernorms + 1 as every norm."""
    from ckpt_tools.api.writing import extract_gguf
    from ckpt_tools.ops.draft import gguf_sidecar

    monkeypatch.setattr(gguf_sidecar, "BAND_BYTES", 5 * 2 * 64 * 2)  # 5 rows of both parts (bf16): 13 bands
    src = make_checkpoint("qwen4_exp", tmp_path / "src")
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf")
    ts = _tensors(gguf.GGUFReader(extract_gguf(src, tmp_path / "out", trunk, gguf_type="f32").path))
    blk = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    eh = np.concatenate([_source(src, "mtp.fc_embedding.weight"), _source(src, "mtp.fc_hidden.weight")], axis=1)
    assert _values(ts[f"blk.{blk}.nextn.eh_proj.weight"]).tobytes() == eh.tobytes()
    qk = _source(src, "mtp.layers.0.self_attn.indexer.index_qk_proj.weight")
    assert _values(ts[f"blk.{blk}.indexer.q_proj.weight"]).tobytes() == qk[:2 * 16].tobytes()
    assert _values(ts[f"blk.{blk}.indexer.k_proj.weight"]).tobytes() == qk[2 * 16:].tobytes()
    norm = _source(src, "mtp.layers.0.self_attn.indexer.q_layernorm.weight") + np.float32(1)
    assert _values(ts[f"blk.{blk}.indexer.q_norm.weight"]).tobytes() == norm.tobytes()
    assert {f"blk.{blk}.hc_attn_inject.weight", f"blk.{blk}.nextn.hc_head_down.weight"} <= set(ts)


def test_qwen4_exp_without_the_qsa_indexer_is_refused(glm, tmp_path):
    """llama.cpp's qwen4exp graph has no path without QSA (its loader requires the indexer keys and tensors): a
    source whose config sets no indexer_n_heads (vLLM builds its MTP layer without an indexer) is refused, exit 3
    naming the rule and the config key, and nothing is written."""
    src = make_checkpoint("qwen4_exp", tmp_path / "src", config_overrides={"indexer_n_heads": None})
    r = _extract(src, glm[1], tmp_path / "out")
    assert r.returncode == 3 and "[gguf-family]" in r.stderr, r.stderr
    assert "qwen4exp graph requires idx_heads" in r.stderr and "(indexer_n_heads)" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ratios", [[0, 4, 128, 4], [0, 4, 128, 4, 0]])
def test_deepseek_v4_e_and_h_proj_side_by_side_and_hc_head_at_the_root(tmp_path, ratios):
    """DeepSeek-V4's MTP fuses two [H, H] projections; llama.cpp's deepseek4 graph takes one eh_proj [H, 2H]
    whose rows are e_proj's then h_proj's (its converter's torch.cat dim 1); the MTP's hc_head goes to the file's
    root (output_hc_*), which its MTP graph reads; compress_ratios gets the MTP layer's 0 (sliding attention)
    unless the trunk's already lists it, as the release config does."""
    src = make_checkpoint("deepseek_v4", tmp_path / "src", with_optional=False)
    key = "deepseek4.attention.compress_ratios"
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf", overrides={key: ratios})
    assert _extract(src, trunk, tmp_path / "out", "--gguf-type", "f32").returncode == 0
    r = _read(tmp_path / "out")
    ts = _tensors(r)
    e, h = _source(src, "mtp.0.e_proj.weight"), _source(src, "mtp.0.h_proj.weight")
    whole = gguf.quants.quantize(np.concatenate([e, h], axis=1), gguf.GGMLQuantizationType.Q8_0)  # the converter's
    assert np.asarray(ts["blk.4.nextn.eh_proj.weight"].data).tobytes() == whole.tobytes()
    for part in ("fn", "base", "scale"):
        root = np.asarray(ts[f"output_hc_{part}.weight"].data)
        assert root.tobytes() == _source(src, f"mtp.0.hc_head_{part}").tobytes()
    assert not [n for n in ts if ".e_proj" in n or ".h_proj" in n or "hc_head" in n]
    assert list(r.fields[key].contents()) == [0, 4, 128, 4, 0]


def test_deepseek_v4_fp4_experts_go_out_as_mxfp4_bit_for_bit(tmp_path):
    """The release's routed experts (FP4 e2m1 codes, an E8M0 scale per 32) go out as MXFP4 whatever the output
    type, their codes and scales moved, not quantized again (llama.cpp's converter repacks them): also a block
    whose largest code is below 4 (gguf's quantizer would pick a smaller exponent) and -0 codes (it would write 0).
    Its FP8 weights go out as Q8_0, the file type is MXFP4_MOE (llama_cpp.types, file_type)."""
    import torch
    from safetensors.torch import load_file, save_file

    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    src = make_quantized_checkpoint("deepseek_v4", tmp_path / "src", QuantOptions("fp8-ue8m0-fp4-experts"))
    [shard] = [f for f in src.glob("*.safetensors") if "mtp.0.ffn.experts.0.w1.weight" in load_file(f)]
    state = load_file(shard)
    small = state["mtp.0.ffn.experts.0.w1.weight"].view(torch.uint8) & 0x33  # every code of expert 0 below 2.0
    small[0, :2] = 0x88  # and -0 codes
    state["mtp.0.ffn.experts.0.w1.weight"] = small.view(torch.int8)
    save_file(state, shard, metadata={"format": "pt"})
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf", tensors=False)
    assert _extract(src, trunk, tmp_path / "out", "--gguf-type", "f32").returncode == 0
    r = _read(tmp_path / "out")
    ts = _tensors(r)
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    assert ts["blk.4.attn_q_a.weight"].tensor_type.name == "Q8_0"
    with Checkpoint.open(src) as ck:  # ggml's block_mxfp4: the exponent, then byte j: code j low, code j + 16 high
        codes, scales = (np.stack([np.frombuffer(ck.tensors[f"mtp.0.ffn.experts.{x}.w1.{k}"].read(), np.uint8)
                                   for x in range(4)]) for k in ("weight", "scale"))
    c = np.stack([codes & 15, codes >> 4], -1).reshape(*scales.shape, 32)
    want = np.concatenate([scales[..., None], c[..., :16] | (c[..., 16:] << 4)], axis=-1)
    t = ts["blk.4.ffn_gate_exps.weight"]
    assert t.tensor_type.name == "MXFP4" and np.asarray(t.data).tobytes() == want.tobytes()


def test_bf16_to_f16_bands_are_numpys_cast_bit_for_bit():
    """A bf16 tensor's F16 bytes come from integer arithmetic and a lookup (numpy's cast is element-wise, slow):
    they must be what llama.cpp's converter writes (bf16 -> f32 -> numpy astype) for every bf16 bit pattern
    (F16 subnormals, overflow, Inf, NaN payloads included), in any order, over more than one piece."""
    import numpy as np

    from ckpt_tools.ops.draft.gguf_sidecar import _bf16_to_f16, _f16_of_bf16

    bits = np.arange(65536, dtype=np.uint32).astype("<u2")
    bits = np.concatenate([bits, np.random.default_rng(0).permutation(bits), bits[:12345]])  # pieces, one short
    with np.errstate(over="ignore", invalid="ignore"):
        cast = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float16).tobytes()
    assert _bf16_to_f16()[bits].tobytes() == cast
    assert _f16_of_bf16(bytearray(bits.tobytes())).tobytes() == cast


def test_the_output_policy_of_every_writer_holds(glm, tmp_path):
    """-o is never an input (the source's directory would get our manifest), an existing output needs --overwrite
    (exit 4 as for every writer), and --overwrite leaves exactly what the new run writes: the sidecar of the earlier
    type is gone, a user's own file stays."""
    src, trunk = glm
    inside = _extract(src, trunk, src)
    assert inside.returncode == 2 and "[output-overlaps-input]" in inside.stderr, inside.stderr
    beside_trunk = _extract(src, trunk, trunk.parent)
    assert beside_trunk.returncode == 2 and "[output-overlaps-input]" in beside_trunk.stderr

    out = tmp_path / "out"
    assert _extract(src, trunk, out, "--gguf-type", "q8_0").returncode == 0
    (out / "notes.txt").write_text("mine")
    again = _extract(src, trunk, out, "--gguf-type", "f16")
    assert again.returncode == 4 and "--overwrite" in again.stderr, again.stderr
    assert _extract(src, trunk, out, "--gguf-type", "f16", "--overwrite").returncode == 0
    names = sorted(p.name for p in out.iterdir())
    assert [n for n in names if n.endswith(".gguf")] == [n for n in names if n.endswith("-F16.gguf")] != []
    assert "notes.txt" in names and "ckpt_manifest.json" in names
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    assert sorted(manifest["written"]) == sorted(n for n in names if n not in ("notes.txt",))
