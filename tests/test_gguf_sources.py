"""`ckpt extract SRC --format gguf` from every SRC extract reads (issue 41): a draft in each format, every quantization
scheme we decode, and remote sources (hf://, s3://).

- A draft is read back as its verifier's MTP layers (model/formats/reverse.py): the sidecar from a draft in each
  format its family supports equals, byte for byte, the sidecar from the verifier it was extracted from; so do real
  speculators drafts (speculators' own converter, fixtures/producers/). A draft whose config disagrees with the trunk
  is refused (exit 3, both values named) before anything is written. Tensors the draft format drops: the shared
  embedding / final norm / head come from the trunk (llama.cpp's loader requires token_embd and output_norm), the
  per-layer embed / head copies are left out (llama.cpp does not require them and falls back on the same shared
  tensors, as SGLang and AngelSpec do).
- A quantized source gives the sidecar of its dequantized twin (`ckpt dequant --dtype fp32`), byte for byte: no scale
  lands in the GGUF.
- From hf:// or s3://, the bytes fetched are the draft's tensors the sidecar holds, the headers and the side files.
The verifiers here ship no per-layer embed / head copies (``with_optional=False``), so that the verifier's sidecar
holds what every draft format can give back.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ckpt_tools.api.writing import dequant, extract, extract_gguf
from ckpt_tools.arrays import decode_floats
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.testing import make_checkpoint
from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

from conftest import run_ckpt

ROOT = Path(__file__).resolve().parent.parent
PRODUCERS = ROOT / "fixtures" / "producers"
# every family llama.cpp serves or converts that we cover, with the draft formats that can express it
FORMATS = {"glm4_moe": ("native", "sglang-nextn"), "deepseek_v3": ("native", "sglang-nextn"),
           "qwen3_next": ("native", "speculators"), "hy_v3": ("native", "angelspec")}


def _write(src, out: Path, trunk: Path, **kw) -> Path:
    return Path(extract_gguf(src, out, trunk, **kw).path)


def _sidecar(src, out: Path, trunk: Path, **kw) -> bytes:
    return _write(src, out, trunk, **kw).read_bytes()


def _tensors(data_or_path) -> dict[str, tuple[str, bytes]]:
    reader = gguf.GGUFReader(data_or_path)
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in reader.tensors}


@pytest.fixture(scope="module")
def verifiers(tmp_path_factory) -> dict[str, tuple[Path, Path, bytes]]:
    """family -> (verifier, its trunk GGUF as the converter's --outtype f16 writes it, the verifier's sidecar)"""
    out = {}
    for family in FORMATS:
        d = tmp_path_factory.mktemp(family)
        src = make_checkpoint(family, d / "src", with_optional=False)
        trunk = write_trunk_gguf(src, d / "trunk.gguf", gguf_type="f16")
        out[family] = (src, trunk, _sidecar(src, d / "sidecar", trunk))
    return out


def _refused(src, trunk, out, *args: str) -> str:
    """The CLI run in-process: exit 3, and its message."""
    r = run_ckpt("extract", src, "--format", "gguf", "--gguf-trunk", trunk, "-o", out, *args, code=3)
    return r.output + r.stderr


@pytest.mark.parametrize("family,fmt", [(f, x) for f, xs in FORMATS.items() for x in xs])
def test_a_draft_in_each_format_gives_the_verifiers_sidecar(verifiers, tmp_path, family, fmt):
    src, trunk, want = verifiers[family]
    extract(src, tmp_path / "draft", format=fmt)
    assert _sidecar(tmp_path / "draft", tmp_path / "out", trunk) == want


@pytest.mark.parametrize("producer,verifier", [("speculators-qwen3_next", "transformers-qwen3_next"),
                                               ("speculators-qwen3_5_moe", "transformers-qwen3_5_moe"),
                                               ("speculators-qwen3_5", "transformers-qwen3_5")])
def test_a_real_speculators_draft_gives_its_verifiers_sidecar(tmp_path, producer, verifier):
    """speculators' own converter output (fused experts, its text config, a NaN placeholder head never read)."""
    trunk = write_trunk_gguf(PRODUCERS / verifier, tmp_path / "trunk.gguf", gguf_type="f16")
    want = _sidecar(PRODUCERS / verifier, tmp_path / "v", trunk)
    assert _sidecar(PRODUCERS / producer, tmp_path / "d", trunk) == want


