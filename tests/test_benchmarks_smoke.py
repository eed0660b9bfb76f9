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
    shm = Path("/dev/shm")
    before = set(shm.glob("ckpt-bench-*")) if shm.is_dir() else set()
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--size", "2MB", "--own-sizes", "2MB", "--verbs",
         "startup,extract-lib,extract-drop-mtp-tmpfs,extract-drop-mtp-tmpfs-sha256-inline", "--runs", "1",
         "--contenders", "floor", "--json", str(out), "--markdown", str(md), "--workdir", str(tmp_path / "wd")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (set(shm.glob("ckpt-bench-*")) if shm.is_dir() else set()) == before  # tmpfs outputs never left behind
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
    own = res["sizes"]["2MB deepseek_v3"]  # the tmpfs verbs: their own family, their own round
    assert set(own["verbs"]) == {"extract-drop-mtp-tmpfs", "extract-drop-mtp-tmpfs-sha256-inline"}
    after, before_ = own["verbs"]["extract-drop-mtp-tmpfs"], own["verbs"]["extract-drop-mtp-tmpfs-sha256-inline"]
    if after.get("skipped"):  # no tmpfs with room here: the reason is recorded
        assert "/dev/shm" in after["skipped"]
        return
    assert after["hashing"] == {"algo": "blake3", "threads": 2}
    assert before_["hashing"] == {"algo": "sha256", "threads": 0}
    for v in (after, before_):
        runs = {c: v["contenders"][c]["runs"][0] for c in ("ckpt", "floor")}
        assert all(run["returncode"] == 0 for run in runs.values()), runs
        assert runs["ckpt"]["output_bytes"] > runs["floor"]["output_bytes"] > 0  # ckpt adds its manifest
    assert set(own["rates"]["bytes_per_s"]) >= {"sendfile", "buffered_copy", "blake3", "sha256"}
    assert "Projection to 16 cores" in md.read_text() and "Before -> after" in md.read_text()


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
    from ckpt_tools.ops.check.validate import validate

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
    from ckpt_tools.ops.check.validate import validate

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


def test_dequant_mtp_hardlink_floor_links_and_writes_what_ckpt_does(tmp_path):
    """dequant --only-mtp --link hardlink: the floor links the shards ckpt links, and writes as many bytes as ckpt
    writes (the affected shards' trunk tensors and the bf16 MTP), within its headers and side files."""
    from benchmarks.verbs import VERBS, Ctx

    from conftest import run_ckpt

    ctx = Ctx(tmp_path, "qwen3_next", solve("qwen3_next", TINY), 4, None, log=lambda _: None)
    verb = VERBS["dequant-mtp-hardlink"]
    out = tmp_path / "out"
    run_ckpt(*verb.command(ctx, out))
    job = verb.floor(ctx, tmp_path / "floor")
    linked = {Path(f["path"]).name for f in job["files"] if "link" in f}
    src = ctx.variant("fp8").path
    assert linked and all((out / n).stat().st_ino == (src / n).stat().st_ino for n in linked)
    floor_bytes = sum(p[2] for f in job["files"] for p in f.get("pieces", []))
    ours = ("ckpt_manifest.json",)
    written = sum(p.stat().st_size for p in out.iterdir() if p.name not in ours and p.name not in linked)
    assert abs(floor_bytes / written - 1) < 0.1


# -- fair floors (issue 19) -------------------------------------------------------------


def test_stitch_floor_reads_what_stitch_compares_and_links_the_rest(tmp_path):
    """stitch-hardlink's floor: the draft's tensors and the verifier's MTP tensors read into memory, the shards
    holding MTP copied (fsynced), the others hard-linked, the side files copied."""
    from benchmarks.verbs import VERBS, Ctx

    ctx = Ctx(tmp_path, "qwen3_next", solve("qwen3_next", TINY), 4, None, log=lambda _: None)
    verifier = ctx.variant("bf16")
    job = VERBS["stitch-hardlink"].floor(ctx, tmp_path / "floor")
    draft = layout.extents(ctx.native_draft())
    mtp = [layout.extents(verifier.path)[k] for k in verifier.mtp_keys]
    assert sum(r[2] for r in job["reads"]) == sum(e.length for e in draft.values()) + sum(e.length for e in mtp)
    assert {r[0] for r in job["reads"]} == {e.file for e in mtp} | {e.file for e in draft.values()}
    assert floor.run_job(job, fsync=True) > 0
    affected = {Path(e.file).name for e in mtp}
    for p in layout.files(verifier.path):
        out = tmp_path / "floor" / p.name
        assert out.read_bytes() == p.read_bytes()
        linked = out.stat().st_ino == p.stat().st_ino
        assert linked == (p.name.endswith(".safetensors") and p.name not in affected), p.name


