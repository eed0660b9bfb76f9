"""`ckpt stitch` and `ckpt diff`: exact round trips for every family, format and expert layout;
perturbed drafts change exactly what they should; every error leaves the verifier untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.errors import InputError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.formats import all_formats, check_expressible, get_format
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.tables.loader import all_tables

from conftest import run_ckpt as ckpt
from conftest import tree_hash

MTP_FAMILIES = sorted(f for f, t in all_tables().items() if t.kind == "mtp")


def formats_for(path: Path) -> list[str]:
    view = open_mtp(Checkpoint.open(path))
    out = []
    for name, fmt in sorted(all_formats().items()):
        try:
            check_expressible(fmt, view, [0])
        except InputError:
            continue
        out.append(name)
    return out


def has_experts(family: str) -> bool:
    return any(it.experts is not None for items in all_tables()[family].parts.values() for it in items)


CASES = []
for fam in MTP_FAMILIES:
    CASES.append((fam, None))
    if has_experts(fam):
        CASES.append((fam, "fused" if all_tables()[fam].parts and fam != "qwen3_5_moe" else "per-expert"))


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_untouched_round_trip_is_byte_identical(family, layout, make_fixture, tmp_path):
    verifier = make_fixture(family, **({"expert_layout": layout} if layout else {}))
    before = tree_hash(verifier)
    for fmt in formats_for(verifier):
        if fmt != "native" and open_mtp(Checkpoint.open(verifier)).count > 1:
            layers = ["--layers", "0"]
        else:
            layers = []
        draft = tmp_path / f"draft-{fmt}"
        ckpt("extract", verifier, "-o", draft, "--format", fmt, *layers)
        out = tmp_path / f"out-{fmt}"
        ckpt("stitch", draft, verifier, "-o", out, *(["--allow-partial"] if layers else []))
        r = ckpt("diff", verifier, out, "--json")
        assert json.loads(r.output)["identical"] is True, (fmt, r.output)
        for f in verifier.iterdir():  # the files themselves come out byte-identical
            assert (out / f.name).read_bytes() == f.read_bytes(), (fmt, f.name)
    assert tree_hash(verifier) == before


def _perturb(draft: Path, keys: list[str], rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Add noise to ``keys`` in the draft's files; return the new values."""
    new = {}
    for f in draft.glob("*.safetensors"):
        tensors = load_file(str(f))
        hit = False
        for k in keys:
            if k in tensors:
                t = tensors[k]
                noise = torch.from_numpy(rng.standard_normal(tuple(t.shape)).astype(np.float32)) * 0.01
                tensors[k] = (t.float() + noise).to(t.dtype)
                new[k] = tensors[k]
                hit = True
        if hit:
            save_file(tensors, str(f), metadata={"format": "pt"})
    assert set(new) == set(keys)
    return new


@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_perturbed_draft_changes_exactly_those_tensors(fmt, make_fixture, tmp_path):
    verifier = make_fixture("qwen3_next")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft, "--format", fmt)
    if fmt == "native":
        keys = {"mtp.fc.weight": "mtp.fc.weight",
                "mtp.layers.0.mlp.experts.2.up_proj.weight": "mtp.layers.0.mlp.experts.2.up_proj.weight"}
    else:
        keys = {"mtp_layers.0.input_proj.weight": "mtp.fc.weight",
                "mtp_layers.0.self_attn.k_proj.weight": "mtp.layers.0.self_attn.k_proj.weight"}
    new = _perturb(draft, list(keys), np.random.default_rng(1))
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    report = json.loads((out / "stitch-report.json").read_text())
    replaced = {t["key"]: t for t in report["tensors"] if t["status"] == "replaced"}
    assert set(replaced) == set(keys.values())
    for dkey, vkey in keys.items():
        a = load_from(verifier, vkey).double().numpy()
        b = new[dkey].double().numpy()
        got = replaced[vkey]
        assert got["max_abs"] == pytest.approx(np.abs(a - b).max(), rel=1e-6)
        assert got["rel_l2"] == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(a), rel=1e-6)
        cos = (a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b))
        assert got["cosine"] == pytest.approx(cos, rel=1e-6)
        assert torch.equal(load_from(out, vkey), new[dkey])
    diff = json.loads(ckpt("diff", verifier, out, "--json", code=1).output)
    assert {t["key"] for t in diff["tensors"]} == set(keys.values())
    assert report["validation"]["ok"] is True


