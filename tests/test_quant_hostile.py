"""Quantization state that cannot be true never passes (issue 32), on real producers' outputs.

G is ``graft transformers-deepseek_v3 llmcompressor-nvfp4a16 --mtp-quant ct-nvfp4`` and F the same graft into
llmcompressor-fp8-dynamic with ``--mtp-quant ct-fp8`` (fixtures/producers/). Each case edits a copy the way a
hostile user (or a broken tool) would: a byte of a scale, a tensor's shape in its header, an entry of the
quantization config, a shard after an interrupted run. Every case gives a refusal naming the rule (and the
tensor or entry), or a correct output; none exits 0 with a wrong result, none exits 5.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from ckpt_tools.io.checkpoint import Checkpoint

from conftest import run_ckpt as ckpt
from conftest import tree_hash

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
SOURCE = CORPUS / "transformers-deepseek_v3"
MTP = "model.layers.2."  # the DeepSeek-V3 fixture's MTP layer


@pytest.fixture(scope="module")
def grafted(tmp_path_factory):
    """``grafted(target, scheme)``: the quantizer output with the release's MTP written in ``scheme`` (cached)."""
    done: dict[tuple[str, str], Path] = {}

    def make(target: str, scheme: str) -> Path:
        if (target, scheme) not in done:
            out = tmp_path_factory.mktemp("graft") / f"{target}-{scheme}"
            ckpt("graft", SOURCE, CORPUS / target, "-o", out, "--mtp-quant", scheme)
            done[(target, scheme)] = out
        return done[(target, scheme)]

    return make


@pytest.fixture
def G(grafted, tmp_path) -> Path:  # noqa: N802 - the issue's name
    return copy(grafted("llmcompressor-nvfp4a16", "ct-nvfp4"), tmp_path / "G")


@pytest.fixture
def F(grafted, tmp_path) -> Path:  # noqa: N802
    return copy(grafted("llmcompressor-fp8-dynamic", "ct-fp8"), tmp_path / "F")


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def ref(path: Path, key: str):
    with Checkpoint.open(str(path)) as c:
        r = c.tensors[key]
        return Path(r.file), r.offset, r.dtype, tuple(r.shape), r.nbytes


def poke(path: Path, key: str, index: int, raw: bytes) -> None:
    """Overwrite element ``index`` (flat) of tensor ``key`` with ``raw`` (its bytes)."""
    file, offset, *_ = ref(path, key)
    with open(file, "r+b") as f:
        f.seek(offset + index * len(raw))
        f.write(raw)


