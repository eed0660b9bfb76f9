"""ModelOpt's two configuration files agree, and KV-cache scales are values (issue 40, classes 5 and 6).

Built on real producers' outputs (fixtures/producers/): ``graft transformers-deepseek_v3 modelopt-{fp8,nvfp4}
--mtp-dtype bf16`` (valid as made, both files as ModelOpt wrote them) and ``graft ... llmcompressor-fp8-dynamic
--mtp-quant ct-fp8``. Each case edits a copy.

- ``quant-config-agree``: hf_quant_config.json saying FP8 while config.json says NVFP4 (or the reverse), or
  disagreeing on the KV-cache scheme, the group size or the exclusions, was no finding; vLLM reads config.json's
  section when present and older consumers hf_quant_config.json, so the two load different models.
- ``kv-scale-value``: a NaN, zero or negative ``k_scale`` / ``v_scale`` under ModelOpt's ``kv_cache_quant_algo``
  or compressed-tensors' ``kv_cache_scheme`` passed; vLLM asserts on a zero or NaN ``k_scale`` at load and
  silently replaces the others (a negative pair by 1.0, a bad ``v_scale`` by ``k_scale``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt
from conftest import tree_hash

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
SOURCE = CORPUS / "transformers-deepseek_v3"
HF_QUANT = "hf_quant_config.json"


@pytest.fixture(scope="module")
def grafted(tmp_path_factory):
    done: dict[tuple[str, str], Path] = {}

    def make(target: str, *opts: str) -> Path:
        if (target, opts) not in done:
            out = tmp_path_factory.mktemp("graft") / target
            ckpt("graft", SOURCE, CORPUS / target, "-o", out, *opts)
            done[(target, opts)] = out
        return done[(target, opts)]

    return make


@pytest.fixture
def fp8(grafted, tmp_path) -> Path:
    return copy(grafted("modelopt-fp8", "--mtp-dtype", "bf16"), tmp_path / "fp8")


@pytest.fixture
def nvfp4(grafted, tmp_path) -> Path:
    return copy(grafted("modelopt-nvfp4", "--mtp-dtype", "bf16"), tmp_path / "nvfp4")


@pytest.fixture
def ct(grafted, tmp_path) -> Path:
    return copy(grafted("llmcompressor-fp8-dynamic", "--mtp-quant", "ct-fp8"), tmp_path / "ct")


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit(path: Path, name: str, fn) -> None:
    p = path / name
    obj = json.loads(p.read_text())
    fn(obj)
    p.write_text(json.dumps(obj, indent=2))


def qc(c: dict) -> dict:
    return c["quantization_config"]


def hq(c: dict) -> dict:
    return c["quantization"]


def problems(path: Path, code: int = 1) -> list[dict]:
    return json.loads(ckpt("validate", path, "--json", code=code).stdout)["problems"]


def found(path: Path, rule: str) -> list[dict]:
    got = [p for p in problems(path) if p["rule"] == rule]
    assert got, problems(path, code=None)
    return got


def refused(result, rule: str) -> str:
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 3, f"exit {result.exit_code}: {text}"
    assert f"[{rule}]" in text, text
    return text


def gate_refuses(path: Path, rule: str, tmp_path: Path) -> None:
    """Every verb's gate: extract and dequant refuse before writing anything; the input is left as it was."""
    before = tree_hash(path)
    refused(ckpt("extract", path, "-o", tmp_path / "e", code=None), rule)
    refused(ckpt("dequant", path, "-o", tmp_path / "d", code=None), rule)
    refused(ckpt("fuse-experts", path, "-o", tmp_path / "f", code=None), rule)
    assert not (tmp_path / "e").exists() and not (tmp_path / "d").exists() and not (tmp_path / "f").exists()
    assert tree_hash(path) == before


def test_the_grafted_producer_outputs_are_valid_as_made(fp8, nvfp4, ct):
    for path in (fp8, nvfp4, ct):
        assert problems(path, code=0) == []


# -- class 5: ModelOpt's two files agree -----------------------------------------------------------------------


def test_hf_quant_config_saying_nvfp4_beside_a_config_saying_fp8_is_invalid(fp8, tmp_path):
    edit(fp8, HF_QUANT, lambda c: hq(c).update(quant_algo="NVFP4", group_size=16))
    (p,) = found(fp8, "quant-config-agree")
    msg = p["message"]
    assert p["path"].endswith(HF_QUANT), p
    assert 'config.json quantization_config.quant_algo = "FP8" (modelopt-fp8)' in msg, msg
    assert 'hf_quant_config.json quantization.quant_algo = "NVFP4" (modelopt-nvfp4)' in msg, msg
    gate_refuses(fp8, "quant-config-agree", tmp_path)


