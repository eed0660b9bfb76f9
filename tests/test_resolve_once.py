"""Each checkpoint is resolved against its table once per run: the gate's MTP view is passed down to the verb
(graft's target at the source's count, stitch's verifier, init-draft's target) and the undeclared depths are
probed in the same resolution; the trunk's specs are computed once per resolution (validate asks five times)."""

from __future__ import annotations

from collections import Counter

import pytest

from ckpt_tools import api
from ckpt_tools.model.tables import resolve as resolve_mod
from ckpt_tools.testing import FixtureOptions, make_checkpoint
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint


@pytest.fixture
def counted(monkeypatch):
    """Resolutions per config (by identity: one per opened checkpoint) and trunk-spec computations."""
    seen: Counter = Counter()
    trunk: Counter = Counter()
    init, prefixes = resolve_mod.Resolved.__init__, resolve_mod.trunk_prefixes

    def counting_init(self, table, config, *a, **kw):
        seen[id(config)] += 1
        init(self, table, config, *a, **kw)

    def counting_trunk(res):  # trunk_specs starts from the trunk's layer prefixes
        trunk[id(res)] += 1
        return prefixes(res)

    monkeypatch.setattr(resolve_mod.Resolved, "__init__", counting_init)
    monkeypatch.setattr(resolve_mod, "trunk_prefixes", counting_trunk)
    return seen, trunk


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("r"), FixtureOptions(expert_layout="per-expert"))


def test_graft_dry_run_resolves_each_checkpoint_once(counted, release, tmp_path):
    target = make_quantized_checkpoint("deepseek_v3", tmp_path / "t", QuantOptions("ct-nvfp4", mtp="dropped"))
    seen, trunk = counted
    seen.clear()
    api.graft(release, target, tmp_path / "o", dry_run=True)
    assert sorted(seen.values()) == [1, 1], seen  # source and target, once each (8 times before)
    assert all(n == 1 for n in trunk.values()), trunk


def test_stitch_resolves_the_verifier_once(counted, release, tmp_path):
    api.extract(release, tmp_path / "d")
    seen, _ = counted
    seen.clear()
    api.stitch(tmp_path / "d", release, tmp_path / "o", dry_run=True)
    assert list(seen.values()) == [1], seen  # the verifier (the draft is read by its format, not resolved)


def test_init_draft_resolves_once(counted, release, tmp_path):
    seen, _ = counted
    api.init_draft(release, tmp_path / "o", dry_run=True, num_layers=1)
    assert list(seen.values()) == [1], seen


def test_validate_resolves_and_computes_the_trunk_once(counted, release):
    seen, trunk = counted
    api.validate(release)
    assert list(seen.values()) == [1], seen
    assert list(trunk.values()) == [1], trunk  # the gate's rules and validate's reports share them