def fill(path: Path, key: str, raw: bytes) -> None:
    """Every element of ``key`` set to ``raw``."""
    file, offset, _, _, nbytes = ref(path, key)
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(raw * (nbytes // len(raw)))


def reshape(path: Path, key: str, shape: list[int]) -> None:
    """Rewrite ``key``'s shape in its shard's header (same bytes, header padded to its length)."""
    file, *_ = ref(path, key)
    data = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header[key]["shape"] = shape
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    data[8:8 + n] = text + b" " * (n - len(text))
    file.write_bytes(bytes(data))


def problems(path: Path, code: int = 1) -> list[dict]:
    report = json.loads(ckpt("validate", path, "--json", code=code).stdout)
    return report["problems"]


def rules_of(path: Path, code: int = 1) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in problems(path, code):
        out.setdefault(p["rule"], []).append(p)
    return out


def refused(result, rule: str) -> str:
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 3, f"exit {result.exit_code}: {text}"
    assert f"[{rule}]" in text, text
    return text


def test_the_grafted_checkpoints_are_valid_as_made(G, F):
    assert problems(G, code=0) == [] and problems(F, code=0) == []


# -- 1. scales are values ----------------------------------------------------------------------------------------

E4M3_NAN = b"\x7f"
CASES = [  # (checkpoint, key, index, bytes, the value the message names)
    ("G", f"{MTP}self_attn.o_proj.weight_scale", 3, E4M3_NAN, "NaN"),
    ("G", f"{MTP}self_attn.o_proj.weight_scale", 0, b"\x00", "0.0"),
    ("G", f"{MTP}self_attn.o_proj.weight_scale", 5, b"\xb8", "-1.0"),  # a negative e4m3 scale
    ("G", f"{MTP}mlp.experts.1.up_proj.weight_global_scale", 0, struct.pack("<f", 0.0), "0.0"),
    ("G", f"{MTP}mlp.experts.1.up_proj.weight_global_scale", 0, struct.pack("<f", float("inf")), "inf"),
    ("G", "model.layers.0.mlp.down_proj.weight_global_scale", 0, struct.pack("<f", float("nan")), "NaN"),  # trunk
    ("F", f"{MTP}self_attn.o_proj.weight_scale", 7, struct.pack("<H", 0x7FC0), "NaN"),  # BF16 NaN
    ("F", "model.layers.1.mlp.shared_experts.down_proj.weight_scale", 2, struct.pack("<H", 0x0000), "0.0"),
]


@pytest.mark.parametrize(("which", "key", "index", "raw", "value"), CASES,
                         ids=[f"{c[0]}-{c[1].rsplit('.', 2)[-2]}-{c[4]}" for c in CASES])
def test_a_scale_that_is_not_a_value_is_invalid_for_validate_and_every_verb(request, which, key, index, raw, value,
                                                                            tmp_path):
    path = request.getfixturevalue(which)
    poke(path, key, index, raw)
    before = tree_hash(path)
    found = rules_of(path)["quant-scale-value"]
    assert [p["key"] for p in found] == [key], found
    shape = ref(path, key)[3]
    where = list(np.unravel_index(index, shape)) if shape else [index]
    assert f"value {value} at index {[int(i) for i in where]}" in found[0]["message"], found
    refused(ckpt("dequant", path, "-o", tmp_path / "d", code=None), "quant-scale-value")
    refused(ckpt("extract", path, "-o", tmp_path / "e", "--dequant", "bf16", code=None), "quant-scale-value")
    refused(ckpt("graft", path, CORPUS / "llmcompressor-nvfp4a16", "-o", tmp_path / "g", "--mtp-quant", "ct-nvfp4",
                 code=None), "quant-scale-value")
    assert not (tmp_path / "d").exists() and not (tmp_path / "g").exists()
    assert tree_hash(path) == before


def test_a_sparse_replica_has_zero_scales_and_is_invalid(G):
    """All-zero bytes (a sparse replica of a release): every scale is 0, none is special-cased."""
    with Checkpoint.open(str(G)) as c:
        keys = [k for k in c.tensors if k.endswith(("weight_scale", "weight_global_scale"))]
    for k in keys:
        fill(G, k, b"\x00")
    found = rules_of(G)["quant-scale-value"]
    assert len(found) == len(keys) and all("value 0.0 at index" in p["message"] for p in found)


def test_dequant_refuses_a_nan_code_in_the_weight_naming_tensor_and_index(F, tmp_path):
    key = f"{MTP}self_attn.o_proj.weight"
    poke(F, key, 70, E4M3_NAN)  # a NaN e4m3 code: the scales are fine, the decoded value is not
    cols = ref(F, key)[3][1]
    text = refused(ckpt("dequant", F, "-o", tmp_path / "d", code=None), "nonfinite")
    assert key in text and f"index [{70 // cols}, {70 % cols}]" in text and "NaN" in text
    assert not (tmp_path / "d" / "model.safetensors.index.json").exists()


def test_graft_refuses_a_source_with_nan_mtp(tmp_path):
    src = copy(SOURCE, tmp_path / "src")
    poke(src, f"{MTP}eh_proj.weight", 11, struct.pack("<H", 0x7FC0))
    for opt in (["--mtp-dtype", "bf16"], ["--mtp-quant", "ct-nvfp4"], []):
        out = tmp_path / f"o{len(opt)}{opt[-1] if opt else ''}"
        text = refused(ckpt("graft", src, CORPUS / "llmcompressor-nvfp4a16", "-o", out, *opt, code=None), "nonfinite")
        assert f"{MTP}eh_proj.weight" in text
        assert not out.exists()


def test_graft_from_a_source_with_a_zero_global_scale_is_refused(G, tmp_path):
    """The issue: such a source, re-encoded with --mtp-quant ct-nvfp4, wrote 167 NaN FP8 scales and exited 0."""
    poke(G, f"{MTP}self_attn.q_a_proj.weight_global_scale", 0, struct.pack("<f", 0.0))
    for opt in (["--mtp-quant", "ct-nvfp4"], ["--mtp-dtype", "bf16"]):
        refused(ckpt("graft", G, CORPUS / "llmcompressor-nvfp4a16", "-o", tmp_path / opt[0][2:], *opt, code=None),
                "quant-scale-value")


def test_the_modelopt_encoders_write_positive_scales_for_an_all_zero_weight():
    import torch

    from ckpt_tools.model.quant.encode import ENCODERS, EncodeArgs

    for name in ("modelopt-fp8", "modelopt-nvfp4", "ct-fp8", "ct-nvfp4"):
        out = ENCODERS[name](torch.zeros(32, 64, dtype=torch.bfloat16),
                             EncodeArgs(params={"algo": "FP8", "group_size": 16, "strategy": "tensor"}))
        for suffix, t in out.items():
            if "scale" in suffix:
                v = t.float()
                assert bool(torch.isfinite(v).all()) and bool((v > 0).all()), (name, suffix, v)


def test_probe_refuses_a_verifier_whose_mtp_scales_are_nan(F, tmp_path):
    pytest.importorskip("transformers")
    fill(F, f"{MTP}self_attn.o_proj.weight_scale", struct.pack("<H", 0x7FC0))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 17, 9]}) + "\n")
    refused(ckpt("probe", F, "--prompts", prompts, "--max-new-tokens", 2, "--json", code=None), "quant-scale-value")