def test_a_draft_with_a_wrapper_prefix_and_no_manifest_is_read_as_stitch_reads_it(tmp_path):
    """speculators' draft saved from a wrapped module (``module.``): the prefix stripped, the family from its
    config's evidence (no ckpt_manifest.json), the verifier's sidecar."""
    from safetensors.torch import load_file, save_file

    producer, verifier = PRODUCERS / "speculators-qwen3_next", PRODUCERS / "transformers-qwen3_next"
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_bytes((producer / "config.json").read_bytes())
    state = load_file(producer / "model.safetensors")
    save_file({f"module.{k}": v for k, v in state.items()}, draft / "model.safetensors", metadata={"format": "pt"})
    trunk = write_trunk_gguf(verifier, tmp_path / "trunk.gguf", gguf_type="f16")
    assert _sidecar(draft, tmp_path / "d", trunk) == _sidecar(verifier, tmp_path / "v", trunk)


def test_a_trained_angelspec_draft_goes_to_llama_cpps_names(tmp_path):
    """AngelSpec's exported draft (trained: every MTP tensor differs from the verifier's; its config names no
    family, so --arch): its own values under llama.cpp's names, experts [E, H, I] turned to [E, I, H]; its
    embedding (a frozen copy) is the sidecar's; a trainer's step folder (no config.json) is refused."""
    draft = PRODUCERS / "angelspec-bin-hy_v3"
    trunk = write_trunk_gguf(PRODUCERS / "transformers-hy_v3", tmp_path / "trunk.gguf", gguf_type="f16")
    ts = _tensors(_write(draft, tmp_path / "out", trunk, arch="hy_v3", gguf_type="f32"))
    with Checkpoint.open(draft) as ck:
        def value(key):
            ref = ck.tensors[key]
            return decode_floats(bytearray(ref.read()), ref.dtype).astype(np.float32).reshape(ref.shape)

        gate = value("midlayer.mlp.experts_gate_proj")
        assert ts["blk.2.ffn_gate_exps.weight"][1] == np.ascontiguousarray(gate.transpose(0, 2, 1)).tobytes()
        assert ts["blk.2.nextn.eh_proj.weight"][1] == value("eh_proj.weight").tobytes()
        assert ts["token_embd.weight"][1] == value("embed_tokens.weight").tobytes()
    assert "[no-config]" in _refused(PRODUCERS / "angelspec-dcp-hy_v3" / "iter_0000001", trunk, tmp_path / "dcp",
                                     "--arch", "hy_v3")
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("family,fmt,override,named", [
    ("glm4_moe", "sglang-nextn", {"hidden_size": 128}, "trunk 64, source hidden = 128"),
    ("qwen3_next", "speculators", {"num_experts": 8}, "trunk 4, source experts = 8"),
    ("deepseek_v3", "native", {"vocab_size": 320}, "trunk 256, source vocab = 320"),
])
def test_a_draft_that_disagrees_with_the_trunk_is_refused_before_writing(verifiers, tmp_path, family, fmt, override,
                                                                        named):
    trunk = verifiers[family][1]
    other = make_checkpoint(family, tmp_path / "other", with_optional=False, config_overrides=override)
    extract(other, tmp_path / "draft", format=fmt)
    message = _refused(tmp_path / "draft", trunk, tmp_path / "out")
    assert named in message and "[gguf-trunk-mismatch]" in message, message
    assert not (tmp_path / "out").exists()