def test_extract_floor_writes_the_side_files_too(tmp_path):
    from benchmarks.verbs import VERBS, Ctx

    ctx = Ctx(tmp_path, "qwen3_next", solve("qwen3_next", TINY), 4, None, log=lambda _: None)
    job = VERBS["extract"].floor(ctx, tmp_path / "floor")
    names = {Path(f["path"]).name for f in job["files"]}
    assert names == {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json"}


def test_tmpfs_floor_sends_the_bytes_extract_drop_mtp_writes(tmp_path):
    """The floor of extract --drop-mtp: every tensor but the MTP ones (sendfile), the side files and the index;
    the same tensor bytes as ckpt's output, in as many shards."""
    from benchmarks.verbs import VERBS, Ctx

    from conftest import run_ckpt

    verb = VERBS["extract-drop-mtp-tmpfs"]
    ctx = Ctx(tmp_path, verb.family, solve(verb.family, TINY), 4, None, log=lambda _: None)
    syn = ctx.variant("bf16")
    job = verb.floor(ctx, tmp_path / "floor")
    assert job["copy"] == "sendfile"
    floor.run_job(job, fsync=False)
    run_ckpt(*verb.command(ctx, tmp_path / "ckpt"))
    ours = layout.extents(tmp_path / "ckpt")
    assert ours and not set(ours) & set(syn.mtp_keys)
    tensor_bytes = sum(p[2] for f in job["files"] if f["path"].endswith(".safetensors") for p in f["pieces"])
    assert tensor_bytes == sum(e.length for e in ours.values())
    floor_names = {p.name for p in (tmp_path / "floor").iterdir()}
    assert {p.name for p in (tmp_path / "ckpt").glob("*.safetensors")} <= floor_names
    assert {layout.INDEX, "config.json"} <= floor_names


def test_tmpfs_room_says_why_a_directory_cannot_take_the_outputs(tmp_path):
    from benchmarks.report import mount_of
    from benchmarks.runner import tmpfs_room

    if mount_of(tmp_path)[2] != "tmpfs":
        assert "not tmpfs" in tmpfs_room(1, tmp_path)
    assert "does not exist" in tmpfs_room(1, tmp_path / "nope")
    shm = Path("/dev/shm")
    if mount_of(shm)[2] == "tmpfs":
        assert tmpfs_room(1, shm) is None
        assert "GB free" in tmpfs_room(10**15, shm)


def _verb_at(ckpt: float, floor_s: float, limit: float | None = 1.3, judge: str = "marginal", rss: int = 80e6) -> dict:
    return {"max_floor_ratio": limit, "judge": judge, "ratios": {"floor": ckpt / floor_s},
            "contenders": {"ckpt": {"stats": {"wall": {"median": ckpt}, "maxrss": {"median": rss}}},
                           "floor": {"stats": {"wall": {"median": floor_s}}}}}


def test_targets_judge_copying_verbs_on_the_marginal_ratio_and_tmpfs_on_the_ratio():
    """A copying verb passes on its marginal ratio although its 4 GB ratio misses (fixed cost); a verb that runs
    in its own rounds only (tmpfs) is judged on its ratio at its largest size, the other verbs' sizes ignored."""
    from benchmarks.report import targets

    def size(total: int, verbs: dict) -> dict:
        return {"checkpoint": {"total_bytes": total}, "verbs": verbs}

    res = {"verbs": ["extract", "slow", "tmpfs"], "sizes": {
        "1GB": size(10**9, {"extract": _verb_at(0.5 + 1.2 * 0.1, 0.1), "slow": _verb_at(0.5 + 2 * 0.1, 0.1)}),
        "4GB": size(4 * 10**9, {"extract": _verb_at(0.5 + 1.2 * 0.4, 0.4), "slow": _verb_at(0.5 + 2 * 0.4, 0.4)}),
        "1GB deepseek_v3": size(10**9, {"tmpfs": _verb_at(0.6, 0.3, 1.5, "ratio")}),
        "3GB deepseek_v3": size(3 * 10**9, {"tmpfs": _verb_at(1.4, 1.0, 1.5, "ratio")}),
    }}
    rows = {r[0]: r for r in targets(res)}
    verb, by_size, slope, fixed, target, _, rss_ok, verdict = rows["extract"]
    assert by_size == "6.20x / 2.45x" and slope == "1.20x" and fixed == "0.50" and target == "marginal <= 1.3x"
    assert verdict == "pass" and rss_ok == "yes"
    assert rows["slow"][2] == "2.00x" and rows["slow"][-1] == "MISS"
    assert rows["tmpfs"][1] == "2.00x / 1.40x" and rows["tmpfs"][4] == "<= 1.5x" and rows["tmpfs"][-1] == "pass"


def test_projection_per_byte_model():
    from benchmarks.report import per_byte

    assert per_byte(1.0, 3.0, 0, 16) == 4.0  # inline: copy, then hash, on one thread
    assert per_byte(1.0, 3.0, 2, 16) == 1.5  # two hash threads are the slower stage
    assert per_byte(1.0, 0.5, 2, 16) == 1.0  # the copy is
    assert per_byte(1.0, 3.0, 2, 2) == 2.0  # two cores: all the CPU work shared by two


# -- the digest knobs the tmpfs benchmark uses (ckpt_tools.io.digest) --------------------------------------


def test_digest_knobs_write_the_old_manifest_and_verify_manifest_reads_both(tmp_path, monkeypatch):
    """CKPT_MANIFEST_DIGEST=sha256 with CKPT_HASH_THREADS=0 (the writer before the hashing change) records the
    sha256 of each tensor's bytes; the default records BLAKE3; verify-manifest checks either."""
    import hashlib

    from blake3 import blake3

    from conftest import run_ckpt

    syn = generate("qwen3_next", solve("qwen3_next", TINY), "bf16", tmp_path / "in", shards=4)
    for env, algo, new in (({"CKPT_MANIFEST_DIGEST": "sha256", "CKPT_HASH_THREADS": "0"}, "sha256", hashlib.sha256),
                           ({}, "blake3", blake3)):
        for k in ("CKPT_MANIFEST_DIGEST", "CKPT_HASH_THREADS"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        out = tmp_path / f"out-{algo}"
        run_ckpt("extract", syn.path, "-o", out)
        manifest = json.loads((out / "ckpt_manifest.json").read_text())
        ext = layout.extents(out)
        for key, entry in manifest["tensors"].items():
            other = "blake3" if algo == "sha256" else "sha256"
            assert other not in entry
            e = ext[key]
            with open(e.file, "rb") as f:
                f.seek(e.offset)
                assert entry[algo] == new(f.read(e.length)).hexdigest(), key
        monkeypatch.delenv("CKPT_MANIFEST_DIGEST", raising=False)
        monkeypatch.delenv("CKPT_HASH_THREADS", raising=False)
        assert "match" in run_ckpt("verify-manifest", out).output


@pytest.mark.parametrize("env", [{"CKPT_MANIFEST_DIGEST": "md5"}, {"CKPT_HASH_THREADS": "two"}])
def test_a_bad_digest_knob_is_a_usage_error_before_any_shard(tmp_path, monkeypatch, env):
    from conftest import run_ckpt

    syn = generate("qwen3_next", solve("qwen3_next", TINY), "bf16", tmp_path / "in", shards=4)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = run_ckpt("extract", syn.path, "-o", tmp_path / "out", code=2)
    assert next(iter(env)) in r.output
    assert not list((tmp_path / "out").glob("*.safetensors")) and not (tmp_path / "out" / "ckpt_manifest.json").exists()


def test_inline_executor_runs_on_the_callers_thread_and_keeps_errors_for_result():
    import threading

    from ckpt_tools.io import digest

    ex = digest.executor(0)
    fut = ex.submit(threading.get_ident)
    assert fut.done() and fut.result() == threading.get_ident()
    bad = ex.submit(int, "x")
    with pytest.raises(ValueError):
        bad.result()
    pool = digest.executor(2)
    assert pool.submit(threading.get_ident).result() != threading.get_ident()
    pool.shutdown()


def test_extract_gguf_verb_writes_a_sidecar_and_its_floor_copies_the_bytes_it_holds(tmp_path):
    """The extract-gguf verb (issue 41): its trunk GGUF has no tensors, and the sidecar it writes holds the tensor
    bytes its floor copies (the MTP and shared tensors; bf16 in, f16 out)."""
    pytest.importorskip("gguf")
    from benchmarks.verbs import VERBS, Ctx

    from conftest import run_ckpt

    sizing = solve("qwen3_next", TINY)
    ctx = Ctx(tmp_path, "qwen3_next", sizing, 4, None, log=lambda _: None)
    verb = VERBS["extract-gguf"]
    out = tmp_path / "out"
    run_ckpt(*verb.command(ctx, out))
    import gguf

    assert not gguf.GGUFReader(ctx.trunk_gguf("bf16")).tensors
    [sidecar] = out.glob("mtp-*.gguf")
    held = sum(int(t.n_bytes) for t in gguf.GGUFReader(sidecar).tensors)
    floor_bytes = sum(p[2] for f in verb.floor(ctx, tmp_path / "floor")["files"] for p in f["pieces"])
    # the same bytes, but for the norms, routers and biases llama.cpp keeps in F32 (twice their bf16 bytes)
    assert floor_bytes <= held < 1.01 * floor_bytes, (held, floor_bytes)
