"""Drafts as trainers save them, into stitch / diff / validate / inspect.

AngelSpec (Tencent/AngelSpec at d3412be) saves a trained MTP draft two ways: ``pytorch_model.bin``
with its ``MTPConfig`` beside it (``Trainer.save_draft_model_for_serving``: bare keys, no manifest)
and DCP training steps (``training/checkpoint.py``: ``iter_XXXXXXX/model/`` whose keys are
``model_state.model.draft_model.<key>``, beside ``optimizer/``, ``lr_scheduler/``, ``rng.pt``,
``meta.json``; no config). Both must stitch into a Hy3 verifier changing exactly the trained
tensors, in the verifier's dtypes. Drafts saved from wrapped modules (``module.``,
``_orig_mod.``) stitch like unwrapped ones; prefixes that cannot be stripped safely are refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from conftest import run_ckpt as ckpt

REPO = Path(__file__).resolve().parents[1]
MTP = "model.layers.3."  # the Hy3 fixture's MTP layer (3 decoder layers)
ANGELSPEC_DCP = "model_state.model.draft_model."
# draft tensors a "training run" changes, and the verifier tensors each one becomes
TRAINED = {
    "eh_proj.weight": [f"{MTP}eh_proj.weight"],
    "midlayer.self_attn.q_proj.weight": [f"{MTP}self_attn.q_proj.weight"],
    "midlayer.mlp.router.gate.weight": [f"{MTP}mlp.router.gate.weight"],
    "midlayer.mlp.experts_gate_proj": [f"{MTP}mlp.experts.{e}.gate_proj.weight" for e in range(4)],
}


def trained(state: dict[str, torch.Tensor], keys=TRAINED, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 copies as a trainer keeps them; ``keys`` moved a little (a finetune, not another model)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        t = t.float()
        if k in keys:
            t = t + 0.05 * t.std() * torch.randn(t.shape, generator=g)
        out[k] = t
    return out


def save_dcp(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist warns that it runs without a process group
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def angelspec_step(state: dict[str, torch.Tensor], step: Path) -> Path:
    """A training step as AngelSpec's checkpoint.save writes it."""
    save_dcp({"model_state": {"model": {f"draft_model.{k}": v for k, v in state.items()}}}, step / "model")
    save_dcp({"optim_state": {"optim": {"state": {"0": {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]},
                              "fp32_params": {"0": torch.ones(3)}}}, step / "optimizer")
    save_dcp({"lr_scheduler_state": {"lr_scheduler": {"last_epoch": 99}}}, step / "lr_scheduler")
    torch.save({"torch": torch.get_rng_state()}, step / "rng.pt")
    (step / "meta.json").write_text(json.dumps({"iteration": 100, "world_size": 1}))
    return step


def angelspec_config(extracted: Path) -> dict:
    """MTPConfig.save_pretrained's config: our fields without architectures, plus training knobs."""
    cfg = json.loads((extracted / "config.json").read_text())
    cfg.pop("architectures")
    return {**cfg, "mtp_ce_loss_scaling_factor": 0.1, "mtp_kl_loss_scaling_factor": 0.0, "transformers_version": "4.57"}


@pytest.fixture(scope="module")
def angelspec(make_fixture, tmp_path_factory) -> dict[str, Path]:
    """One trained AngelSpec draft of the Hy3 fixture, saved as AngelSpec saves it (and sharded)."""
    root = tmp_path_factory.mktemp("angelspec")
    verifier = make_fixture("hy_v3")
    # MTPDraftModel's state dict holds the frozen embedding it copied from the target
    ckpt("extract", verifier, "-o", root / "extracted", "--format", "angelspec", "--with-embed")
    state = trained(load_file(root / "extracted" / "model.safetensors"))
    config = json.dumps(angelspec_config(root / "extracted"))
    drafts = {"bin": root / "hf_final", "sharded": root / "sharded"}
    for d in drafts.values():
        d.mkdir()
        (d / "config.json").write_text(config)
    torch.save(state, drafts["bin"] / "pytorch_model.bin")
    keys = sorted(state)
    weight_map = {}
    for i, part in enumerate((keys[:7], keys[7:])):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, drafts["sharded"] / name)
        weight_map.update(dict.fromkeys(part, name))
    (drafts["sharded"] / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    drafts["dcp"] = angelspec_step(state, root / "checkpoints" / "iter_0000100")
    return {"verifier": verifier, **drafts}


def diff_json(a: Path, b: Path) -> dict:
    r = ckpt("diff", a, b, "--json", "--all", code=None)
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.output)