def test_probe_numbers_refuse_a_null_or_nan_measurement():
    from ckpt_tools.errors import InputError
    from ckpt_tools.ops.probe_numbers import check_finite

    good = {"drafts": [{"name": "verifier", "agreement": [0.5], "kl": [0.1], "expected_accepted": 0.5,
                        "prompts": [{"kl": [0.1], "agreement": [0.5]}]}], "reference": {"max_abs_diff": 0.0}}
    check_finite(good)
    for bad in ({"kl": [float("nan")]}, {"kl": [None]}, {"agreement": [float("inf")]}):
        report = json.loads(json.dumps(good))
        report["drafts"][0].update(bad)
        with pytest.raises(InputError) as e:
            check_finite(report)
        assert e.value.rule == "probe-nonfinite" and "depth 1" in str(e.value)
    report = json.loads(json.dumps(good))
    report["drafts"][0]["prompts"][0]["kl"] = [float("nan")]
    with pytest.raises(InputError, match="prompt 1"):
        check_finite(report)


# -- 3. scale shapes are exact -------------------------------------------------------------------------------------


def test_a_transposed_per_channel_scale_is_invalid_and_the_message_prints_the_shape(F, tmp_path):
    key = f"{MTP}self_attn.o_proj.weight_scale"
    rows = ref(F, key)[3][0]
    reshape(F, key, [1, rows])
    found = [p for p in problems(F) if key in p["message"]]
    assert found, problems(F)
    msg = found[0]["message"]
    assert f"has shape [1, {rows}], expected [{rows}, 1]" in msg and "one scale per row" in msg, msg
    assert "if strategy" not in msg and "granularity" not in msg, msg  # the tile formula is not the expected shape
    text = refused(ckpt("dequant", F, "-o", tmp_path / "d", code=None), "mtp-misshaped")
    assert f"expected [{rows}, 1]" in text


# -- 5. --resume trusts only what it can prove ------------------------------------------------------------------


