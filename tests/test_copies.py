"""Per-layer embed / head copies that a family's engines take from the trunk are optional (issue 15).

A DeepSeek-V3 checkpoint without them (as SGLang's NextN export and GLM-4.6-style releases leave
it) validates with a note, not a problem; extracts with and without --with-embed / --with-head,
carrying the trunk's tensors and saying so; stitches without inventing copies, while a verifier
that has them keeps them; and pushes. A copy the table requires (LongCat's own embedding) is
still a problem. transformers' MtpModel on such a checkpoint: tests/test_consumer_transformers.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.ops.check.validate import validate

from conftest import run_ckpt as ckpt
from hubserver import serve_hub

MTP = "model.layers.3."  # deepseek_v3 fixture: 3 trunk layers
COPIES = [MTP + "embed_tokens.weight", MTP + "shared_head.head.weight"]
TRUNK = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
INDEX = "model.safetensors.index.json"


@pytest.fixture
def bare(make_fixture) -> Path:
    return make_fixture("deepseek_v3", with_optional=False)


@pytest.fixture
def shipped(make_fixture) -> Path:
    return make_fixture("deepseek_v3")


def weight_map(d: Path) -> dict[str, str]:
    return json.loads((d / INDEX).read_text())["weight_map"]


def tensor(d: Path, key: str) -> torch.Tensor:
    with safe_open(str(d / weight_map(d)[key]), "pt") as f:
        return f.get_tensor(key)


def perturb(d: Path, keys: list[str]) -> None:
    """Small noise on ``keys`` in the draft's files (a finetuned draft)."""
    rng = np.random.default_rng(0)
    for f in d.glob("*.safetensors"):
        tensors = load_file(str(f))
        for k in set(keys) & set(tensors):
            noise = torch.from_numpy(rng.standard_normal(tuple(tensors[k].shape)).astype(np.float32)) * 0.01
            tensors[k] = (tensors[k].float() + noise).to(tensors[k].dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})


def changed(a: Path, b: Path) -> set[str]:
    diff = json.loads(ckpt("diff", a, b, "--json", code=None).output)
    return {t["key"] for t in diff["tensors"]}


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_absent_copies_are_notes_not_problems(family, make_fixture):
    d = make_fixture(family, with_optional=False)
    report = validate(d)
    assert report.ok and report.problems == []
    assert [(n.rule, n.key) for n in report.notes] == [("copy-absent", k) for k in COPIES]
    for note, trunk in zip(report.notes, TRUNK.values(), strict=True):
        assert f"take the trunk's {trunk}" in note.message
    j = json.loads(ckpt("validate", d, "--json").stdout)
    assert j["ok"] is True and j["problems"] == [] and j["counts"] == {}
    assert [n["key"] for n in j["notes"]] == COPIES
    human = ckpt("validate", d).stdout
    assert human.count("copy-absent") == 2 and "valid" in human
    assert validate(make_fixture(family)).notes == []  # the release layout: nothing to say


def test_a_required_copy_is_still_a_problem(make_fixture, tmp_path):
    # LongCat's MTP embedding: vLLM's loader reads only model.mtp.*, so the table requires it
    d = tmp_path / "longcat"
    shutil.copytree(make_fixture("longcat_flash"), d)
    key = "model.mtp.embed_tokens.weight"
    index = json.loads((d / INDEX).read_text())
    shard = d / index["weight_map"].pop(key)
    tensors = load_file(str(shard))
    index["metadata"]["total_size"] -= tensors.pop(key).nbytes
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (d / INDEX).write_text(json.dumps(index))
    report = validate(d)
    assert [(p.rule, p.key) for p in report.problems] == [("mtp-missing", key)] and report.notes == []
    assert "[mtp-missing]" in ckpt("extract", d, "-o", tmp_path / "x", code=3).output


