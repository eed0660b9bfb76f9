"""`ckpt dequant`: a whole checkpoint (or its MTP layers) from a quantization scheme to a float dtype.

Oracles: block FP8 by its definition (``quant_helpers.fp8_dequant``, plain torch); the real llm-compressor
outputs of fixtures/producers/ decompressed by compressed-tensors' own compressors; transformers loading the
output. Unquantized tensors are the source's bytes; decoding on several threads writes the same bytes as one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_ckpt
from quant_helpers import dequant_array, dequant_stream, same_bits
from quant_helpers import tensors_of as _tensors

ROOT = Path(__file__).resolve().parent.parent
PRODUCERS = ROOT / "fixtures" / "producers"
MTP = "model.layers.3."  # the deepseek_v3 fixture's MTP layer


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _loads_in_transformers(path: Path, unexpected_prefix: str | None) -> None:
    """transformers builds the model from the output with every weight it expects (MTP keys aside)."""
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    stray = [k for k in info["unexpected_keys"] if unexpected_prefix is None or not k.startswith(unexpected_prefix)]
    assert not stray, stray[:5]


def test_fp8_block_deepseek_layout_every_weight_is_the_definition(make_fixture, tmp_path):
    from quant_helpers import fp8_dequant

    src = make_fixture("deepseek_v3", fp8=True)
    run_ckpt("dequant", src, "-o", tmp_path / "out")
    state, out = _tensors(src), _tensors(tmp_path / "out")
    scales = [k for k in state if k.endswith(".weight_scale_inv")]
    assert len(scales) > 40
    for s in scales:
        w = s.removesuffix("_scale_inv")
        assert s not in out
        assert same_bits(out.pop(w), fp8_dequant(state[w], state[s], dtype=torch.bfloat16)), w
    for k, v in out.items():  # everything else: the source's bytes
        assert same_bits(v, state[k]), k
    assert set(out) == {k for k in state if not k.endswith(".weight_scale_inv")} - {s[:-10] for s in scales}
    cfg = _config(tmp_path / "out")
    assert "quantization_config" not in cfg and cfg.get("torch_dtype", "bfloat16") == "bfloat16"
    manifest = json.loads((tmp_path / "out" / "ckpt_manifest.json").read_text())
    assert manifest["kind"] == "dequantized" and manifest["modules"] == len(scales)
    run_ckpt("validate", tmp_path / "out")
    _loads_in_transformers(tmp_path / "out", MTP)


def _ct_reference(path: Path) -> dict[str, torch.Tensor]:
    """module -> weight as compressed-tensors' own compressor decompresses it (the config's one group)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(_config(path)["quantization_config"])
    (scheme,) = qc.config_groups.values()
    comp = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    state = _tensors(path)
    modules = {k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")}
    out = {}
    for m in modules:
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == m}
        out[m] = comp.decompress(local, scheme)["weight"]
    return out


@pytest.mark.parametrize("fixture", ["llmcompressor-nvfp4a16", "llmcompressor-fp8-block",
                                     "llmcompressor-fp8-dynamic"])
def test_llm_compressor_output_equals_compressed_tensors_decompression(fixture, tmp_path):
    pytest.importorskip("compressed_tensors")
    src = PRODUCERS / fixture
    # the producer dropped the MTP layer the config still declares (see its catalogue entry)
    run_ckpt("dequant", src, "-o", tmp_path / "out", "--allow-invalid", "mtp-missing")
    state, out = _tensors(src), _tensors(tmp_path / "out")
    theirs = _ct_reference(src)
    assert len(theirs) > 20
    for m, w in theirs.items():
        assert same_bits(out.pop(f"{m}.weight"), w.to(torch.bfloat16)), m
    companions = {k for k in state if k.rpartition(".")[0] in theirs}
    for k, v in out.items():
        assert k not in companions
        assert same_bits(v, state[k]), k
    assert "quantization_config" not in _config(tmp_path / "out")
    _loads_in_transformers(tmp_path / "out", None)


def test_only_mtp_decodes_the_mtp_and_excludes_it_in_the_config(make_fixture, tmp_path):
    from quant_helpers import fp8_dequant

    src = make_fixture("deepseek_v3", fp8=True)
    run_ckpt("dequant", src, "-o", tmp_path / "out", "--only-mtp", "--dtype", "fp32")
    state, out = _tensors(src), _tensors(tmp_path / "out")
    mtp_scales = [k for k in state if k.startswith(MTP) and k.endswith(".weight_scale_inv")]
    assert len(mtp_scales) >= 10
    for s in mtp_scales:
        w = s.removesuffix("_scale_inv")
        assert s not in out and same_bits(out.pop(w), fp8_dequant(state[w], state[s], dtype=torch.float32)), w
    for k, v in out.items():  # the trunk stays FP8, its scales with it
        assert same_bits(v, state[k]), k
    assert any(v.dtype == torch.float8_e4m3fn for v in out.values())
    q = _config(tmp_path / "out")["quantization_config"]
    assert f"{MTP}self_attn.o_proj" in q["modules_to_not_convert"]
    assert not any(not m.startswith(MTP) for m in q["modules_to_not_convert"])
    run_ckpt("validate", tmp_path / "out")  # the audit (mtp-quant-config) agrees with the repaired config


