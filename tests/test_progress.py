"""Progress that tells the truth: the writer names its phases, the bytes it reports in a phase sum to the
phase's total, and that total is what the plan moves (tensors written plus files copied whole; a hardlink
moves nothing), on a first run and on a resumed one."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_stitch import _perturb

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.ops.draft.extract import ExtractRequest, plan_extract
from ckpt_tools.ops.stitch.plan import StitchRequest, plan_stitch
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.progress import Progress

from conftest import run_ckpt as ckpt


class Recorder(Progress):
    """Every phase as [name, total, bytes advanced while it was current]."""

    def __init__(self) -> None:
        self.phases: list[list] = []

    def phase(self, name: str, total: int = 0) -> None:
        self.phases.append([name, total, 0])

    def advance(self, n: int) -> None:
        self.phases[-1][2] += n  # an advance before any phase fails here


def run(plan, out: Path, **kw) -> Recorder:
    rec = Recorder()
    execute(plan, out, progress=rec, **kw)
    assert [p[0] for p in rec.phases] == ["writing", "hashing", "validating"]
    assert all(done == 0 for name, _, done in rec.phases if name != "writing")  # every byte is the writing's
    return rec


def writing(rec: Recorder) -> tuple[int, int]:
    _, total, done = rec.phases[0]
    return total, done


def copied_whole(plan) -> int:
    """Bytes of the files the plan copies whole, from the source files themselves."""
    return sum(os.path.getsize(f.source) for f in plan.files if f.source is not None and f.link != "hardlink")


@pytest.mark.parametrize("drop_mtp", [False, True])
def test_extract_total_is_the_planned_bytes(drop_mtp, make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    with Checkpoint.open(src) as ck:
        plan = plan_extract(ck, ExtractRequest(drop_mtp=drop_mtp))
        total, done = writing(run(plan, tmp_path / "out"))
    assert total == done == plan.total_bytes + copied_whole(plan)
    assert plan.total_bytes > 0 and copied_whole(plan) > 0  # tensors and carried files both counted


@pytest.fixture
def perturbed(make_fixture, tmp_path):
    """A verifier and a draft of it with one tensor changed: one shard rewritten, the others copied whole."""
    verifier = make_fixture("deepseek_v3")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    _perturb(draft, ["model.layers.3.hnorm.weight"], np.random.default_rng(5))
    return verifier, draft


def stitch(verifier: Path, draft: Path, out: Path, link: str, **kw):
    with Checkpoint.open(draft) as d, Checkpoint.open(verifier) as v:
        plan, report = plan_stitch(d, v, StitchRequest(link=link))
        return plan, report, writing(run(plan, out, **kw))


def test_stitch_total_counts_whole_copies_and_not_hardlinks(perturbed, tmp_path):
    verifier, draft = perturbed
    plan, report, (total, done) = stitch(verifier, draft, tmp_path / "copy", "copy")
    assert total == done == plan.total_bytes + copied_whole(plan)
    whole = [f for f in plan.files if f.tensors]
    assert whole and report.rewritten_shards  # the case the bar reported as "N/0 bytes"
    assert total > sum(os.path.getsize(f.source) for f in whole) > 0

    _, report, (linked_total, linked_done) = stitch(verifier, draft, tmp_path / "link", "hardlink")
    linked = [f for f in (tmp_path / "link").iterdir()
              if (verifier / f.name).exists() and f.stat().st_ino == (verifier / f.name).stat().st_ino]
    assert sorted(f.name for f in linked) == sorted(f.name for f in whole)
    assert linked_total == linked_done == total - sum(f.stat().st_size for f in linked) > 0


@pytest.mark.parametrize("link", ["copy", "hardlink"])
def test_resumed_stitch_reports_its_skipped_bytes(link, perturbed, tmp_path):
    verifier, draft = perturbed
    out = tmp_path / "out"
    _, _, first = stitch(verifier, draft, out, link)
    _, _, (total, done) = stitch(verifier, draft, out, link, resume=True)  # every shard already in place
    assert (total, done) == first and total == done
