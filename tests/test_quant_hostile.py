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

    from ckpt_tools.model.quant.codec import CODECS
    from ckpt_tools.model.quant.encode_core import EncodeArgs

    for name in ("modelopt-fp8", "modelopt-nvfp4", "ct-fp8", "ct-nvfp4"):
        out = CODECS[name].encode(torch.zeros(32, 64, dtype=torch.bfloat16),
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
    from ckpt_tools.ops.probe.numbers import check_finite

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


def _interrupt_after(monkeypatch, calls: int, what: str, only: str = "") -> None:
    """Interrupt after ``calls`` calls of ``what`` (those whose first argument's name ends with ``only``)."""
    import ckpt_tools.stream.targets.local as w

    orig, left = getattr(w, what), [calls]

    def interrupted(*a, **k):
        out = orig(*a, **k)
        if str(getattr(a[0], "name", "")).endswith(only):
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
        _interrupt_after(m, 14, "copy_range")
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
        # both target shards copied whole, then interrupted (the small files are copied whole too, before them)
        _interrupt_after(m, 2, "copy_whole_file", only=".safetensors")
        ckpt(*args, code=130)
    copied = sorted(p for p in out.glob("model-0000*.safetensors"))
    assert copied
    _flip_tensor_byte(copied[0])
    ckpt(*args, "--resume")
    _same_files(out, ref)
    ckpt("verify-manifest", out)


# -- 2. ignore / exclude entries are compiled as their consumers compile them ---------------------------------


def edit_config(path: Path, edit, name: str = "config.json") -> None:
    p = path / name
    obj = json.loads(p.read_text())
    edit(obj)
    p.write_text(json.dumps(obj, indent=2))


def test_a_malformed_ignore_regex_is_invalid_and_the_fixer_refuses_it(G, tmp_path):
    bad = "re:model.layers.2.(eh_proj"

    def swap(c):  # the bad regex replaces the only entry for the module
        ignore = c["quantization_config"]["ignore"]
        ignore[ignore.index(f"{MTP}eh_proj")] = bad

    edit_config(G, swap)
    found = rules_of(G)["quant-pattern"]
    assert len(found) == 1 and repr(bad) in found[0]["message"] and "ignore[" in found[0]["message"], found
    before = tree_hash(G)
    text = refused(ckpt("validate", "--fix-quant-config", G, "-o", tmp_path / "fixed", code=None), "quant-pattern")
    assert repr(bad) in text and not (tmp_path / "fixed").exists()
    refused(ckpt("dequant", G, "-o", tmp_path / "d", code=None), "quant-pattern")
    assert tree_hash(G) == before
    # the consumer's own matcher raises on it: the rule says what loading would
    import re

    match = pytest.importorskip("compressed_tensors.utils.match")
    with pytest.raises(re.error):
        match.match_name(f"{MTP}eh_proj", bad)


def test_a_target_or_modules_to_not_convert_entry_that_is_no_pattern_is_invalid(G):
    edit_config(G, lambda c: c["quantization_config"]["config_groups"]["group_0"]["targets"].append("re:*Linear"))
    found = rules_of(G)["quant-pattern"]
    assert "config_groups.group_0.targets" in found[0]["message"] and "'re:*Linear'" in found[0]["message"]


def test_a_non_string_exclude_entry_is_invalid(G):
    """Refused where the config is read (config-field); quant-pattern's own check says the same of any list."""
    from ckpt_tools.model.quant.patterns import entry_error

    edit_config(G, lambda c: c["quantization_config"]["ignore"].append(7))
    found = rules_of(G)["config-field"]
    assert "quantization_config.ignore" in found[0]["message"], found
    assert entry_error("modelopt", 7) == "is int 7, not a module name or pattern"
    assert entry_error("modelopt", "model.layers.[1") is None  # every string is an fnmatch glob
    assert entry_error("transformers", "(") is not None


# -- 4. the quant-config rules cover the trunk ---------------------------------------------------------------


def test_quantized_trunk_modules_excluded_by_a_regex_are_invalid_and_the_fixer_drops_the_entry(G, tmp_path):
    pattern = r"re:model\.layers\.1\..*"
    edit_config(G, lambda c: c["quantization_config"]["ignore"].append(pattern))
    found = rules_of(G)["trunk-quant-config"]
    keys = {p["key"] for p in found}
    assert "model.layers.1.self_attn.q_a_proj" in keys and "model.layers.1.mlp.experts.0.down_proj" in keys, keys
    assert all(k.startswith("model.layers.1.") for k in keys)
    assert all("stored NVFP4" in p["message"] and "but excluded" in p["message"] for p in found)
    refused(ckpt("dequant", G, "-o", tmp_path / "d", code=None), "trunk-quant-config")
    fixed = tmp_path / "fixed"
    ckpt("validate", "--fix-quant-config", G, "-o", fixed)
    ignore = json.loads((fixed / "config.json").read_text())["quantization_config"]["ignore"]
    assert pattern not in ignore and "model.layers.1.mlp.gate" in ignore  # what else it excluded stays excluded
    assert problems(fixed, code=0) == []
    _, _, _, _, _ = ref(fixed, "model.layers.1.self_attn.q_a_proj.weight_packed")
    match = pytest.importorskip("compressed_tensors.utils.match")
    assert not any(match.match_name("model.layers.1.self_attn.q_a_proj", e) for e in ignore)


def test_modelopt_exclude_glob_over_a_quantized_layer_is_invalid(tmp_path):
    src = copy(CORPUS / "modelopt-nvfp4", tmp_path / "m")
    edit_config(src, lambda c: c["quantization"]["exclude_modules"].append("model.layers.0*"), "hf_quant_config.json")
    found = rules_of(src)["trunk-quant-config"]
    assert found and all(p["key"].startswith("model.layers.0.") for p in found), found
    assert any("hf_quant_config.json" in p["message"] for p in found), found[0]["message"]


def unquantize(path: Path, module: str) -> None:
    """Store ``module`` as a BF16 ``weight`` in place of its packed tensors (as a tool that dequantized one layer
    and kept the config would), index updated."""
    import torch
    from safetensors.torch import load_file, save_file

    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    shard = wm[f"{module}.weight_packed"]
    tensors = load_file(path / shard)
    rows, packed = tensors[f"{module}.weight_packed"].shape
    for k in [k for k in tensors if k.startswith(module + ".")]:
        del tensors[k]
        del wm[k]
    tensors[f"{module}.weight"] = torch.full((rows, packed * 2), 0.01, dtype=torch.bfloat16)
    wm[f"{module}.weight"] = shard
    save_file(tensors, path / shard, metadata={"format": "pt"})
    index["metadata"].pop("total_size", None)  # report-only; not what this case is about
    index_path.write_text(json.dumps(index))


def test_a_float_trunk_module_the_config_targets_is_invalid(G, tmp_path):
    module = "model.layers.0.self_attn.o_proj"
    unquantize(G, module)
    found = rules_of(G)["trunk-quant-config"]
    assert [p["key"] for p in found] == [module], found
    assert "stored unquantized (BF16) but not excluded" in found[0]["message"]
    refused(ckpt("dequant", G, "-o", tmp_path / "d", code=None), "trunk-quant-config")
    fixed = tmp_path / "fixed"
    ckpt("validate", "--fix-quant-config", G, "-o", fixed)
    assert module in json.loads((fixed / "config.json").read_text())["quantization_config"]["ignore"]
    assert "trunk-quant-config" not in {p["rule"] for p in problems(fixed, code=None)}


def test_a_transposed_trunk_scale_is_invalid(F, tmp_path):
    src = F
    key = "model.layers.0.self_attn.o_proj.weight_scale"
    rows = ref(src, key)[3][0]
    reshape(src, key, [1, rows])
    found = [p for p in problems(src) if p["rule"] == "trunk-quant-config"]
    assert [p["key"] for p in found] == ["model.layers.0.self_attn.o_proj"], found
    assert f"expected [{rows}, 1]" in found[0]["message"], found
    assert "a config change cannot fix this" in found[0]["message"], found  # only the weights can
    refused(ckpt("dequant", src, "-o", tmp_path / "d", code=None), "trunk-quant-config")
    text = refused(ckpt("validate", "--fix-quant-config", src, "-o", tmp_path / "f", code=None), "trunk-quant-config")
    assert "need more than the config change" in text and not (tmp_path / "f").exists()


# -- 7. smaller points -------------------------------------------------------------------------------------------


def _reflinks_here(tmp_path: Path) -> bool:
    import fcntl
    import os

    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.write_bytes(b"x" * 4096)
    with open(a, "rb") as src, open(b, "wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), 0x40049409, src.fileno())
            return True
        except OSError:
            return False
        finally:
            os.sync()


def test_link_reflink_never_copies_silently(tmp_path):
    src = copy(CORPUS / "llmcompressor-nvfp4a16", tmp_path / "target")  # source and output on one filesystem
    out = tmp_path / "out"
    result = ckpt("graft", SOURCE, src, "-o", out, "--link", "reflink", code=None)
    if _reflinks_here(tmp_path):
        assert result.exit_code == 0, result.output
        return
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 4 and "[reflink-unsupported]" in text and "--link copy" in text, text
    assert not (out / "model.safetensors.index.json").exists()


def test_threads_beyond_the_cpus_are_capped_with_a_message(G, tmp_path):
    from ckpt_tools.parallel import available_cores

    result = ckpt("dequant", G, "-o", tmp_path / "d", "--threads", 100000, "--json")
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    cores = available_cores()
    assert f"--threads 100000: capped at {cores}" in text
    assert json.loads(result.stdout)["threads"] == cores


def test_graft_with_mtp_quant_and_mtp_dtype_encodes_the_quantizable_weights_and_casts_the_rest(tmp_path):
    out = tmp_path / "out"
    ckpt("graft", SOURCE, CORPUS / "llmcompressor-nvfp4a16", "-o", out, "--mtp-quant", "ct-nvfp4",
         "--mtp-dtype", "fp32")
    with Checkpoint.open(str(out)) as res, Checkpoint.open(str(SOURCE)) as src:
        mtp = {k: r for k, r in res.tensors.items() if k.startswith(MTP)}
        assert mtp[f"{MTP}self_attn.o_proj.weight_packed"].dtype == "U8"  # quantizable: encoded
        assert f"{MTP}self_attn.o_proj.weight" not in mtp
        assert mtp[f"{MTP}eh_proj.weight"].dtype == "F32"  # not quantizable in the release: cast
        assert mtp[f"{MTP}enorm.weight"].dtype == "F32"
        pinned = f"{MTP}mlp.gate.e_score_correction_bias"
        assert mtp[pinned].dtype == src.tensors[pinned].dtype == "F32"
    report = json.loads((out / "graft-report.json").read_text())
    assert report["mtp_storage"] == "ct-nvfp4 for the quantizable linear weights; fp32 values for the rest"


def test_a_nan_block_scale_of_a_deepseek_style_release_is_invalid(tmp_path):
    """The issue's probe case stores MTP weights as DeepSeek block FP8 (``weight_scale_inv``), which no producer
    fixture holds: the family's own release layout from the fixture generator stands in."""
    from ckpt_tools.testing import FixtureOptions, make_checkpoint

    path = make_checkpoint("deepseek_v3", tmp_path / "v3", FixtureOptions(fp8=True))
    with Checkpoint.open(str(path)) as c:
        key = next(k for k in sorted(c.tensors) if k.startswith("model.layers.3.") and k.endswith("weight_scale_inv"))
    fill(path, key, struct.pack("<f", float("nan")))
    found = rules_of(path)["quant-scale-value"]
    assert [p["key"] for p in found] == [key] and "value NaN at index [0, 0]" in found[0]["message"]
    refused(ckpt("dequant", path, "-o", tmp_path / "d", code=None), "quant-scale-value")


@pytest.mark.parametrize("bad", [[128], [0, 128], [128.0, 128], [True, 128]])
def test_a_declared_block_that_is_no_tile_is_invalid(tmp_path, bad):
    """A ``weight_block_size`` that is neither [rows, cols] of positive integers nor null is named as the cause
    (the scale-shape and storage findings that follow from it were all the report said before)."""
    from ckpt_tools.testing import FixtureOptions, make_checkpoint

    path = make_checkpoint("deepseek_v3", tmp_path / "v3", FixtureOptions(fp8=True))
    edit_config(path, lambda c: c["quantization_config"].__setitem__("weight_block_size", bad))
    found = rules_of(path)["fp8-block-size"]
    assert len(found) == 1 and found[0]["path"].endswith("config.json") and repr(bad) in found[0]["message"]
    r = ckpt("extract", path, "-o", tmp_path / "d", code=None)
    assert r.exit_code == 3 and "fp8-block-size" in r.output and not (tmp_path / "d").exists()
