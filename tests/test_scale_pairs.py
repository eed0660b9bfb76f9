"""The weight-and-scale pairs of a block-format checkpoint (``block_audit.scale_pairs``) are found once per
checkpoint and shared by the trunk audit, the fp8 rule and the block fit; a changed tensor map is found again."""

from __future__ import annotations

from collections import Counter

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model import gate
from ckpt_tools.model.quant.block_audit import block_problems, scale_pairs
from ckpt_tools.testing.fixtures import FixtureOptions, make_checkpoint

SUFFIX = ".weight_scale_inv"


class _Counting(dict):
    """A tensor map that counts the look-ups of scale keys by name (``get`` and ``in``)."""

    asked: Counter

    def get(self, key, default=None):
        if key.endswith(SUFFIX):
            self.asked[key] += 1
        return super().get(key, default)

    def __contains__(self, key):
        if isinstance(key, str) and key.endswith(SUFFIX):
            self.asked[key] += 1
        return super().__contains__(key)


def _fp8(tmp_path) -> Checkpoint:
    d = tmp_path / "fp8"
    make_checkpoint("deepseek_v3", d, FixtureOptions(fp8=True))
    return Checkpoint.open(d)


def test_the_gate_looks_up_each_routed_expert_scale_once(tmp_path):
    ck = _fp8(tmp_path)
    counting = _Counting(ck.tensors)
    counting.asked = Counter()
    ck.tensors = counting
    problems, view = gate.check(ck)
    assert not [p for p in problems if p.rule.startswith("fp8-")]
    # the trunk's routed experts (45,000 of a release's 45,808 scales; the other modules ask the scheme tables)
    layers = ck.config.get("num_hidden_layers")
    trunk = {k: n for k, n in counting.asked.items() if ".mlp.experts." in k and int(k.split(".")[2]) < layers}
    assert len(trunk) > 10
    assert set(trunk.values()) == {1}, sorted((n, k) for k, n in trunk.items() if n > 1)[:5]


def test_a_changed_tensor_map_is_not_judged_by_stale_pairs(tmp_path):
    ck = _fp8(tmp_path)
    fmt = gate.check(ck)[1].codec
    before = scale_pairs(ck, fmt)
    assert scale_pairs(ck, fmt) is before  # kept
    weight = next(k for k, _, _, sref in before[0] if sref is not None)
    gone = weight.removesuffix(".weight") + SUFFIX
    ck.tensors = {k: v for k, v in ck.tensors.items() if k != gone}
    assert weight not in scale_pairs(ck, fmt)[1]
    missing = [p for p in block_problems(ck, fmt, set(), None) if p.rule == "fp8-scale-missing"]
    assert [p.key for p in missing] == [weight]
