"""The benchmark harness cannot rot: a tiny end-to-end run plus checks of its parts.

The large benchmark (1 GB / 4 GB) is not part of the tests; see BENCHMARKS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import floor, layout, naive  # noqa: E402
from benchmarks.measure import run as measure  # noqa: E402
from benchmarks.synth import generate, solve  # noqa: E402
from ckpt_tools.testing import FixtureOptions, make_checkpoint  # noqa: E402

TINY = 2 * 10**6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sizing = solve("qwen3_next", TINY)
    root = tmp_path_factory.mktemp("bench")
    return sizing, {v: generate("qwen3_next", sizing, v, root / v, shards=4) for v in ("bf16", "fused", "fp8")}


def read_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def test_sizing_hits_size_and_mtp_share_with_shapes_fixed_across_sizes():
    one, four = solve("qwen3_next", 10**9), solve("qwen3_next", 4 * 10**9)
    for s, target in ((one, 10**9), (four, 4 * 10**9)):
        assert abs(s.total / target - 1) < 0.1
        assert 0.08 <= s.mtp_share <= 0.12
    assert one.hidden == four.hidden  # same tensor shapes: RSS comparable across sizes
    assert four.experts * four.layers > one.experts * one.layers


def test_synthetic_checkpoint_matches_the_fixture_generator(tiny, tmp_path):
    """Same keys, dtypes and shapes as make_checkpoint (safetensors.save_file) for the same config."""
    sizing, syn = tiny
    for variant, opts in (("bf16", {}), ("fused", {"expert_layout": "fused"}), ("fp8", {"fp8": True})):
        ref = make_checkpoint("qwen3_next", tmp_path / variant,
                              FixtureOptions(config_overrides=sizing.overrides, num_shards=4, **opts))
        ours, theirs = layout.extents(syn[variant].path), layout.extents(ref)
        assert {k: (e.dtype, e.shape) for k, e in ours.items()} == {k: (e.dtype, e.shape) for k, e in theirs.items()}
        for t in read_all(syn[variant].path).values():
            assert torch.isfinite(t.float()).all()  # BF16 exponents sane, no FP8 NaN encodings
        index = json.loads((syn[variant].path / layout.INDEX).read_text())
        assert index["metadata"]["total_size"] == sum(e.length for e in ours.values())
    mtp_shards = {layout.extents(syn["bf16"].path)[k].file for k in syn["bf16"].mtp_keys}
    assert len(mtp_shards) == 2  # MTP straddles a shard boundary, like real releases
    assert any(k.endswith("weight_scale_inv") for k in syn["fp8"].mtp_keys)


def test_floor_copies_exactly_the_mtp_bytes(tiny, tmp_path):
    _, syn = tiny
    ext = layout.extents(syn["bf16"].path)
    mtp = [ext[k] for k in syn["bf16"].mtp_keys]
    out = tmp_path / "floor" / "model.safetensors"
    n = floor.run_job({"files": [{"path": str(out), "pieces": layout.pieces(mtp)}]}, fsync=True)
    assert n == sum(e.length for e in mtp)
    expected = b""
    for e in sorted(mtp, key=lambda e: (e.file, e.offset)):
        with open(e.file, "rb") as f:
            f.seek(e.offset)
            expected += f.read(e.length)
    assert out.read_bytes() == expected


def test_naive_baselines_do_the_job(tiny, tmp_path):
    _, syn = tiny
    bf16, fused = read_all(syn["bf16"].path), read_all(syn["fused"].path)
    naive.extract({"src": str(syn["bf16"].path), "keys": syn["bf16"].mtp_keys, "out": str(tmp_path / "x")})
    got = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert set(got) == set(syn["bf16"].mtp_keys) and all(torch.equal(got[k], bf16[k]) for k in got)

    naive.main([str(_job(tmp_path, op="fuse", src=str(syn["bf16"].path), out=str(tmp_path / "f")))])
    f = read_all(tmp_path / "f")
    assert {k: t.shape for k, t in f.items()} == {k: t.shape for k, t in fused.items()}
    gu = next(k for k in f if k.endswith("mlp.experts.gate_up_proj"))
    p = gu[: -len("gate_up_proj")]
    assert torch.equal(f[gu][1], torch.cat([bf16[p + "1.gate_proj.weight"], bf16[p + "1.up_proj.weight"]]))

    naive.main([str(_job(tmp_path, op="unfuse", src=str(tmp_path / "f"), out=str(tmp_path / "u")))])
    u = read_all(tmp_path / "u")
    assert set(u) == set(bf16) and all(torch.equal(u[k], bf16[k]) for k in u)

    naive.extract({"src": str(syn["fp8"].path), "keys": syn["fp8"].mtp_keys, "out": str(tmp_path / "d"),
                   "dequant": True})
    d = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert not any(k.endswith("scale_inv") for k in d) and all(t.dtype == torch.bfloat16 for t in d.values())


def test_naive_stitch_replaces_only_mtp(tiny, tmp_path):
    sizing, syn = tiny
    verifier = syn["bf16"]
    draft = generate("qwen3_next", sizing, "bf16", tmp_path / "draft", seed=1, only=set(verifier.mtp_keys))
    naive.stitch({"draft": str(draft.path), "verifier": str(verifier.path), "out": str(tmp_path / "s"),
                  "link": "hardlink"})
    before, after, new = read_all(verifier.path), read_all(tmp_path / "s"), read_all(draft.path)
    assert set(after) == set(before)
    for k, t in after.items():
        assert torch.equal(t, new[k] if k in new else before[k])
    assert any(not torch.equal(new[k], before[k]) for k in new)


def test_measure_reports_the_childs_own_peak_rss(tmp_path):
    big = np.ones(50_000_000, dtype=np.uint8)  # this process is large; the child must not inherit that
    s = measure([sys.executable, "-c", "x = bytearray(120_000_000); x[::4096] = b'1' * len(x[::4096])"],
                log=tmp_path / "m.log")
    assert s.returncode == 0 and 120e6 < s.maxrss < 200e6 and s.wall > 0 and s.cpu > 0
    s = measure([sys.executable, "-c", "open(__import__('sys').argv[1], 'wb').write(b'x' * 3_000_000)",
                 str(tmp_path / "w")], log=tmp_path / "w.log")
    assert s.wchar >= 3_000_000
    assert measure(["false"], log=tmp_path / "f.log").returncode == 1
    del big


def test_harness_runs_end_to_end(tmp_path):
    """`python -m benchmarks run` on a tiny checkpoint: library path and CLI startup, floors, JSON, tables."""
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--size", "2MB", "--verbs", "startup,extract-lib", "--runs", "1",
         "--contenders", "floor", "--json", str(out), "--markdown", str(md), "--workdir", str(tmp_path / "wd")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    v = res["sizes"]["2MB"]["verbs"]["extract-lib"]
    runs = {c: v["contenders"][c]["runs"][0] for c in ("ckpt", "floor", "floor-raw")}
    assert all(run["returncode"] == 0 for run in runs.values()), runs
    mtp_bytes = runs["floor"]["output_bytes"]
    assert mtp_bytes > 0 and runs["floor-raw"]["output_bytes"] == mtp_bytes
    assert runs["ckpt"]["output_bytes"] > mtp_bytes  # tensors plus header, config, manifest
    assert v["ratios"]["floor"] > 0 and runs["ckpt"]["maxrss"] > 0
    startup = res["sizes"]["2MB"]["verbs"]["startup"]["contenders"]["ckpt"]
    assert startup["stats"]["n"] == 1, startup
    assert "extract-lib" in r.stdout, r.stdout
    assert "ckpt/floor" in md.read_text()
    assert not (tmp_path / "wd" / "size-2MB").exists()  # inputs and outputs cleaned up


def _job(tmp_path: Path, **job) -> Path:
    p = tmp_path / f"job-{job['op']}.json"
    p.write_text(json.dumps(job))
    return p


def test_table_command_renders_saved_results(tmp_path):
    res = {"date": "d", "runs": 1, "verbs": ["x"], "machine": {"cores": 2},
           "sizes": {"1MB": {"verbs": {"x": {"skipped": "not available"}}}}}
    (tmp_path / "r.json").write_text(json.dumps(res))
    r = subprocess.run([sys.executable, "-m", "benchmarks", "table", str(tmp_path / "r.json"), "--markdown"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "`x` skipped: not available" in r.stdout


def test_safetensors_reader_agrees_with_layout(tiny):
    _, syn = tiny
    ext = layout.extents(syn["bf16"].path)
    key = syn["bf16"].mtp_keys[0]
    e = ext[key]
    with safe_open(e.file, "pt") as f:
        t = f.get_tensor(key)
    with open(e.file, "rb") as f:
        f.seek(e.offset)
        assert f.read(e.length) == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_marginal_ratio_separates_fixed_cost_from_per_byte_cost():
    from benchmarks.report import marginal

    def size(ckpt: float, floor: float) -> dict:
        return {"contenders": {"ckpt": {"stats": {"wall": {"median": ckpt}}},
                               "floor": {"stats": {"wall": {"median": floor}}}}}

    # ckpt = 1.5 s + 1.2 x floor
    slope, fixed = marginal(size(1.5 + 1.2 * 2.0, 2.0), size(1.5 + 1.2 * 10.0, 10.0))
    assert slope == pytest.approx(1.2) and fixed == pytest.approx(1.5)
    assert marginal(size(3.0, 2.0), size(4.0, 2.0)) == (None, None)  # the floor did not grow


def test_merge_keeps_every_verb_of_a_size_and_takes_reruns_from_the_later_file():
    from benchmarks.report import merge

    def result(verbs: dict) -> dict:
        return {"date": "d", "runs": 3, "verbs": list(verbs), "machine": {},
                "sizes": {"4GB": {"checkpoint": {"total_bytes": 4}, "verbs": verbs}}}

    first = result({"extract": {"v": 1}, "dequant": {"v": "old"}})
    rerun = result({"dequant": {"v": "new"}, "dequant-all": {"v": 2}})
    merged = merge([first, rerun])
    assert merged["sizes"]["4GB"]["verbs"] == {"extract": {"v": 1}, "dequant": {"v": "new"}, "dequant-all": {"v": 2}}
    assert merged["verbs"] == ["extract", "dequant", "dequant-all"]


def test_nvfp4_variant_is_a_valid_compressed_tensors_checkpoint_that_dequantizes(tmp_path):
    """The dequant-nvfp4 verb's input: every linear NVFP4-packed the compressed-tensors way; validate passes
    and extract --dequant bf16 writes each MTP weight once, in bf16, without its scales."""
    from ckpt_tools.ops.validate import validate

    from conftest import run_ckpt

    syn = generate("qwen3_next", solve("qwen3_next", TINY), "nvfp4", tmp_path / "nvfp4", shards=4)
    assert any(k.endswith(".weight_packed") for k in syn.mtp_keys)
    assert validate(syn.path).ok
    run_ckpt("extract", syn.path, "-o", tmp_path / "out", "--dequant", "bf16")
    out = read_all(tmp_path / "out")
    assert not any(k.endswith((".weight_packed", ".weight_scale", ".weight_global_scale")) for k in out)
    assert out["mtp.fc.weight"].dtype == torch.bfloat16


def test_graft_verb_inputs_are_a_release_and_its_nvfp4_trunk_without_mtp(tmp_path):
    """The graft verb's target: the NVFP4 variant as a quantizer that dropped MTP leaves it (same shards minus the
    MTP tensors, count kept); graft of the bf16 variant into it validates, and the floor copies the same bytes."""
    from benchmarks.verbs import VERBS, Ctx
    from ckpt_tools.ops.validate import validate

    from conftest import run_ckpt

    sizing = solve("qwen3_next", TINY)
    ctx = Ctx(tmp_path, "qwen3_next", sizing, 4, None, log=lambda _: None)
    trunk = ctx.variant("nvfp4-nomtp")
    assert not trunk.mtp_keys and not [k for k in read_all(trunk.path) if k.startswith("mtp.")]
    assert validate(trunk.path).rules() == {"mtp-missing"}
    verb = VERBS["graft"]
    out = tmp_path / "out"
    run_ckpt(*verb.command(ctx, out))
    assert validate(out).ok
    floor_bytes = sum(p[2] for f in verb.floor(ctx, tmp_path / "floor")["files"] for p in f.get("pieces", []))
    ours = ("ckpt_manifest.json", "graft-report.json")
    written = sum(p.stat().st_size for p in out.iterdir() if p.name not in ours)
    assert abs(floor_bytes / written - 1) < 0.05  # the same bytes (ckpt adds a header, rewrites config and index)