def test_angelspec_drafts_stitch_into_hy3(angelspec, tmp_path):
    """.bin, sharded .bin and DCP step: exactly the trained tensors change, in the verifier's dtypes."""
    verifier = angelspec["verifier"]
    changed = sorted(k for keys in TRAINED.values() for k in keys)
    outs = {}
    for kind in ("bin", "sharded", "dcp"):
        draft = angelspec[kind]
        # AngelSpec configs and DCP steps name no target model: the family must be asserted
        assert "[draft-unproven]" in ckpt("stitch", draft, verifier, "-o", tmp_path / "x", code=3).output
        out = outs[kind] = tmp_path / kind
        report = json.loads(ckpt("stitch", draft, verifier, "-o", out, "--arch", "hy_v3", "--json").output)
        assert (report["format"], report["provenance"]) == ("angelspec", "asserted with --arch hy_v3")
        assert report["draft"]["reader"] == ("dcp" if kind == "dcp" else "torch")
        assert report["draft"]["prefix_stripped"] == (
            {"prefix": ANGELSPEC_DCP, "how": "format angelspec, known wrapper"} if kind == "dcp" else None)
        manifest = json.loads((out / "ckpt_manifest.json").read_text())["draft"]
        assert {k: manifest[k] for k in report["draft"]} == report["draft"]

        d = diff_json(verifier, out)
        assert sorted(t["key"] for t in d["tensors"] if t["status"] != "unchanged") == changed
        # replaced in the verifier's dtype; every other tensor byte-identical (diff: unchanged)
        assert {t["status"] for t in d["tensors"] if t["key"] in changed} == {"replaced"}
        assert (out / "config.json").read_bytes() == (verifier / "config.json").read_bytes()
    for kind in ("sharded", "dcp"):  # the same draft however it was saved: the same output
        assert diff_json(outs["bin"], outs[kind])["identical"], kind


def test_verbs_say_how_they_read_a_draft(angelspec):
    step, hf = angelspec["dcp"], angelspec["bin"]
    v = json.loads(ckpt("validate", step, "--json").output)
    assert (v["ok"], v["draft_format"], v["reader"], v["checked"]) == (True, "angelspec", "dcp",
                                                                         {"files": 1, "tensors": 21})
    assert v["reader_notes"] == ["read model/; ignored lr_scheduler/, meta.json, optimizer/, rng.pt"]
    assert "read with the dcp reader" in ckpt("validate", step).output
    v = json.loads(ckpt("validate", angelspec["sharded"], "--json").output)
    assert (v["reader"], v["checked"]) == ("torch", {"files": 2, "tensors": 21})
    # the training step against the exported draft: the same tensors once the DCP wrapper is set aside
    d = diff_json(step, hf)
    assert d["identical"] and d["readers"]["a"]["prefix_stripped"] == ANGELSPEC_DCP
    assert (d["readers"]["a"]["reader"], d["readers"]["b"]["reader"]) == ("dcp", "torch")
    out = ckpt("inspect", step, code=3).output
    assert "[draft-format]" in out and "ckpt validate" in out


class Payload:
    """Unpickling this would create a file: proof that a trainer file beside the draft was never loaded."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.write_text, (self.target, "loaded"))


def test_speculators_epoch_folder_stitches(make_fixture, tmp_path):
    """``<save_path>/<epoch>/`` as speculators' trainer leaves it: no manifest, optimizer state beside it."""
    verifier = make_fixture("qwen3_next")
    epoch = tmp_path / "spec-out" / "2"
    ckpt("extract", verifier, "-o", epoch, "--format", "speculators")
    (epoch / "ckpt_manifest.json").unlink()
    weights = epoch / "model.safetensors"
    save_file(trained(load_file(weights), keys={"mtp_layers.0.input_proj.weight"}), weights)
    loaded = tmp_path / "loaded"
    for name in ("optimizer_state_dict.pt", "scheduler_state_dict.pt"):
        torch.save({"state": {0: Payload(loaded)}}, epoch / name)
    report = json.loads(ckpt("stitch", epoch, verifier, "-o", tmp_path / "out", "--json").output)
    assert report["format"] == "speculators" and report["provenance"].startswith("config.json transformer_layer")
    assert report["draft"] == {"reader": "safetensors", "reader_notes": [], "prefix_stripped": None}
    d = diff_json(verifier, tmp_path / "out")
    assert [t["key"] for t in d["tensors"] if t["status"] != "unchanged"] == ["mtp.fc.weight"]
    assert not loaded.exists()


