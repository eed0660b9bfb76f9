"""Planning at release scale (issue 34): the sparse replica of the DeepSeek-V3 release and the commands on it.

The replica (benchmarks/release.py) holds every shard, key, dtype and shape of the release with its weights as
holes, so a command sees 163 shards and 91,991 tensors for a few MB of disk. The timing test runs each command
once in its own process and holds it to twice the issue's target. It judges CPU time (user + system of the
command), not wall time: on a shared 2-core machine the wall clock measures the neighbours too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import release, scale  # noqa: E402

MIB = 1 << 20


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Path:
    return release.build(tmp_path_factory.mktemp("release") / "deepseek-v3")


def test_the_replica_is_the_release_layout_in_a_few_mb(replica):
    shards = sorted(replica.glob("*.safetensors"))
    wm = json.loads((replica / release.INDEX).read_text())["weight_map"]
    assert len(shards) == 163 and len(wm) == 91_991  # the release's counts
    assert {p.name for p in shards} == set(wm.values())
    apparent = sum(p.stat().st_size for p in shards)
    assert 641 * 2**30 < apparent < 642 * 2**30  # 641 GiB as released
    assert release.disk_bytes(replica) < 64 * MIB
    assert wm["model.embed_tokens.weight"] == "model-00001-of-000163.safetensors"
    assert wm["lm_head.weight"] == wm["model.norm.weight"] == "model-00160-of-000163.safetensors"
    glue = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
    assert {wm[f"model.layers.61.{g}.weight"] for g in glue} == {"model-00163-of-000163.safetensors"}
    from ckpt_tools.io.checkpoint import Checkpoint

    with Checkpoint.open(replica) as ck:  # every header parses under the strict rules
        assert len(ck.tensors) == 91_991
        ref = ck.tensors["model.layers.3.mlp.experts.7.down_proj.weight"]
        assert (ref.dtype, ref.shape) == ("F8_E4M3", (7168, 2048))
        assert ck.tensors["model.layers.3.mlp.experts.7.down_proj.weight_scale_inv"].shape == (56, 16)


def test_the_graft_target_lost_its_mtp_layer_only(tmp_path):
    target = release.build(tmp_path / "nomtp", nomtp=True)
    wm = json.loads((target / release.INDEX).read_text())["weight_map"]
    assert len(wm) == 91_991 - 1564 and not any(k.startswith("model.layers.61.") for k in wm)
    assert json.loads((target / "config.json").read_text())["num_nextn_predict_layers"] == 1  # as quantizers leave it


@pytest.mark.slow
def test_planning_at_release_scale_stays_within_twice_what_was_measured(tmp_path):
    """Each command is held within twice the CPU time measured with every rule in force (``measured``: issue 32's
    rules read every scale value and audit every trunk module; BENCHMARKS.md says which of issue 34's targets,
    ``max_wall``, that meets), and within twice its memory target; each verb's fixed cost on the tiny fixtures
    likewise."""
    for cases in (scale.CASES, scale.FIXED):
        samples = scale.measure(tmp_path, runs=1, cases=cases)
        for case in cases:
            (s,) = samples[case.name]
            assert s.returncode in (0, 1) and not s.timed_out, (case.name, s.stderr_tail)
            limit = case.measured or case.max_wall
            assert s.cpu <= 2 * limit, (f"{case.name}: {s.cpu:.2f} s of CPU (measured {limit} s, target "
                                        f"{case.max_wall} s)")
            if case.max_rss is not None:
                assert s.maxrss <= 2 * case.max_rss, f"{case.name}: peak RSS {s.maxrss / MIB:.0f} MiB"