def test_config_saying_fp8_beside_hf_quant_config_saying_nvfp4_is_invalid(nvfp4, tmp_path):
    """The reverse: config.json (what vLLM reads) says FP8 over NVFP4 tensors."""
    edit(nvfp4, "config.json", lambda c: qc(c).update(quant_algo="FP8"))
    (p,) = found(nvfp4, "quant-config-agree")
    assert '"FP8" (modelopt-fp8)' in p["message"] and '"NVFP4" (modelopt-nvfp4)' in p["message"], p
    refused(ckpt("extract", nvfp4, "-o", tmp_path / "e", code=None), "quant-config-agree")


def test_an_algo_case_or_exclusion_order_is_no_disagreement(fp8):
    """vLLM upper-cases quant_algo; an exclusion list is a set of patterns."""
    edit(fp8, HF_QUANT, lambda c: hq(c).update(quant_algo="fp8", exclude_modules=hq(c)["exclude_modules"][::-1]))
    assert problems(fp8, code=0) == []


@pytest.mark.parametrize(("case", "config", "hf", "names"), [
    ("kv-cache", None, {"kv_cache_quant_algo": "FP8"},
     ["config.json quantization_config.kv_cache_scheme = null", "kv_cache_quant_algo = \"FP8\"", "kv_cache"]),
    ("exclusions", None, {"exclude_modules": ["lm_head", "model.embed_tokens"]},
     ["quantization_config.ignore", "quantization.exclude_modules", "exclusions"]),
    ("algo-variant", None, {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
     ["quant_algo = \"FP8\"", "quant_algo = \"FP8_PER_CHANNEL_PER_TOKEN\"", "disagree on algo"]),
])
def test_modelopt_files_disagreeing_on_a_field_both_state(fp8, case, config, hf, names):
    edit(fp8, HF_QUANT, lambda c: hq(c).update(hf))
    (p,) = found(fp8, "quant-config-agree")
    for n in names:
        assert n in p["message"], (n, p["message"])


def test_kv_cache_scheme_in_modelopts_converted_form_agrees_with_kv_cache_quant_algo(fp8):
    """ModelOpt's convert_hf_quant_config_format writes kv_cache_quant_algo FP8 as this kv_cache_scheme."""
    edit(fp8, HF_QUANT, lambda c: hq(c).update(kv_cache_quant_algo="FP8"))
    edit(fp8, "config.json", lambda c: qc(c).update(kv_cache_scheme={"dynamic": False, "num_bits": 8, "type": "float"}))
    assert problems(fp8, code=0) == []


def test_nvfp4_group_sizes_that_disagree(nvfp4, tmp_path):
    """vLLM reads config.json's flat group_size when config.json has the section; hf_quant_config.json says 16."""
    edit(nvfp4, "config.json", lambda c: qc(c).update(group_size=32))
    rules = {p["rule"] for p in problems(nvfp4)}
    assert "quant-config-agree" in rules, rules
    (p,) = found(nvfp4, "quant-config-agree")
    assert "quantization_config.group_size = 32" in p["message"] and "quantization.group_size = 16" in p["message"]


def test_an_hf_quant_config_no_table_describes_beside_a_known_config_is_a_disagreement(fp8):
    edit(fp8, HF_QUANT, lambda c: hq(c).update(quant_algo="W4A8_AWQ"))
    (p,) = found(fp8, "quant-config-agree")
    assert '"W4A8_AWQ" (no scheme table)' in p["message"] and '"FP8" (modelopt-fp8)' in p["message"], p


# -- class 6: KV-cache scales are finite and positive -----------------------------------------------------------


def add_tensors(path: Path, tensors: dict) -> None:
    """New tensors in a shard of their own, indexed (as a producer that exported KV-cache scales writes them)."""
    from safetensors.torch import save_file

    save_file(tensors, path / "model-kv.safetensors", metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: "model-kv.safetensors" for k in tensors})
    index["metadata"].pop("total_size", None)  # report-only; not what this case is about
    index_path.write_text(json.dumps(index))
    manifest = path / "ckpt_manifest.json"
    if manifest.exists():
        manifest.unlink()  # the graft's manifest does not list the new tensors (report-only rules)


def modelopt_kv(path: Path, values: dict[str, float]) -> dict[str, str]:
    """ModelOpt's names and dtype: F32 scalars beside k_proj / v_proj, declared by kv_cache_quant_algo FP8."""
    import torch

    keys = {}
    tensors = {}
    for layer in (0, 1):
        for kv in ("k", "v"):
            key = f"model.layers.{layer}.self_attn.{kv}_proj.{kv}_scale"
            keys[f"{layer}.{kv}"] = key
            tensors[key] = torch.tensor(values.get(f"{layer}.{kv}", 0.05), dtype=torch.float32)
    add_tensors(path, tensors)
    edit(path, HF_QUANT, lambda c: hq(c).update(kv_cache_quant_algo="FP8"))
    fp8_kv = {"dynamic": False, "num_bits": 8, "type": "float"}  # ModelOpt's converted form of kv_cache_quant_algo FP8
    edit(path, "config.json", lambda c: qc(c).update(kv_cache_scheme=fp8_kv))
    return keys