def test_what_a_format_drops_comes_from_the_trunk_or_is_left_to_llama_cpp(tmp_path):
    """An SGLang NextN draft of a verifier with per-layer embed / head copies: the sidecar is the verifier's but for
    those copies (llama.cpp falls back on token_embd / output, the trunk's); a trunk without the shared tensors the
    draft lacks is refused, naming the key and the rule."""
    src = make_checkpoint("glm4_moe", tmp_path / "src")
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf", gguf_type="f16")
    want = _tensors(_write(src, tmp_path / "v", trunk))
    extract(src, tmp_path / "draft", format="sglang-nextn")
    got = _tensors(_write(tmp_path / "draft", tmp_path / "d", trunk))
    assert set(want) - set(got) == {"blk.3.nextn.embed_tokens.weight", "blk.3.nextn.shared_head_head.weight"}
    assert all(got[k] == want[k] for k in got)
    bare = write_trunk_gguf(src, tmp_path / "bare.gguf", tensors=False)
    message = _refused(tmp_path / "draft", bare, tmp_path / "out")
    assert "[mtp-missing]" in message and "model.embed_tokens.weight" in message, message
    assert not (tmp_path / "out").exists()


# the schemes testing/quantized.py builds; group-128 ones quantize no module of the tiny fixtures' widths, and the
# fused shards they leave unquantized are refused by every verb's gate (mtp-quant-config): their group-32 twins stand in
GATED = {"ct-w4a16", "ct-w4a16-asym", "ct-w8a16"}


def _schemes() -> list[str]:
    from ckpt_tools.testing.quantized import SCHEMES

    return [s for s in SCHEMES if s not in GATED]


@pytest.mark.parametrize("scheme", _schemes())
def test_a_quantized_source_gives_its_dequantized_twins_sidecar(tmp_path_factory, scheme):
    pytest.importorskip("compressed_tensors")
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    d = tmp_path_factory.mktemp(scheme)
    src = make_quantized_checkpoint("deepseek_v3", d / "src", QuantOptions(scheme))
    trunk = write_trunk_gguf(src, d / "trunk.gguf", gguf_type="f16")
    dequant(src, d / "twin", dtype="fp32")
    ours = _write(src, d / "out", trunk)
    assert ours.read_bytes() == _sidecar(d / "twin", d / "twin-out", trunk)
    assert not [n for n in _tensors(ours) if "scale" in n or "packed" in n]


def test_a_quantized_draft_gives_the_quantized_verifiers_sidecar(tmp_path):
    """Block FP8 kept by a native and an SGLang NextN draft (weights and scales renamed together), decoded as from the
    verifier; a speculators draft needs --dequant, and fp32 decodes to the same values."""
    src = make_checkpoint("deepseek_v3", tmp_path / "src", with_optional=False, fp8=True)
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf", gguf_type="f16")
    want = _sidecar(src, tmp_path / "v", trunk)
    for fmt in ("native", "sglang-nextn"):
        extract(src, tmp_path / fmt, format=fmt)
        with Checkpoint.open(tmp_path / fmt) as ck:
            assert any(k.endswith("_scale_inv") for k in ck.tensors)
        assert _sidecar(tmp_path / fmt, tmp_path / f"{fmt}-out", trunk) == want, fmt


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-fp8-channel"])
def test_a_native_draft_of_a_non_block_scheme_gives_the_verifiers_sidecar(tmp_path, scheme):
    """The sidecar decodes a draft's weights by their own codec (packed NVFP4, per-channel FP8), not as block FP8."""
    pytest.importorskip("compressed_tensors")
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    src = make_quantized_checkpoint("deepseek_v3", tmp_path / "src", QuantOptions(scheme))
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf", gguf_type="f16")
    extract(src, tmp_path / "native", format="native")
    assert _sidecar(tmp_path / "native", tmp_path / "d", trunk) == _sidecar(src, tmp_path / "v", trunk)