# -- wrapper prefixes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def native(make_fixture, tmp_path_factory) -> dict[str, Path]:
    """A finetuned native Hy3 draft, unprefixed, and as saved from wrapped modules."""
    root = tmp_path_factory.mktemp("native")
    verifier = make_fixture("hy_v3")
    ckpt("extract", verifier, "-o", root / "extracted")
    state = trained(load_file(root / "extracted" / "model.safetensors"), keys={f"{MTP}eh_proj.weight"})
    drafts = {"plain": ("", "st"), "module": ("module.", "st"), "nested": ("module._orig_mod.", "bin"),
              "draft_model": ("draft_model.", "bin")}
    out = {"verifier": verifier, "state": state}
    for name, (prefix, how) in drafts.items():
        out[name] = save_draft({prefix + k: v for k, v in state.items()}, root / name, root / "extracted", how)
    return out


def save_draft(named: dict[str, torch.Tensor], d: Path, like: Path, how: str = "st") -> Path:
    """A draft directory: ``named`` tensors (safetensors or pytorch_model.bin) beside ``like``'s config."""
    d.mkdir()
    shutil.copy(like / "config.json", d / "config.json")
    if how == "st":
        save_file(named, d / "model.safetensors")
    else:
        torch.save(named, d / "pytorch_model.bin")
    return d


def shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))} | {
        "config.json": (out / "config.json").read_bytes()}


def test_prefixed_native_drafts_stitch_identically(native, tmp_path):
    ckpt("stitch", native["plain"], native["verifier"], "-o", tmp_path / "plain")
    expected = shards(tmp_path / "plain")
    assert len(expected) > 1
    for name, prefix in (("module", "module."), ("nested", "module._orig_mod."), ("draft_model", "draft_model.")):
        report = json.loads(ckpt("stitch", native[name], native["verifier"], "-o", tmp_path / name, "--json").output)
        assert report["draft"]["prefix_stripped"] == {"prefix": prefix, "how": "known wrapper"}
        assert shards(tmp_path / name) == expected, name  # a key rename only: the same bytes out
    assert "stripped the prefix 'module.' from every key (known wrapper)" in ckpt(
        "stitch", native["module"], native["verifier"], "-o", tmp_path / "x", "--dry-run").output


def test_prefixes_that_cannot_be_stripped_safely(native, tmp_path):
    verifier, state, like = native["verifier"], native["state"], native["plain"]
    keys = sorted(state)
    half = save_draft({("module." + k if i % 2 else k): state[k] for i, k in enumerate(keys)}, tmp_path / "half", like)
    out = ckpt("stitch", half, verifier, "-o", tmp_path / "o", code=3).output
    assert "[prefix-partial]" in out and f"{len(keys) // 2} of the draft's {len(keys)} keys carry" in out
    # one key saved twice, once wrapped: stripping would make them one key
    twice = save_draft({**state, "module." + keys[0]: state[keys[0]].clone()}, tmp_path / "twice", like)
    out = ckpt("stitch", twice, verifier, "-o", tmp_path / "o", code=3).output
    assert "[prefix-partial]" in out and f"module.{keys[0]} and {keys[0]} one key" in out

    unknown = save_draft({"trainer.net." + k: v for k, v in state.items()}, tmp_path / "unknown", like)
    out = ckpt("stitch", unknown, verifier, "-o", tmp_path / "o", code=3).output
    assert "[draft-mismatch]" in out and "`--strip-prefix trainer.net.`" in out
    r = json.loads(ckpt("stitch", unknown, verifier, "-o", tmp_path / "u", "--strip-prefix", "trainer.net.",
                        "--json").output)
    assert r["draft"]["prefix_stripped"] == {"prefix": "trainer.net.", "how": "--strip-prefix"}
    ckpt("stitch", native["plain"], verifier, "-o", tmp_path / "plain")
    assert shards(tmp_path / "u") == shards(tmp_path / "plain")
    assert "[draft-mismatch]" in ckpt("stitch", unknown, verifier, "-o", tmp_path / "o", "--strip-prefix", "other.",
                                      code=3).output
    assert "[prefix-partial]" in ckpt("stitch", half, verifier, "-o", tmp_path / "o", "--strip-prefix", "module.",
                                      code=3).output
    ckpt("stitch", unknown, verifier, "-o", tmp_path / "o", "--strip-prefix", "", code=2)