def load_from(path: Path, key: str) -> torch.Tensor:
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            if key in fh.keys():
                return fh.get_tensor(key)
    raise KeyError(key)


def test_perturbed_speculators_experts_unfuse_into_the_verifier_layout(make_fixture, tmp_path):
    verifier = make_fixture("qwen3_next")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft, "--format", "speculators")
    new = _perturb(draft, ["mtp_layers.0.mlp.experts.gate_up_proj"], np.random.default_rng(2))
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    fused = new["mtp_layers.0.mlp.experts.gate_up_proj"]
    inter = fused.shape[1] // 2
    for e in range(fused.shape[0]):
        assert torch.equal(load_from(out, f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"), fused[e, :inter])
        assert torch.equal(load_from(out, f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"), fused[e, inter:])
    keys = set(Checkpoint.open(out).tensors)
    assert not any("gate_up_proj" in k for k in keys)  # no stale fused tensor beside per-expert ones


def test_fp32_draft_is_cast_to_the_verifier_dtype(make_fixture, tmp_path):
    verifier = make_fixture("deepseek_v3")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft, "--dtype", "fp32")
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    assert json.loads(ckpt("diff", verifier, out, "--json").output)["identical"] is True
    kept = tmp_path / "kept"
    ckpt("stitch", draft, verifier, "-o", kept, "--dtype", "draft")
    c = Checkpoint.open(kept)
    assert c.tensors["model.layers.3.eh_proj.weight"].dtype == "F32"
    index = json.loads((kept / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(r.nbytes for r in c.tensors.values())


def test_add_mode_into_a_trunk_restores_the_checkpoint(make_fixture, tmp_path):
    full = make_fixture("glm4_moe" if "glm4_moe" in all_tables() else "deepseek_v3")
    draft, trunk, out = tmp_path / "draft", tmp_path / "trunk", tmp_path / "out"
    ckpt("extract", full, "-o", draft)
    ckpt("extract", full, "-o", trunk, "--drop-mtp")
    r = json.loads(ckpt("stitch", draft, trunk, "-o", out, "--json").output)
    assert r["mode"] == "add" and r["new_shards"]
    assert json.loads(ckpt("diff", full, out, "--json").output)["identical"] is True
    assert json.loads((out / "config.json").read_text()) == json.loads((full / "config.json").read_text())


def test_hardlink_mode_links_untouched_shards(make_fixture, tmp_path):
    verifier = make_fixture("deepseek_v3")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    _perturb(draft, ["model.layers.3.hnorm.weight"], np.random.default_rng(3))
    out = tmp_path / "out"
    r = json.loads(ckpt("stitch", draft, verifier, "-o", out, "--link", "hardlink", "--json").output)
    for shard in r["linked_files"]:
        assert (out / shard).stat().st_ino == (verifier / shard).stat().st_ino
    for shard in r["rewritten_shards"]:
        assert (out / shard).stat().st_ino != (verifier / shard).stat().st_ino


def test_hardlink_report_says_which_linked_shards_were_hashed_and_why(make_fixture, tmp_path):
    """A link moves no bytes, yet the manifest lists each linked shard's digest: a verifier without a manifest has
    every linked shard read once, and the report says so (issue 43); one whose manifest describes its files gives
    their digests, and nothing is hashed."""
    verifier = make_fixture("deepseek_v3")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    _perturb(draft, ["model.layers.3.hnorm.weight"], np.random.default_rng(3))
    first, second = tmp_path / "first", tmp_path / "second"
    r = ckpt("stitch", draft, verifier, "-o", first, "--link", "hardlink")
    links = json.loads((first / "stitch-report.json").read_text())["link_digests"]
    linked = json.loads((first / "stitch-report.json").read_text())["linked_files"]
    assert linked and sorted(links["hashed"]) == sorted(linked) and links["from_manifest"] == {}
    assert all("no ckpt_manifest.json" in why for why in links["hashed"].values())
    assert links["hashed_bytes"] == sum((verifier / n).stat().st_size for n in linked)
    assert "linked shards hashed for the manifest" in r.output
    ckpt("stitch", draft, first, "-o", second, "--link", "hardlink", "--report", tmp_path / "r.json")
    again = json.loads((tmp_path / "r.json").read_text())
    links = again["link_digests"]
    assert links["hashed"] == {} and sorted(links["from_manifest"]) == sorted(again["linked_files"])
    assert set(linked) <= set(again["linked_files"])
    ckpt("verify-manifest", second)


def test_run_is_the_command_without_rendering(make_fixture, tmp_path):
    """api.stitch: the CLI's options as keywords, its --json as ``report.to_json()``, one decision per key,
    and errors as exceptions (nothing written)."""
    from ckpt_tools.api import stitch
    from ckpt_tools.errors import UsageError

    verifier = make_fixture("deepseek_v3")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    _perturb(draft, ["model.layers.3.eh_proj.weight"], np.random.default_rng(5))
    cli = json.loads(ckpt("stitch", draft, verifier, "-o", tmp_path / "a", "--json").output)
    rep = stitch(draft, verifier, tmp_path / "b").details
    assert rep.to_json() == cli == json.loads((tmp_path / "b" / "stitch-report.json").read_text())
    assert [d.stats for d in rep.decisions] == rep.diffs
    actions = {d.key: d.action for d in rep.decisions}
    assert actions.pop("model.layers.3.eh_proj.weight") == "replace" and set(actions.values()) == {"identical"}
    with pytest.raises(UsageError, match="--mode"):
        stitch(draft, verifier, tmp_path / "c", mode="sideways")
    with pytest.raises(InputError, match="no such checkpoint"):
        stitch(tmp_path / "nothing", verifier, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    trunk = tmp_path / "trunk"
    ckpt("extract", verifier, "-o", trunk, "--drop-mtp")
    added = stitch(draft, trunk, tmp_path / "d", dry_run=True).details
    assert added.mode == "add" and {d.action for d in added.decisions} == {"add"} and not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------
# errors: each leaves the verifier byte-identical and no completed output


@pytest.fixture
def qn(make_fixture, tmp_path):
    verifier = make_fixture("qwen3_next")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    return verifier, draft, tree_hash(verifier)


def _edit(draft: Path, fn) -> None:
    f = draft / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _fails(verifier, draft, before, tmp_path, rule: str, *extra):
    out = tmp_path / "out"
    r = ckpt("stitch", draft, verifier, "-o", out, *extra, code=None)
    assert r.exit_code != 0 and rule in r.output, r.output
    assert tree_hash(verifier) == before
    assert not (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    return r


def test_missing_tensor(qn, tmp_path):
    verifier, draft, before = qn
    _edit(draft, lambda t: t.pop("mtp.norm.weight"))
    r = _fails(verifier, draft, before, tmp_path, "mtp.norm.weight")
    assert "draft-mismatch" in r.output
    ok = tmp_path / "partial"
    rep = json.loads(ckpt("stitch", draft, verifier, "-o", ok, "--allow-partial", "--json").output)
    assert rep["kept_from_verifier"] == ["mtp.norm.weight"]
    assert "mtp.norm.weight" not in {t["key"] for t in rep["tensors"]}  # not compared: nothing replaces it
    kept = Checkpoint.open(ok).tensors["mtp.norm.weight"]
    assert kept.read() == Checkpoint.open(verifier).tensors["mtp.norm.weight"].read()  # the verifier's bytes


def test_extra_tensor(qn, tmp_path):
    verifier, draft, before = qn
    _edit(draft, lambda t: t.__setitem__("mtp.layers.0.bogus.weight", torch.zeros(2)))
    _fails(verifier, draft, before, tmp_path, "mtp.layers.0.bogus.weight")


def test_wrong_shape(qn, tmp_path):
    verifier, draft, before = qn
    _edit(draft, lambda t: t.__setitem__("mtp.fc.weight", torch.zeros(3, 3, dtype=torch.bfloat16)))
    _fails(verifier, draft, before, tmp_path, "shape mismatch")


def test_nan_in_draft(qn, tmp_path):
    verifier, draft, before = qn

    def poison(t):
        w = t["mtp.layers.0.self_attn.o_proj.weight"].clone()
        w[0, 0] = float("nan")
        t["mtp.layers.0.self_attn.o_proj.weight"] = w

    _edit(draft, poison)
    _fails(verifier, draft, before, tmp_path, "nonfinite")


def test_wrong_family(qn, make_fixture, tmp_path):
    verifier, draft, before = qn
    other = make_fixture("deepseek_v3")
    before_other = tree_hash(other)
    r = ckpt("stitch", draft, other, "-o", tmp_path / "out", code=3)
    assert "wrong-family" in r.output
    assert tree_hash(other) == before_other


def test_output_dir_not_empty(qn, tmp_path):
    verifier, draft, before = qn
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    r = ckpt("stitch", draft, verifier, "-o", out, code=4)
    assert "not empty" in r.output and (out / "x").read_text() == "x"
    assert tree_hash(verifier) == before


def test_verifier_as_output_is_refused(qn, tmp_path):
    verifier, draft, before = qn
    work = tmp_path / "v"
    shutil.copytree(verifier, work)
    h = tree_hash(work)
    r = ckpt("stitch", draft, work, "-o", work, "--overwrite", code=None)
    assert r.exit_code != 0
    assert tree_hash(work) == h


def test_speculators_nan_placeholder_head_is_ignored_not_stitched(make_fixture, tmp_path):
    verifier = make_fixture("qwen3_next")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft, "--format", "speculators")
    _edit(draft, lambda t: t.__setitem__("verifier_lm_head.weight", torch.full((256, 64), float("nan"))))
    out = tmp_path / "out"
    rep = json.loads(ckpt("stitch", draft, verifier, "-o", out, "--json").output)
    assert "verifier_lm_head.weight" in rep["ignored_draft_keys"]
    assert json.loads(ckpt("diff", verifier, out, "--json").output)["identical"] is True


def test_diff_keys_filter_and_exit_codes(make_fixture, tmp_path):
    a = make_fixture("deepseek_v3")
    b = make_fixture("deepseek_v3", seed=1)
    ckpt("diff", a, a, code=0)
    r = json.loads(ckpt("diff", a, b, "--keys", r"^model\.layers\.3\.", "--json", code=1).output)
    assert r["tensors"] and all(t["key"].startswith("model.layers.3.") for t in r["tensors"])
    assert get_format("native").rename == "native"


def test_diff_table_is_capped_but_json_and_all_list_every_key(make_fixture):
    from ckpt_tools.cli.summary import MAX_ROWS

    a = make_fixture("deepseek_v3")
    b = make_fixture("deepseek_v3", seed=1)
    changed = json.loads(ckpt("diff", a, b, "--json", code=1).output)["tensors"]
    assert len(changed) > MAX_ROWS
    capped = ckpt("diff", a, b, code=1).output
    assert f"... and {len(changed) - MAX_ROWS} more changed tensors" in capped
    full = ckpt("diff", a, b, "--all", code=1).output
    assert "more changed tensors" not in full and changed[-1]["key"].split(".")[-1] in full