def _interrupt_after(monkeypatch, calls: int, what: str) -> None:
    import ckpt_tools.stream.writer as w

    orig, left = getattr(w, what), [calls]

    def interrupted(*a, **k):
        out = orig(*a, **k)
        left[0] -= 1
        if left[0] == 0:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(w, what, interrupted)


def _flip_tensor_byte(shard: Path) -> None:
    """Change one byte of the first tensor's data: same size, same header."""
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n] ^= 0xFF
    shard.write_bytes(bytes(data))


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors")
    assert names == sorted(p.name for p in b.iterdir() if p.suffix == ".safetensors")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


EXTRACT = ("extract", SOURCE, "--max-shard-size", "40KB")


def test_resume_rewrites_a_finished_shard_whose_bytes_changed_after_the_run_recorded_it(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    ckpt(EXTRACT[0], EXTRACT[1], "-o", ref, *EXTRACT[2:])
    ckpt(EXTRACT[0], EXTRACT[1], "-o", out, *EXTRACT[2:])
    (out / "model.safetensors.index.json").unlink()  # killed after the manifest, before the index
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2
    _flip_tensor_byte(shards[1])
    inodes = [p.stat().st_ino for p in shards]
    ckpt(EXTRACT[0], EXTRACT[1], "-o", out, *EXTRACT[2:], "--resume")
    _same_files(out, ref)
    after = [p.stat().st_ino for p in shards]
    assert after[1] != inodes[1], "the changed shard was reused"
    assert after[0] == inodes[0] and after[2:] == inodes[2:], "unchanged shards were rewritten"
    ckpt("verify-manifest", out)


def test_resume_after_an_interrupt_proves_each_finished_shard_by_its_journal(tmp_path, monkeypatch):
    ref, out = tmp_path / "ref", tmp_path / "out"
    ckpt(EXTRACT[0], EXTRACT[1], "-o", ref, *EXTRACT[2:])
    with monkeypatch.context() as m:
        _interrupt_after(m, 14, "copy_segment")
        ckpt(EXTRACT[0], EXTRACT[1], "-o", out, *EXTRACT[2:], code=130)
    finished = sorted(out.glob("*.safetensors"))
    assert len(finished) >= 2 and not (out / "ckpt_manifest.json").exists()
    journal = (out / ".ckpt-resume-journal.jsonl").read_text().splitlines()
    # a shard is journaled once the hashes of what landed are in (the interrupt may beat the last one's)
    journaled = {json.loads(line)["file"] for line in journal}
    assert journaled <= {p.name for p in finished} and finished[0].name in journaled
    _flip_tensor_byte(finished[0])
    inodes = {p.name: p.stat().st_ino for p in finished}
    ckpt(EXTRACT[0], EXTRACT[1], "-o", out, *EXTRACT[2:], "--resume")
    _same_files(out, ref)
    assert (out / finished[0].name).stat().st_ino != inodes[finished[0].name]
    assert all((out / n).stat().st_ino == inodes[n] for n in journaled if n != finished[0].name)
    assert not (out / ".ckpt-resume-journal.jsonl").exists()
    ckpt("verify-manifest", out)


def test_resume_recopies_a_whole_file_whose_bytes_changed(grafted, tmp_path, monkeypatch):
    target = CORPUS / "llmcompressor-nvfp4a16"
    ref, out = grafted("llmcompressor-nvfp4a16", "ct-nvfp4"), tmp_path / "out"
    args = ("graft", SOURCE, target, "-o", out, "--mtp-quant", "ct-nvfp4")
    with monkeypatch.context() as m:
        _interrupt_after(m, 2, "copy_whole_file")  # both target shards copied whole, then interrupted
        ckpt(*args, code=130)
    copied = sorted(p for p in out.glob("model-0000*.safetensors"))
    assert copied
    _flip_tensor_byte(copied[0])
    ckpt(*args, "--resume")
    _same_files(out, ref)
    ckpt("verify-manifest", out)