def test_a_draft_on_the_hub_fetches_only_what_the_sidecar_holds(verifiers, monkeypatch, tmp_path):
    """A real speculators draft from hf:// (the test Hub): the sidecar is the local one, and the bytes served are its
    MTP tensors, the headers and the side files: never the placeholder head the format ignores."""
    from hubserver import serve_hub

    draft = PRODUCERS / "speculators-qwen3_next"
    trunk = write_trunk_gguf(PRODUCERS / "transformers-qwen3_next", tmp_path / "trunk.gguf", gguf_type="f16")
    gen = serve_hub(monkeypatch, tmp_path)
    hub = next(gen)
    try:
        hub.state.add_repo("org/draft", draft)
        hub.state.stats.reset()
        remote = _sidecar("hf://org/draft", tmp_path / "remote", trunk)
        served = hub.state.stats.served
    finally:
        gen.close()
    assert remote == _sidecar(draft, tmp_path / "local", trunk)
    with Checkpoint.open(draft) as ck:
        placeholder = ck.tensors["verifier_lm_head.weight"].nbytes
        mtp = sum(ref.nbytes for k, ref in ck.tensors.items()) - placeholder
        meta = ck.header_bytes() + sum(f.stat().st_size for f in draft.iterdir() if f.suffix != ".safetensors")
    assert mtp <= served <= mtp + meta, (served, mtp, meta, placeholder)


def test_an_object_store_draft_gives_the_local_sidecar(verifiers, tmp_path):
    """An SGLang NextN draft of block-FP8 DeepSeek-V3 on s3:// (the test server): the same sidecar as from the local
    copy, with the draft's tensors (weights and scales) and the headers downloaded, nothing more."""
    pytest.importorskip("moto")
    from s3server import S3Server

    src = make_checkpoint("deepseek_v3", tmp_path / "src", with_optional=False, fp8=True)
    trunk = write_trunk_gguf(src, tmp_path / "trunk.gguf", gguf_type="f16")
    extract(src, tmp_path / "draft", format="sglang-nextn")
    server = S3Server().start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env().items():
                mp.setenv(k, v)
            client = server.client()
            client.create_bucket(Bucket="drafts")
            for p in sorted((tmp_path / "draft").iterdir()):
                client.upload_file(str(p), "drafts", f"d/{p.name}")
            server.stats.reset()
            remote = _sidecar("s3://drafts/d", tmp_path / "remote", trunk)
            downloaded = server.stats.downloaded
    finally:
        server.stop()
    assert remote == _sidecar(tmp_path / "draft", tmp_path / "local", trunk)
    with Checkpoint.open(tmp_path / "draft") as ck:
        tensors = sum(ref.nbytes for ref in ck.tensors.values())
        meta = ck.header_bytes() + sum(f.stat().st_size for f in (tmp_path / "draft").iterdir()
                                       if f.suffix != ".safetensors")
    assert tensors <= downloaded <= tensors + meta, (downloaded, tensors, meta)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "qwen3_next", "nemotron_h", "bailing_moe_v3", "hy_v3"])
def test_the_f32_sidecar_decodes_back_to_the_checkpoints_own_mtp_values(family, tmp_path):
    """probe --mtp-quant's GGUF rows undo every transform the sidecar applies (experts stacked, kv_b split,
    rotary row order, norm offset): in F32 the decoded MTP equals the checkpoint's, value for value."""
    import numpy as np

    from ckpt_tools.arrays import decode_floats
    from ckpt_tools.io.checkpoint import Checkpoint
    from ckpt_tools.ops.draft.gguf_sidecar import mtp_in_gguf
    from ckpt_tools.testing import make_checkpoint

    src = make_checkpoint(family, tmp_path / family, with_optional=False)  # per-layer copies: not MTP-only
    with Checkpoint.open(src) as ck:
        decoded = mtp_in_gguf(ck, "f32")
        assert len(decoded) > 5
        for key, ([t], _) in decoded.items():
            ref = ck.tensors[key]
            want = decode_floats(ref.read(), ref.dtype).astype(np.float32).reshape(ref.shape)
            got = np.frombuffer(b"".join(bytes(c) for c in t.recipe.produce()), dtype=np.float32).reshape(t.shape)
            np.testing.assert_array_equal(got, want, err_msg=key)
