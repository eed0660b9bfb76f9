"""Issue 40, class 12: what crashed (exit 5) or said something unclear is a refusal naming the actual fault.

Each case runs the verb through the CLI and asserts the exit code and that the message names the file (or the
key) and the rule. The probe cases are refused before a weight loads, so the untrained fixture serves.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt

pytest.importorskip("transformers")

PRODUCERS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"


def said(r) -> str:
    return " ".join((r.output + (r.stderr or "")).split())


# -- -o through a dangling symbolic link ---------------------------------------------------------------------------


@pytest.mark.parametrize("verb", [["extract"], ["init-draft"], ["fuse-experts"], ["dequant", "--only-mtp"]])
@pytest.mark.parametrize("below", [False, True])  # -o is the link, or a path below it
def test_an_output_through_a_dangling_link_is_named_with_its_target(make_fixture, tmp_path, verb, below):
    src = make_fixture("deepseek_v3", fp8=verb[0] == "dequant")
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    out = link / "sub" if below else link
    r = ckpt(*verb, src, "-o", out, code=4)
    text = said(r)
    assert "[output-dangling-link]" in text and f"{link} is a dangling symbolic link (to {tmp_path / 'gone'}" in text
    assert "File exists" not in text
    assert not (tmp_path / "gone").exists() and link.is_symlink()  # nothing created through it


@pytest.mark.parametrize("option", ["--plan-json", "--report"])
def test_a_json_file_through_a_dangling_link_is_refused_and_one_through_a_link_replaces_its_target(
        make_fixture, tmp_path, option):
    src = make_fixture("deepseek_v3")
    verb = ["extract", src]
    if option == "--report":
        ckpt("extract", src, "-o", tmp_path / "draft")
        verb = ["stitch", tmp_path / "draft", src]
    (tmp_path / "j").mkdir()
    link, target = tmp_path / "j" / "report.json", tmp_path / "j" / "gone.json"
    link.symlink_to(target)
    r = ckpt(*verb, "-o", tmp_path / "out", "--dry-run", option, link, code=4)
    assert "[output-dangling-link]" in said(r) and option in said(r)
    assert not target.exists() and link.is_symlink()
    target.write_text("old")
    ckpt(*verb, "-o", tmp_path / "out", "--dry-run", option, link)
    assert link.is_symlink() and isinstance(json.loads(target.read_text()), dict)
    assert sorted(p.name for p in link.parent.iterdir()) == ["gone.json", "report.json"]  # no temporary file left


# -- probe's prompts file ------------------------------------------------------------------------------------------


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "fifo")  # no writer: opening it must not wait for one
    return d / "fifo"


def _sparse(d: Path) -> Path:
    with open(d / "big.txt", "wb") as f:
        f.truncate(64 * 2**20 + 1)  # one byte past the bound, no disk used
    return d / "big.txt"


@pytest.mark.parametrize(("make", "says"), [
    (lambda d: Path("/dev/zero"), "the prompts file is a character device; give a regular file"),
    (_fifo, "the prompts file is a FIFO; give a regular file"),
    (_sparse, "the prompts file is larger than 67108864 bytes (64 MiB), the most probe reads"),
], ids=["dev-zero", "fifo", "past-the-bound"])
def test_a_prompts_file_that_never_ends_is_refused_with_the_bound(make_fixture, tmp_path, make, says):
    path = make(tmp_path)
    r = ckpt("probe", make_fixture("deepseek_v3"), "--prompts", path, code=3)
    assert f"{path}: [prompts]: {says}" in said(r)


@pytest.mark.parametrize(("line", "says"), [
    ('{"input_ids": []}', "line 3 (prompt 2): input_ids is empty; a prompt needs at least one token"),
    ('{"input_ids": [5, -2]}', "line 3 (prompt 2): input_ids[1] = -2 is negative: token ids are 0 <= id < 256 "
                               "(the verifier's vocab_size)"),
    ('{"input_ids": [5, 6, 256]}', "line 3 (prompt 2): input_ids[2] = 256 is outside the vocabulary: token ids are "
                                   "0 <= id < 256 (the verifier's vocab_size)"),
])
def test_a_prompt_probe_cannot_take_is_named_by_line_index_and_vocab(make_fixture, tmp_path, line, says):
    src = make_fixture("deepseek_v3")
    assert json.loads((src / "config.json").read_text())["vocab_size"] == 256
    path = tmp_path / "p.jsonl"
    path.write_text('{"input_ids": [3, 4]}\n\n' + line + "\n")
    r = ckpt("probe", src, "--prompts", path, code=3)
    assert f"{path}: [prompts]: {says}" in said(r)


# -- a companion or weight under its own name in the wrong dtype ---------------------------------------------------


def raw_retype(shard: Path, key: str, dtype: str) -> None:
    """``key``'s header dtype changed in place (same byte width: the data stays, the header keeps its length)."""
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header[key]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    raw[8:8 + n] = text + b" " * (n - len(text))
    shard.write_bytes(bytes(raw))