# -- memory ------------------------------------------------------------------------------------------

# A Hy3 verifier whose MTP fusion projection eh_proj [4096, 8192] (64 MB bf16; 128 MB in an fp32 draft)
# outweighs every other tensor of the draft together (about 3 MB).
BIG = {"hidden_size": 4096, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16,
       "intermediate_size": 16, "moe_intermediate_size": 16, "num_experts": 2, "num_experts_per_tok": 1,
       "vocab_size": 64, "num_hidden_layers": 1}
BIG_BYTES = 4096 * 8192 * 4

# One stitch in a fresh process, its modules imported first: the kernel's high-water mark (VmHWM, reset to
# the current RSS) then measures the stitch alone. glibc's mmap threshold is fixed at 1 MB so that freed
# buffers go back to the kernel at once (its adaptive threshold keeps them, and RSS would show the
# allocator's history rather than what the stitch holds).
_MEASURE = """
import gc, importlib, json, sys
for m in ("ckpt_tools.cli", "ckpt_tools.ops.stitch.plan", "ckpt_tools.ops.check.validate", "ckpt_tools.io.readers.dcp",
          "ckpt_tools.io.readers.torch_state", "ckpt_tools.stream.writer", "ckpt_tools.model.experts",
          "torch.distributed.checkpoint"):
    importlib.import_module(m)
from ckpt_tools.cli import app

def status(field):
    return int(next(x for x in open("/proc/self/status") if x.startswith(field + ":")).split()[1]) * 1024

draft, verifier, out = sys.argv[1:]
gc.collect()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
try:
    app(["stitch", draft, verifier, "-o", out, "--arch", "hy_v3", "--json"], standalone_mode=False)
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps({"before": before, "peak": status("VmHWM")}), file=sys.stderr)
"""


def stitch_peak(draft: Path, verifier: Path, out: Path) -> float:
    """Peak memory of stitching ``draft`` above the process before it, in units of the big tensor."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    run = subprocess.run([sys.executable, "-c", _MEASURE, str(draft), str(verifier), str(out)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stderr.splitlines()[-1])
    return (m["peak"] - m["before"]) / BIG_BYTES


@pytest.fixture
def big_dir(tmp_path):
    """Room for the stitch outputs: in memory when /dev/shm exists."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="ckpt-trainer-drafts-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures with Linux's /proc peak-RSS reset")
def test_dcp_stitch_memory_is_bounded(make_fixture, big_dir):
    """Stitching an AngelSpec DCP step whose one tensor outweighs the rest: the tensor is never held whole.

    Peak memory above the process before the stitch, against the 128 MB fp32 tensor: 16 MB bands go
    through the gate's comparisons, the cast to the verifier's BF16 and the writer. Measured 0.64 x
    (82 MB); the same draft from safetensors 0.63 x; with a 32 MB tensor the peak is the same 82 MB.
    """
    verifier = make_fixture("hy_v3", config_overrides=BIG, num_shards=2, extra_files=False)
    ckpt("extract", verifier, "-o", big_dir / "extracted", "--format", "angelspec")
    state = trained(load_file(big_dir / "extracted" / "model.safetensors"), keys={"eh_proj.weight"})
    assert state["eh_proj.weight"].nbytes == BIG_BYTES > 10 * sum(t.nbytes for k, t in state.items()
                                                                 if k != "eh_proj.weight")
    step = angelspec_step(state, big_dir / "iter_0000100")
    del state
    peak = stitch_peak(step, verifier, big_dir / "out")
    print(f"DCP stitch: peak {peak:.2f} x the 128 MB tensor")
    assert peak < 0.75  # never the whole tensor: bands of it, whatever its size