@pytest.mark.parametrize("link", ["hardlink", "copy"])
def test_only_mtp_with_link_carries_the_shards_without_mtp_whole(make_fixture, tmp_path, link):
    """--link: shards holding no MTP tensor are carried whole (hard-linked: the same inode), the MTP layers go
    into new shards decoded, the same tensors as without --link; the output validates and its manifest verifies."""
    src = make_fixture("deepseek_v3", fp8=True)
    run_ckpt("dequant", src, "-o", tmp_path / "plain", "--only-mtp")
    out = tmp_path / "linked"
    r = run_ckpt("dequant", src, "-o", out, "--only-mtp", "--link", link, "--json")
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    without_mtp = sorted(set(wm.values()) - {f for k, f in wm.items() if k.startswith(MTP)})
    assert without_mtp and all((out / n).exists() for n in without_mtp)
    same_inode = [(out / n).stat().st_ino == (src / n).stat().st_ino for n in without_mtp]
    assert all(same_inode) if link == "hardlink" else not any(same_inode)
    assert all((out / n).read_bytes() == (src / n).read_bytes() for n in without_mtp)
    assert any(p.name.startswith("model-mtp") for p in out.glob("*.safetensors"))
    plain, linked = _tensors(tmp_path / "plain"), _tensors(out)
    assert sorted(plain) == sorted(linked) and all(same_bits(linked[k], v) for k, v in plain.items())
    assert _config(out) == _config(tmp_path / "plain")
    report = json.loads(r.stdout)
    assert report["link"] == link and report["linked_shards"] == len(without_mtp) and report["new_shards"]
    run_ckpt("validate", out)
    run_ckpt("verify-manifest", out)


