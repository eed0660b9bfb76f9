"""Drafts straight from memory: a ``{name: torch.Tensor}`` mapping into stitch, diff and probe.

A trainer holds its finished draft as a state dict. Stitching that mapping must give the checkpoint that
saving it with safetensors and running ``ckpt stitch`` on the directory gives - byte for byte - with the
same gate, dtype policy, prefix stripping and divergence check, read one tensor at a time (no temporary
directory, no copy of the mapping).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools import api
from ckpt_tools.api.writing import invocation
from ckpt_tools.errors import InputError, OutputError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.readers.memory import FILE, ROOT
from ckpt_tools.ops.diff.diff import diff

from conftest import run_ckpt as ckpt

FAMILY = "qwen3_next"  # the fixture that speaks both native and speculators names
# what a finetune touched, per draft format: a norm and a projection
TOUCHED = {"native": ["mtp.norm.weight", "mtp.fc.weight"],
           "speculators": ["mtp_layers.0.input_layernorm.weight", "mtp_layers.0.input_proj.weight"]}
# manifest fields that name how the draft was read (a directory vs a mapping), and the plan digests over them
MANIFEST_DIFFERS = {"draft.path", "draft.reader", "inputs.draft.root", "inputs.draft.files.model.safetensors",
                    "plan.inputs", "plan.manifest", "plan.plan", "plan.tensors"}


@pytest.fixture(scope="module")
def verifier(make_fixture) -> Path:
    return make_fixture(FAMILY)


@pytest.fixture(scope="module")
def extracted(verifier, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("extracted")
    for fmt in TOUCHED:
        ckpt("extract", verifier, "-o", root / fmt, "--format", fmt)
    return {fmt: root / fmt / "model.safetensors" for fmt in TOUCHED}


def stitch(draft, verifier, out, *, command: str | None = None, **options):
    """``api.stitch`` (recording ``command``, the CLI's, in the manifest when given): the stitch's own report."""
    with invocation(command) if command else contextlib.nullcontext():
        return api.stitch(draft, verifier, out, **options).details


def finetuned(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The extracted draft as a trainer would hold it after a short finetune."""
    state = load_file(path)
    for i, key in enumerate(TOUCHED[fmt]):
        state[key] = state[key] + 1e-2 * (i + 1)
    return state


def saved(state: dict[str, torch.Tensor], d: Path) -> Path:
    """The same draft saved by the trainer instead (no config.json, no manifest)."""
    d.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, d / "model.safetensors")
    return d


def leaf_diffs(a: object, b: object, path: str = "") -> set[str]:
    """Dotted paths where two JSON values differ (a dict's missing key counts as None)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(leaf_diffs(a.get(k), b.get(k), f"{path}.{k}".lstrip(".")) for k in set(a) | set(b)))
    return set() if a == b else {path}


def files_of(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def assert_same_output(from_dir: Path, from_memory: Path) -> None:
    """Every file byte-identical except the two that say how the draft was read."""
    a, b = files_of(from_dir), files_of(from_memory)
    assert set(a) == set(b)
    assert {n for n in a if a[n] != b[n]} <= {"ckpt_manifest.json", "stitch-report.json"}
    ma, mb = (json.loads(x["ckpt_manifest.json"]) for x in (a, b))
    # file_stats: the inodes and mtimes of each run's own files
    assert {d for d in leaf_diffs(ma, mb) if not d.startswith("file_stats.")} == MANIFEST_DIFFERS
    assert (ma["draft"]["reader"], mb["draft"]["reader"]) == ("safetensors", "memory")
    assert mb["draft"]["path"] == mb["inputs"]["draft"]["root"] == ROOT
    ra, rb = (json.loads(x["stitch-report.json"]) for x in (a, b))
    assert leaf_diffs(ra, rb) == {"draft.reader"}


@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_in_memory_stitch_is_byte_identical_to_stitching_the_saved_draft(fmt, verifier, extracted, tmp_path):
    state = finetuned(extracted[fmt], fmt)
    on_disk = saved(state, tmp_path / "draft")
    ckpt("stitch", on_disk, verifier, "-o", tmp_path / "from_dir", "--arch", FAMILY)
    command = json.loads((tmp_path / "from_dir" / "ckpt_manifest.json").read_text())["command"]
    report = stitch(state, verifier, tmp_path / "from_memory", arch=FAMILY, command=command)
    assert_same_output(tmp_path / "from_dir", tmp_path / "from_memory")
    changed = {t["key"] for t in report.to_json()["tensors"] if t["status"] == "replaced"}
    assert len(changed) == len(TOUCHED[fmt]), changed  # the finetune shows, nothing else moved


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view: a matrix stored column-major, a vector every other element."""
    if t.dim() >= 2 and min(t.shape[-2:]) > 1:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    wide = torch.zeros(2 * t.numel(), dtype=t.dtype)
    wide[::2] = t.reshape(-1)
    return wide[::2].view(t.shape)