def ct_kv(path: Path, values: dict[str, float]) -> dict[str, str]:
    """compressed-tensors' names: BF16 [1] on the attention module, declared by kv_cache_scheme."""
    import torch

    keys = {}
    tensors = {}
    for layer in (0, 1):
        for kv in ("k", "v"):
            key = f"model.layers.{layer}.self_attn.{kv}_scale"
            keys[f"{layer}.{kv}"] = key
            tensors[key] = torch.tensor([values.get(f"{layer}.{kv}", 0.05)], dtype=torch.bfloat16)
    add_tensors(path, tensors)
    edit(path, "config.json", lambda c: qc(c).update(kv_cache_scheme={
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}))
    return keys


@pytest.mark.parametrize("which", ["fp8", "nvfp4", "ct"])
def test_positive_kv_cache_scales_are_valid(request, which):
    path = request.getfixturevalue(which)
    (ct_kv if which == "ct" else modelopt_kv)(path, {})
    assert [p for p in problems(path, code=None) if p["rule"] in ("kv-scale-value", "quant-config-agree")] == []


@pytest.mark.parametrize(("which", "value", "shown"), [
    ("fp8", float("nan"), "NaN"), ("fp8", 0.0, "0.0"), ("fp8", -0.5, "-0.5"),
    ("nvfp4", float("inf"), "inf"),
    ("ct", float("nan"), "NaN"), ("ct", 0.0, "0.0"), ("ct", -2.0, "-2.0"),
])
def test_a_kv_cache_scale_that_is_not_finite_and_positive_is_invalid(request, tmp_path, which, value, shown):
    path = request.getfixturevalue(which)
    keys = (ct_kv if which == "ct" else modelopt_kv)(path, {"1.v": value})
    got = found(path, "kv-scale-value")
    assert [p["key"] for p in got] == [keys["1.v"]], got
    assert f"KV-cache scale value {shown} at index" in got[0]["message"], got
    assert got[0]["path"].endswith("model-kv.safetensors"), got
    gate_refuses(path, "kv-scale-value", tmp_path)


def test_kv_cache_scales_are_judged_only_under_a_declared_scheme(ct):
    """No quantization declared: a tensor named like a KV-cache scale is not a scale this rule knows."""
    from ckpt_tools.io.checkpoint import Checkpoint
    from ckpt_tools.model.quant.kv_scales import kv_scale_problems

    ct_kv(ct, {"0.k": 0.0})
    with Checkpoint.open(str(ct)) as c:
        assert [p.key for p in kv_scale_problems(c)] == ["model.layers.0.self_attn.k_scale"]
    edit(ct, "config.json", lambda c: c.pop("quantization_config"))
    with Checkpoint.open(str(ct)) as c:
        assert kv_scale_problems(c) == []


# -- the consumer: what vLLM makes of both ------------------------------------------------------------------------


def test_vllm_reads_config_json_over_hf_quant_config_and_misreads_bad_kv_scales(fp8):
    """The facts the two rules rest on, from vLLM itself (.venv-vllm): with both files it takes config.json's
    quant_algo (hf_quant_config.json only when config.json has no section), so the two files load different
    models; a zero or NaN k_scale is refused at load, a negative pair silently becomes 1.0 and a bad v_scale
    silently becomes k_scale."""
    import subprocess

    from consumer_venv import venv_env, vllm_python

    python = vllm_python()
    script = Path(__file__).parent / "consumers" / "vllm_quant_config.py"

    def read(path: Path) -> dict:
        r = subprocess.run([str(python), str(script), str(path)], capture_output=True, text=True, env=venv_env(),
                           timeout=600, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    edit(fp8, HF_QUANT, lambda c: hq(c).update(quant_algo="NVFP4", group_size=16))
    got = read(fp8)
    assert got["quant_algo"] == "FP8", got
    assert got["kv"] == {"0.05 0.05": "k=0.05 v=0.05", "0.0 0.05": "refused", "nan 0.05": "refused",
                         "-0.5 -0.5": "k=1 v=1", "0.05 0.0": "k=0.05 v=0.05", "0.05 nan": "k=0.05 v=0.05",
                         "0.05 -0.5": "k=0.05 v=0.05"}, got
    edit(fp8, "config.json", lambda c: c.pop("quantization_config"))
    assert read(fp8)["quant_algo"] == "NVFP4"