def test_link_needs_only_mtp_and_a_known_mode(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3", fp8=True)
    r = run_ckpt("dequant", src, "-o", tmp_path / "a", "--link", "hardlink", code=2)
    assert "--only-mtp" in r.output and not (tmp_path / "a").exists()
    r = run_ckpt("dequant", src, "-o", tmp_path / "b", "--only-mtp", "--link", "symlink", code=2)
    assert not (tmp_path / "b").exists()
    r = run_ckpt("dequant", src, "-o", tmp_path / "c", "--only-mtp", "--link", "remote", code=2)
    assert "hf://" in r.output and not (tmp_path / "c").exists()


def test_refusals_name_their_rule(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3", fp8=True)
    r = run_ckpt("dequant", make_fixture("deepseek_v3"), "-o", tmp_path / "a", code=3)
    assert "not-quantized" in r.output and not (tmp_path / "a").exists()

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    for f in src.iterdir():
        (unknown / f.name).write_bytes(f.read_bytes())
    cfg = _config(unknown)
    cfg["quantization_config"] = {"quant_method": "no-such-method"}
    (unknown / "config.json").write_text(json.dumps(cfg))
    r = run_ckpt("dequant", unknown, "-o", tmp_path / "b", code=3)
    assert "quant-unknown" in r.output and not (tmp_path / "b").exists()

    r = run_ckpt("dequant", src, "-o", tmp_path / "c", "--dtype", "int8", code=2)
    assert not (tmp_path / "c").exists()
    r = run_ckpt("dequant", src, "-o", tmp_path / "d", "--threads", "0", code=2)


def test_dry_run_writes_nothing_and_lists_the_modules(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3", fp8=True)
    r = run_ckpt("dequant", src, "--dry-run", "--json")
    plan = json.loads(r.stdout)
    assert plan["modules"] > 40 and plan["scheme"] == "fp8-block" and plan["still_quantized"] == 0


# -- decoding on several threads: the same bytes as one ----------------------------------------------------


def _stream(chunks) -> bytes:
    return b"".join(np.ascontiguousarray(c).tobytes() for c in chunks)


@pytest.mark.parametrize("threads", [2, 3])
def test_band_decoding_on_threads_equals_one_thread(threads):
    """Block FP8 (several tile rows, ragged edges, a stack) and NVFP4 (group tiles), streamed and whole."""
    from ckpt_tools.model.quant import decode
    from ckpt_tools.model.quant import decode_fp8 as fp8_decode
    from ckpt_tools.model.quant.schema import DecoderDef
    from ckpt_tools.model.quant.tables import get_scheme
    from ckpt_tools.parallel import use_threads

    rng = np.random.default_rng(0)
    shape, block = (3, 1100, 700), (128, 128)
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    scale = rng.random((3, 9, 6), dtype=np.float32) + 0.5

    def fp8_runs():
        data = memoryview(codes.tobytes())
        pos = [0]

        def read(n):
            pos[0] += n
            return data[pos[0] - n: pos[0]]

        streamed = _stream(dequant_stream(read, shape, "F8_E4M3", scale, "BF16", block))
        whole = dequant_array(codes, scale, block, "F8_E4M3", "BF16").tobytes()
        return streamed, whole

    fmt = next(f for f in get_scheme("ct-nvfp4").storage if f.name == "nvfp4")
    spec: DecoderDef = fmt.decoder
    rows, cols = 2100, 512
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    gscale = fp8_decode.TABLES["F8_E4M3"][rng.integers(0, 0x7E, size=(rows, cols // 16), dtype=np.uint8)]
    d = decode.Decoding(spec, "U8", (rows, cols), cols // 2, cols // 2, (1, 16), "BF16")

    def nvfp4_runs():
        dec = decode.BandDecoder(d, gscale, np.array([3.0], dtype=np.float32))
        data = memoryview(packed.tobytes())
        pos = [0]

        def read(n):
            pos[0] += n
            return data[pos[0] - n: pos[0]]

        streamed = _stream(decode.decode_stream(read, dec))
        whole = decode.decode_array(d, packed, gscale, np.array([3.0], dtype=np.float32)).tobytes()
        return streamed, whole

    with use_threads(1):
        one = fp8_runs() + nvfp4_runs()
    with use_threads(threads):
        many = fp8_runs() + nvfp4_runs()
    assert all(a == b for a, b in zip(one, many, strict=True))
    assert one[0] == one[1] and one[2] == one[3]


@pytest.mark.parametrize("verb", [["dequant"], ["extract", "--dequant", "bf16"],
                                  ["unfuse-experts", "--dequant", "bf16"]], ids=lambda v: v[0])
def test_output_is_the_same_on_one_and_two_threads(make_fixture, tmp_path, verb):
    src = make_fixture("deepseek_v3", fp8=True)
    for n in ("1", "2"):
        run_ckpt(verb[0], src, "-o", tmp_path / n, *verb[1:], "--threads", n)
    one, two = sorted((tmp_path / "1").glob("*.safetensors")), sorted((tmp_path / "2").glob("*.safetensors"))
    assert one and [p.name for p in one] == [p.name for p in two]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two, strict=True))


def _ahead_tensor(i: int, log: list, fail: bool = False, gate=None, nbytes: int = 8):
    from ckpt_tools.stream.plan import Compute, OutputTensor

    def produce():
        log.append(("start", i))
        if gate is not None:
            gate.wait(5)
        yield np.full(nbytes // 2, i, dtype=np.uint8)
        if fail:
            raise ValueError(f"tensor {i}")
        yield np.full(nbytes - nbytes // 2, i + 100, dtype=np.uint8)
        log.append(("done", i))
    return OutputTensor(f"t{i}", "U8", (nbytes,), Compute(produce, "dequant", ahead=True))


def test_lookahead_decodes_ahead_in_order_and_stops_cleanly():
    """Tensors decoded ahead on the pool give their own chunks in order, surface their errors when the writer
    reaches them, and a writer that stops early leaves no task running (those not started are cancelled)."""
    import threading

    from ckpt_tools.parallel import use_threads
    from ckpt_tools.stream.lookahead import lookahead
    from ckpt_tools.stream.plan import CopyBytes, OutputTensor

    log: list = []
    gate = threading.Event()
    copy = OutputTensor("c", "U8", (0,), CopyBytes([]))
    tensors = [_ahead_tensor(0, log), copy, _ahead_tensor(1, log), _ahead_tensor(2, log, fail=True),
               _ahead_tensor(3, log, gate=gate), *(_ahead_tensor(i, log) for i in range(4, 9))]
    with use_threads(2), lookahead(tensors, window=2) as ahead:
        assert _stream(ahead.chunks(0)) == bytes([0] * 4 + [100] * 4)
        assert ahead.chunks(1) is None  # a byte copy runs as usual
        assert _stream(ahead.chunks(2)) == bytes([1] * 4 + [101] * 4)
        with pytest.raises(ValueError, match="tensor 2"):
            _stream(ahead.chunks(3))
        gate.set()
    started = [i for what, i in log if what == "start"]
    done = {i for what, i in log if what == "done"}
    assert started[:3] == [0, 1, 2] and set(started) <= {0, 1, 2, 3, 4, 5}  # never more than the window ahead
    assert set(started) - {2} <= done  # closed: whatever started has finished, nothing still runs


def test_lookahead_keeps_at_most_window_tensors_and_budget_bytes():
    """While the writer waits on one tensor, at most ``window`` finished tensors (and ``budget`` bytes) are held;
    tensors above ``small`` bytes are not decoded ahead (they stream from their recipe)."""
    from ckpt_tools.parallel import use_threads
    from ckpt_tools.stream.lookahead import Lookahead

    log: list = []
    tensors = [_ahead_tensor(i, log) for i in range(10)]
    with use_threads(3), Lookahead(tensors, window=3) as ahead:
        for i in range(10):
            assert len(ahead._pending) <= 3
            assert _stream(ahead.chunks(i)) == bytes([i] * 4 + [i + 100] * 4)
    assert [i for what, i in log if what == "start"] == list(range(10))  # a window of 3 keeps start order
    log.clear()
    big = [_ahead_tensor(i, log, nbytes=64) for i in range(6)]
    with use_threads(2), Lookahead(big, window=4, budget=128, small=64) as ahead:
        first = ahead.chunks(0)
        assert ahead._held <= 128 and len(ahead._pending) == 2  # the budget, not the window, binds
        assert _stream(first) == bytes([0] * 32 + [100] * 32)
        for i in range(1, 6):
            assert _stream(ahead.chunks(i)) == bytes([i] * 32 + [i + 100] * 32)
    huge = [_ahead_tensor(0, log, nbytes=256)]
    with use_threads(2), Lookahead(huge, window=2, budget=128, small=64) as ahead:
        assert ahead.chunks(0) is None  # larger than ``small``: streamed by the writer

@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_failing_mid_stream_leaves_no_complete_looking_output(make_fixture, tmp_path, monkeypatch, threads):
    """A decoder error on a tensor decoded ahead (or streamed) reaches the caller; the output has no index,
    no manifest and no partial shard: nothing that looks complete."""
    from ckpt_tools import api
    from ckpt_tools.io.artefacts import MANIFEST_NAME
    from ckpt_tools.model.quant import decode_fp8 as fp8_decode

    src = make_fixture("deepseek_v3", fp8=True)
    calls = [0]
    real = fp8_decode.BandDequantizer.dequant

    def failing(self, codes, lead, r0, out):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("decoder broke")
        return real(self, codes, lead, r0, out)

    monkeypatch.setattr(fp8_decode.BandDequantizer, "dequant", failing)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="decoder broke"):
        api.dequant(src, out, threads=threads)
    left = {p.name for p in out.iterdir()} if out.exists() else set()
    assert "model.safetensors.index.json" not in left and MANIFEST_NAME not in left
    assert not [n for n in left if n.endswith(".partial")], left
    assert calls[0] >= 3


def test_output_is_the_same_on_one_two_and_three_threads_across_tensors(make_fixture, tmp_path):
    """The decoding pool across tensors (stream.lookahead) writes the bytes one thread writes, for any window."""
    from ckpt_tools import api

    src = make_fixture("deepseek_v3", fp8=True)
    for n in (1, 2, 3):
        api.dequant(src, tmp_path / str(n), threads=n)
    shards = [sorted((tmp_path / str(n)).glob("*.safetensors")) for n in (1, 2, 3)]
    assert shards[0] and all([p.name for p in s] == [p.name for p in shards[0]] for s in shards)
    for a, b, c in zip(*shards, strict=True):
        assert a.read_bytes() == b.read_bytes() == c.read_bytes()


def test_a_pool_task_never_waits_on_the_pool():
    """Work a pool task runs (and threads it starts, e.g. a prefetching reader) decodes inline: a task filling
    every worker cannot wait on a band queued behind it."""
    from ckpt_tools.io.prefetch import prefetched
    from ckpt_tools.parallel import in_pool, ordered_map, submit, use_threads

    def task():
        inner = list(prefetched(lambda: ordered_map(lambda x: (x, in_pool()), range(6), threads=2)))
        return in_pool(), inner

    with use_threads(2):
        futures = [submit(task, threads=2) for _ in range(4)]
        results = [f.result(timeout=30) for f in futures]
    assert not in_pool()
    assert all(flag and inner == [(x, True) for x in range(6)] for flag, inner in results)