def c_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_strided_tensors_of_any_float_dtype_stitch_as_their_values(dtype, verifier, extracted, tmp_path):
    state = {k: v.to(dtype) for k, v in finetuned(extracted["native"], "native").items()}
    views = {k: strided(v) for k, v in state.items()}
    assert not any(v.is_contiguous() for v in views.values())
    with Checkpoint.open(views) as c:
        assert {k: bytes(r.read()) for k, r in c.tensors.items()} == {k: c_bytes(v) for k, v in state.items()}
        assert {k: r.dtype for k, r in c.tensors.items()} == dict.fromkeys(state, {
            torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype])
    # the draft's own dtype kept, so its bytes reach the output as they are
    on_disk = saved(state, tmp_path / "draft")
    ckpt("stitch", on_disk, verifier, "-o", tmp_path / "from_dir", "--arch", FAMILY, "--dtype", "draft")
    command = json.loads((tmp_path / "from_dir" / "ckpt_manifest.json").read_text())["command"]
    stitch(views, verifier, tmp_path / "from_memory", arch=FAMILY, dtype="draft", command=command)
    assert_same_output(tmp_path / "from_dir", tmp_path / "from_memory")
    out = Checkpoint.open(tmp_path / "from_memory")
    for key in TOUCHED["native"]:
        assert torch.equal(out.tensors[key].torch(), state[key])
    out.close()