def retyped(producer: str, key: str, dtype: str, dest: Path) -> Path:
    """A copy of a real producer's output with ``key``'s header dtype changed."""
    out = dest / producer
    shutil.copytree(PRODUCERS / producer, out)
    raw_retype(out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][key], key, dtype)
    return out


@pytest.mark.parametrize(("producer", "key", "stored", "expected", "scheme"), [
    ("llmcompressor-nvfp4a16", "weight_packed", "I8", "U8", "compressed-tensors nvfp4-pack-quantized (NVFP4)"),
    ("modelopt-nvfp4", "weight", "I8", "U8", "ModelOpt NVFP4"),
    ("llmcompressor-w8a8", "weight", "U8", "I8", "compressed-tensors int-quantized INT8"),
    # a companion: the same words, whatever the scheme
    ("llmcompressor-nvfp4a16", "weight_scale", "I8", "F8_E4M3", "compressed-tensors nvfp4-pack-quantized (NVFP4)"),
    ("llmcompressor-fp8-block", "weight_scale", "I16", "BF16 or F16 or F32", "compressed-tensors float-quantized FP8"),
])
def test_a_weight_in_the_wrong_dtype_is_said_so_not_missing(tmp_path, producer, key, stored, expected, scheme):
    module = "model.layers.0.self_attn.o_proj"
    d = retyped(producer, f"{module}.{key}", stored, tmp_path)
    r = ckpt("validate", d, "--json", code=1)
    about = [p for p in json.loads(r.stdout)["problems"] if (p["key"] or "").startswith(module)]
    assert not any(p["rule"] == "trunk-missing" or "no shard holds it" in p["message"] for p in about), about
    (finding,) = [p for p in about if p["rule"] == "trunk-quant-config"]
    assert finding["key"] == module
    assert f"{module}.{key} is {stored}, expected {expected}" in finding["message"]
    assert scheme in finding["message"] and "malformed" in finding["message"]


# -- a declared block every stored scale grid disagrees with, all fitting one other: the config is wrong -----------


def test_a_wrong_weight_block_size_is_the_configs_fault_and_fix_quant_config_repairs_it(make_fixture, tmp_path):
    src = tmp_path / "fp8"
    shutil.copytree(make_fixture("deepseek_v3", fp8=True), src)
    config = json.loads((src / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]  # what the scales were made with
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(config, indent=2))
    problems = json.loads(ckpt("validate", src, "--json", code=1).stdout)["problems"]
    assert not any("re-quantize" in p["message"] for p in problems), problems
    assert not any(p["rule"] == "fp8-scale-shape" for p in problems)  # one fault, said once
    (block,) = [p for p in problems if p["rule"] == "fp8-block-size"]
    assert block["path"].endswith("config.json")
    assert (f"the configuration's weight_block_size [64, 64] is wrong: every stored scale grid is that of block "
            f"[128, 128] (rule fp8-block-size); `ckpt validate --fix-quant-config {src} -o OUT` sets "
            "weight_block_size to [128, 128]") in block["message"]
    for p in problems:  # each module finding points at the same repair
        assert p["rule"] == "fp8-block-size" or "--fix-quant-config" in p["message"], p
    out = tmp_path / "fixed"
    fixed = json.loads(ckpt("validate", "--fix-quant-config", src, "-o", out, "--json").stdout)
    assert fixed["status"] == "fixed" and fixed["fixed"][0]["key"] == "quantization_config.weight_block_size"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    ckpt("validate", out)
    for shard in src.glob("*.safetensors"):
        assert (out / shard.name).read_bytes() == shard.read_bytes()  # only the config changed