@pytest.mark.parametrize(("flags", "carried"), [
    ((), {}),
    (("--no-embed", "--no-head"), {}),
    (("--with-embed",), {"embed": TRUNK["embed"]}),
    (("--with-embed", "--with-head"), TRUNK),
])
def test_extract_without_copies_takes_the_trunks_tensors_and_says_so(bare, tmp_path, flags, carried):
    out = tmp_path / "draft"
    report = json.loads(ckpt("extract", bare, "-o", out, *flags, "--json").stdout)
    assert report["shared_from_trunk"] == carried
    assert json.loads((out / "ckpt_manifest.json").read_text())["shared_from_trunk"] == carried
    keys = set(weight_map(out)) if (out / INDEX).exists() else set(load_file(str(out / "model.safetensors")))
    mtp = {k for k in weight_map(bare) if k.startswith(MTP)}
    assert keys == mtp | set(carried.values())
    for key in carried.values():
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor(key), tensor(bare, key))
    if carried:
        human = ckpt("extract", bare, "-o", tmp_path / "again", *flags).stdout
        assert all(f"carried the trunk's {k}" in " ".join(human.split()) for k in carried.values())


def test_extract_with_copies_carries_the_copies(shipped, tmp_path):
    out = tmp_path / "draft"
    report = json.loads(ckpt("extract", shipped, "-o", out, "--with-embed", "--with-head", "--json").stdout)
    assert report["shared_from_trunk"] == {}
    assert set(COPIES) <= set(load_file(str(out / "model.safetensors")))


def test_stitch_never_invents_copies(bare, shipped, tmp_path):
    # a finetuned draft from the release layout, its copies changed too, into a verifier without copies
    draft = tmp_path / "draft"
    ckpt("extract", shipped, "-o", draft)
    perturb(draft, [MTP + "eh_proj.weight", *COPIES])
    for extra in ((), ("--update-copies",)):
        out = tmp_path / f"out{len(extra)}"
        report = json.loads(ckpt("stitch", draft, bare, "-o", out, *extra, "--json").stdout)
        assert report["absent_copies"] == COPIES and report["kept_copies"] == []
        assert set(COPIES) <= set(report["ignored_draft_keys"])
        assert not set(COPIES) & set(weight_map(out))
        assert changed(bare, out) == {MTP + "eh_proj.weight"}
    human = ckpt("stitch", draft, bare, "-o", tmp_path / "human").stdout
    assert "the verifier does not have, left out" in human
    # add mode into the trunk of a checkpoint without copies gives that checkpoint back, no copy added
    trunk, plain, added = tmp_path / "trunk", tmp_path / "plain", tmp_path / "added"
    ckpt("extract", bare, "-o", trunk, "--drop-mtp")
    ckpt("extract", bare, "-o", plain)
    report = json.loads(ckpt("stitch", plain, trunk, "-o", added, "--json").stdout)
    assert report["mode"] == "add" and report["absent_copies"] == COPIES
    assert changed(bare, added) == set() and not set(COPIES) & set(weight_map(added))


def test_stitch_keeps_the_copies_the_verifier_has(bare, shipped, tmp_path):
    # a draft from the checkpoint without copies, carrying the trunk's embedding / head by their names
    draft, out = tmp_path / "draft", tmp_path / "out"
    ckpt("extract", bare, "-o", draft, "--with-embed", "--with-head")
    perturb(draft, [MTP + "eh_proj.weight", *TRUNK.values()])
    report = json.loads(ckpt("stitch", draft, shipped, "-o", out, "--json").stdout)
    assert report["kept_copies"] == COPIES and report["absent_copies"] == []
    assert set(TRUNK.values()) <= set(report["ignored_draft_keys"])
    assert changed(shipped, out) == {MTP + "eh_proj.weight"}  # copies and trunk byte-identical


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


def test_push_accepts_a_checkpoint_without_copies(bare, hub, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(bare, d)
    (d / "README.md").unlink()
    ckpt("push", d, "me/nocopies")
    card = hub.state.files("me/nocopies")["README.md"].decode()
    assert "found no problems" in card and card.count("has no per-layer copy") == 2