def complex_half() -> torch.Tensor:
    """A dtype safetensors cannot store (torch warns that it is experimental)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.zeros(3, dtype=torch.complex32)


def test_non_float_tensors_and_non_tensors_are_refused_naming_the_key(verifier, extracted, tmp_path):
    state = finetuned(extracted["native"], "native")
    ints = {**state, "mtp.fc.weight": state["mtp.fc.weight"].to(torch.int32)}
    with pytest.raises(InputError) as e:
        stitch(ints, verifier, tmp_path / "out", arch=FAMILY)
    r = ckpt("stitch", saved(ints, tmp_path / "ints"), verifier, "-o", tmp_path / "out", "--arch", FAMILY, code=3)
    assert e.value.rule == "draft-dtype" and "[draft-dtype]" in r.output  # the policy of a directory
    assert "mtp.fc.weight" in str(e.value) and "I32" in str(e.value)
    assert e.value.key == "mtp.fc.weight"  # the exception carries the key it refused (the verifier's name)
    sparse = torch.eye(3).to_sparse()
    refused = [("mtp.norm.weight", [1.0, 2.0], "not-a-state-dict"), (7, torch.zeros(3), "not-a-state-dict"),
               ("mtp.extra", complex_half(), "unsupported-dtype"),
               ("mtp.extra", sparse, "unsupported-tensor"),
               ("mtp.extra", torch.zeros(3, device="meta"), "unsupported-tensor")]
    for key, value, rule in refused:
        with pytest.raises(InputError) as e:
            stitch({**state, key: value}, verifier, tmp_path / "out", arch=FAMILY)
        assert (e.value.rule, e.value.key) == (rule, key if isinstance(key, str) else repr(key)), e.value
        assert repr(key) in str(e.value)
    with pytest.raises(InputError) as e:
        Checkpoint.open({})
    assert e.value.rule == "no-weights"
    assert not (tmp_path / "out").exists()


def test_gate_prefix_and_divergence_are_those_of_a_directory(verifier, extracted, tmp_path):
    state = finetuned(extracted["native"], "native")
    # no config.json and no manifest: the family must be asserted, as for a trainer's output directory
    on_disk = saved(state, tmp_path / "plain")
    r = ckpt("stitch", on_disk, verifier, "-o", tmp_path / "x", code=3)
    with pytest.raises(InputError) as e:
        stitch(state, verifier, tmp_path / "x")
    assert e.value.rule == "draft-unproven" and "[draft-unproven]" in r.output
    # a wrapped module's keys: the prefix is stripped and said so
    wrapped = {f"module.{k}": v for k, v in state.items()}
    ckpt("stitch", saved(wrapped, tmp_path / "wrapped"), verifier, "-o", tmp_path / "from_dir", "--arch", FAMILY)
    command = json.loads((tmp_path / "from_dir" / "ckpt_manifest.json").read_text())["command"]
    report = stitch(wrapped, verifier, tmp_path / "from_memory", arch=FAMILY, command=command)
    assert report.draft["prefix_stripped"]["prefix"] == "module."
    assert_same_output(tmp_path / "from_dir", tmp_path / "from_memory")
    # another model's weights are divergent, not a finetune
    fc = state["mtp.fc.weight"]
    other = {**state, "mtp.fc.weight": torch.randn(fc.shape, generator=torch.Generator().manual_seed(0)).to(fc.dtype)}
    r = ckpt("stitch", saved(other, tmp_path / "other"), verifier, "-o", tmp_path / "y", "--arch", FAMILY, code=3)
    with pytest.raises(InputError) as e:
        stitch(other, verifier, tmp_path / "y", arch=FAMILY)
    assert e.value.rule == "divergent" and "[divergent]" in r.output and "mtp.fc.weight" in str(e.value)
    assert not (tmp_path / "y").exists()


def test_reading_goes_tensor_by_tensor_without_copying_the_mapping(verifier, extracted, tmp_path, monkeypatch):
    state = finetuned(extracted["native"], "native")
    with Checkpoint.open(state) as c:  # contiguous CPU tensors: read where they lie, no copy made
        held = dict(zip(c.shard_keys[FILE], c.sources[FILE].parts, strict=True))
        assert all(held[k].tensor.data_ptr() == v.data_ptr() for k, v in state.items())
    views = {k: strided(v) for k, v in state.items()}  # the worst case: every read must copy
    largest = max(v.numel() * v.element_size() for v in views.values())
    copies: list[int] = []
    for name in ("contiguous", "cpu", "clone"):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, **kwargs):
            out = _real(self, *args, **kwargs)
            if out.data_ptr() != self.data_ptr():
                copies.append(out.numel() * out.element_size())
            return out

        monkeypatch.setattr(torch.Tensor, name, spy)
    c = Checkpoint.open(views)
    assert copies == []  # opening reads nothing
    c.close()
    stitch(views, verifier, tmp_path / "out", arch=FAMILY)
    assert copies and max(copies) <= largest  # copies were made, each at most one tensor
    assert sum(copies) >= sum(v.numel() * v.element_size() for v in views.values())  # and every tensor was read


def test_diff_opens_a_mapping_like_the_saved_draft(extracted, tmp_path):
    state = finetuned(extracted["native"], "native")
    before = extracted["native"].parent
    with Checkpoint.open(before) as x, Checkpoint.open(state) as m:
        in_memory = diff(x, m, stats=True).to_json()
    with Checkpoint.open(before) as x, Checkpoint.open(saved(state, tmp_path / "draft")) as d:
        on_disk = diff(x, d, stats=True).to_json()
    assert {t["key"] for t in in_memory["tensors"]} == set(TOUCHED["native"])
    assert leaf_diffs(in_memory, on_disk) == {"b", "readers.b.reader"}
    assert (in_memory["b"], in_memory["readers"]["b"]["reader"]) == (ROOT, "memory")


def test_probe_measures_a_mapping_like_the_saved_draft(tmp_path):
    pytest.importorskip("transformers")
    import probe_model

    from ckpt_tools.ops.probe import probe as probe_ops
    from ckpt_tools.ops.stitch.plan import mapped_draft

    trained, _ = probe_model.build(Path(tempfile.gettempdir()) / "ckpt-tools-test-cache")
    prompts = probe_model.write_prompts(tmp_path, 2, 6, seed=7)
    ckpt("extract", trained, "-o", tmp_path / "draft")
    state = load_file(tmp_path / "draft" / "model.safetensors")
    req = probe_ops.ProbeRequest(str(trained), [str(tmp_path / "draft"), state], str(prompts), max_new_tokens=8,
                                 arch="deepseek_v3", map_draft=mapped_draft)
    own, disk, memory = probe_ops.probe(req).to_json()["drafts"]
    assert memory["name"] == ROOT
    # the same measurement; only a draft on disk is named by its tensors' digest (a mapping has no files to push)
    assert memory["tensors"] is None and disk["tensors"]["tensors"] > 0
    skip = ("name", "tensors")
    assert {k: v for k, v in memory.items() if k not in skip} == {k: v for k, v in disk.items() if k not in skip}
    assert memory["agreement"] == own["agreement"]  # the verifier's own MTP, unchanged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensors_stitch_like_cpu_ones(verifier, extracted, tmp_path):
    state = finetuned(extracted["native"], "native")
    command = "ckpt stitch"
    stitch(state, verifier, tmp_path / "cpu", arch=FAMILY, command=command)
    stitch({k: strided(v).cuda() for k, v in state.items()}, verifier, tmp_path / "gpu", arch=FAMILY,
               command=command)
    assert files_of(tmp_path / "cpu") == files_of(tmp_path / "gpu")


def test_resume_with_another_state_dict_is_refused(verifier, extracted, tmp_path, monkeypatch):
    """--resume proves the same draft bytes for a state dict too: its tensors are fingerprinted, not its name."""
    import ckpt_tools.stream.targets.local as w

    first = finetuned(extracted["native"], "native")
    out = tmp_path / "out"
    orig, left = w.copy_whole_file, [2]

    def interrupted(*a, **k):
        orig(*a, **k)
        left[0] -= 1
        if left[0] == 0:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(w, "copy_whole_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            stitch(first, verifier, out, arch=FAMILY)
    other = {k: v.clone() for k, v in first.items()}
    key = TOUCHED["native"][0]
    other[key] = other[key] + 1e-2  # same names, shapes and dtypes: only the bytes differ
    with pytest.raises(OutputError) as e:
        stitch(other, verifier, out, arch=FAMILY, resume=True)
    assert e.value.rule == "resume-mismatch"
    stitch(first, verifier, out, arch=FAMILY, resume=True)  # the same state dict finishes the job
    assert (out / "model.safetensors.index.json").is_file()