# -- probe of a trunk without MTP layers, with a --draft ------------------------------------------------------------


def test_probe_of_a_trunk_with_a_draft_says_why_not_and_the_command_it_names_works(make_fixture, tmp_path):
    trunk = make_fixture("deepseek_v3", drop_mtp=True)
    draft = tmp_path / "draft"
    ckpt("extract", make_fixture("deepseek_v3"), "-o", draft)
    text = said(ckpt("probe", trunk, "--draft", draft, code=3))
    assert f"{trunk}: [probe-family]: the verifier declares no MTP layer (num_nextn_predict_layers: 0)" in text
    assert "nothing to probe" not in text
    assert f"`ckpt stitch DRAFT {trunk} --mode add -o OUT`, `ckpt probe OUT`" in text
    out = tmp_path / "with-mtp"
    ckpt("stitch", draft, trunk, "--mode", "add", "-o", out)  # the advice holds: OUT is a verifier with MTP
    ckpt("validate", out)


def test_the_block_the_scales_have_is_found_only_when_the_declared_one_does_not_fit():
    from types import SimpleNamespace

    from ckpt_tools.model.quant.block_audit import fitting_block
    from ckpt_tools.model.quant.codec import checkpoint_codec

    fmt = checkpoint_codec(hint="fp8-block")
    tensors = {"a.weight": ("F8_E4M3", (64, 64)), "a.weight_scale_inv": ("F32", (1, 1))}
    ckpt = SimpleNamespace(tensors={k: SimpleNamespace(dtype=d, shape=s) for k, (d, s) in tensors.items()})
    assert fitting_block(ckpt, fmt, (64, 64)) is None  # the declared block fits: never called wrong
    assert fitting_block(ckpt, fmt, (32, 32)) == (128, 128)  # the table's block, when it fits
    ckpt.tensors["b.weight"] = SimpleNamespace(dtype="F8_E4M3", shape=(256, 512))
    ckpt.tensors["b.weight_scale_inv"] = SimpleNamespace(dtype="F32", shape=(4, 8))
    assert fitting_block(ckpt, fmt, (128, 128)) == (64, 64)  # else the one power of two that fits every grid
    ckpt.tensors["c.weight"] = SimpleNamespace(dtype="F8_E4M3", shape=(256, 512))
    ckpt.tensors["c.weight_scale_inv"] = SimpleNamespace(dtype="F32", shape=(2, 4))
    assert fitting_block(ckpt, fmt, (128, 128)) is None  # no one block fits every grid: the scales are wrong


def test_an_mtp_weight_in_the_wrong_dtype_is_said_so_not_missing(tmp_path):
    """The MTP view reads storage the same way: mtp-quant-config names the wrong dtype (no real producer keeps an
    MTP layer quantized, so the compressed-tensors fixture stands in)."""
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    src = make_quantized_checkpoint("deepseek_v3", tmp_path / "src", QuantOptions("ct-nvfp4"))
    module = "model.layers.3.self_attn.o_proj"  # the fixture's MTP layer
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    raw_retype(src / index[f"{module}.weight_packed"], f"{module}.weight_packed", "I8")
    problems = json.loads(ckpt("validate", src, "--json", code=1).stdout)["problems"]
    assert not any(p["rule"] == "mtp-missing" for p in problems), problems
    (finding,) = [p for p in problems if p["rule"] == "mtp-quant-config"]
    assert finding["key"] == module and f"{module}.weight_packed is I8, expected U8" in finding["message"]
