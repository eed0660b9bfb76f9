"""Every verb's quantized path works for every scheme, or its codec refuses it by name (model/quant/codec.py).

``diff --dequant`` compares a quantized weight of any scheme table's format by the values its codec decodes (not
only block FP8): a checkpoint against itself is unchanged everywhere (exit 0); one code byte changed stands out,
on that weight alone. Restacking experts stored in a format whose codec cannot restack is refused naming the codec.
"""

from __future__ import annotations

import json
import shutil

import pytest

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.quant.codec import CODECS
from ckpt_tools.model.quant.storage import module_storage
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

from conftest import run_ckpt as ckpt


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-fp8-channel", "ct-w4a16", "modelopt-nvfp4", "ct-mxfp4"])
def test_diff_dequant_compares_every_schemes_weights_by_value(tmp_path, scheme):
    a = make_quantized_checkpoint("qwen3_next", tmp_path / "a", QuantOptions(scheme=scheme))
    b = tmp_path / "b"
    shutil.copytree(a, b)
    c = Checkpoint.open(a)
    weights = {}
    for key in c.tensors:
        st = module_storage(c, None, key.rsplit(".", 1)[0])
        if st.quantized and st.all_keys()[0] == key:
            weights[key] = st
    assert weights, "the fixture has quantized weights"
    key = sorted(weights)[0]
    ref = c.tensors[key]
    with open(b / ref.file, "r+b") as f:  # another code in the weight's first byte (low and high nibble)
        f.seek(ref.segment().offset)
        byte = f.read(1)[0]
        f.seek(ref.segment().offset)
        f.write(bytes([byte ^ 0x11]))

    same = json.loads(ckpt("diff", a, a, "--dequant", "--json", code=0).output)  # the same values: no difference
    assert same["identical"] and same["totals"] == {"unchanged": len(c.tensors)}
    moved = json.loads(ckpt("diff", a, b, "--dequant", "--json", code=1).output)
    status = {t["key"]: t["status"] for t in moved["tensors"] if t["key"] in weights}
    assert {k for k, v in status.items() if v != "unchanged"} == {key}
    changed = {t["key"]: t["max_abs"] for t in moved["tensors"] if t["key"] in weights and t.get("max_abs")}
    assert set(changed) == {key}
    assert {t["key"]: t["dtype_a"] for t in moved["tensors"]}[key] == ref.dtype  # reported as stored


def test_every_table_encoder_is_a_registered_codec_with_its_capabilities():
    from ckpt_tools.model.quant.tables import all_schemes

    named = {f.encoder for t in all_schemes().values() for f in t.storage if f.encoder}
    assert named == set(CODECS)
    assert [n for n, c in CODECS.items() if c.keeps_bytes] == ["fp8-block"]
    assert all(c.encode is not None and c.layout is not None for c in CODECS.values())


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-fp8-channel"])
@pytest.mark.parametrize("dequant", [[], ["--dequant", "bf16"]])
def test_experts_the_codec_cannot_restack_are_refused_by_its_name(tmp_path, scheme, dequant):
    src = make_quantized_checkpoint("qwen3_next", tmp_path / "q", QuantOptions(scheme=scheme))
    out = ckpt("fuse-experts", src, "-o", tmp_path / "out", *dequant, code=3).output
    codec = scheme.removesuffix("-channel")
    assert "[expert-quant-scheme]" in out and f"whose codec ({codec}) cannot restack experts" in out
    assert not (tmp_path / "out").exists()


def test_a_codec_names_every_companion_of_its_format():
    """A bound codec's companions for a shape come from its table: NVFP4's group scale grid and global scale, a
    block format's one scale grid (a stacked experts name too), a packed integer format's scale and shape."""
    from ckpt_tools.model.quant.codec import Companion, checkpoint_codec, storage_codec
    from ckpt_tools.model.quant.storage import Storage

    nv = storage_codec(Storage("m.q", "quantized", "U8", "ct-nvfp4", "nvfp4", params={"group_size": 16}))
    assert nv.companions("m.q.weight_packed", (64, 128)) == [
        Companion("m.q.weight_scale", "scale", (64, 8)), Companion("m.q.weight_global_scale", "global_scale", ())]
    assert not nv.restacks and nv.name == "ct-nvfp4"
    pack = storage_codec(Storage("m.q", "quantized", "I32", "ct-pack", "int4",
                                 params={"strategy": "group", "group_size": 32, "num_bits": 4, "symmetric": True}))
    assert [(c.role, c.shape) for c in pack.companions("m.q.weight_packed", (64, 128))] == [
        ("scale", (64, 4)), ("shape", (2,))]
    block = checkpoint_codec(hint="fp8-block")
    assert block.restacks and block.keeps_bytes
    assert block.companions("m.q.weight", (300, 129)) == [Companion("m.q.weight_scale_inv", "scale", (3, 2))]
    assert block.companions("m.experts.down_proj", (4, 256, 128)) == [
        Companion("m.experts.down_proj_scale_inv", "scale", (4, 2, 1))]


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-fp8-channel"])
def test_init_draft_from_layer_of_a_non_block_scheme_is_dequantized_or_refused_by_its_codec(tmp_path, scheme):
    src = make_quantized_checkpoint("qwen3_next", tmp_path / "q", QuantOptions(scheme=scheme))
    out = ckpt("init-draft", src, "-o", tmp_path / "o", "--from-layer", "3", code=3).output
    codec = "ct-nvfp4" if scheme == "ct-nvfp4" else "ct-fp8"
    assert "[quant-capability]" in out and f"whose codec ({codec}) cannot copy a layer" in out
    assert "model.layers.3.self_attn.q_proj" in out and "--dequant" in out and not (tmp_path / "o").exists()
    # with --dequant the layer's modules are read in their own storage (its parameters, its companions) and
    # decoded: the draft's MTP weight is what `ckpt dequant` makes of the target's layer 3
    ckpt("init-draft", src, "-o", tmp_path / "o", "--from-layer", "3", "--dequant", "bf16")
    ckpt("dequant", src, "-o", tmp_path / "dq")
    draft, dq = Checkpoint.open(tmp_path / "o"), Checkpoint.open(tmp_path / "dq")
    key = "mtp.layers.0.self_attn.q_proj.weight"
    assert draft.tensors[key].dtype == "BF16"
    assert draft.tensors[key].read() == dq.tensors["model.layers.3.self_attn.q_proj.weight"].read()
