"""Dequantized experts decode on the lookahead pool (stream.lookahead): the converter's recipes are marked
``ahead`` (each reads its own byte ranges into buffers of its own), the pool starts them before their turn, and
the bytes written do not depend on ``--threads``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_experts import group, save, source_tensors
from test_experts_cli import FP8_128, tensors_of

from ckpt_tools.model.experts import BlockDequant, convert_group
from ckpt_tools.stream import lookahead, writer
from ckpt_tools.stream.plan import Compute

from conftest import run_ckpt as ckpt


class _Stateful:
    """A plugged-in dequantizer the converter knows nothing about: it may hold state, so it stays on the writer."""

    dtype = "BF16"

    def __call__(self, weight, scale, block, weight_dtype, scale_dtype):
        return np.zeros(weight.shape, np.uint16)


@pytest.mark.parametrize("a,b", [("per-expert", "fused"), ("fused", "per-expert"), ("stacked", "fused-transposed")])
def test_compute_recipes_are_marked_ahead(tmp_path, a, b):
    src, dst = group(a, 3, 256, 128), group(b, 3, 256, 128, prefix="dst.experts")
    refs = save(source_tensors(src, "F8_E4M3", 5), tmp_path / "in.safetensors")
    for dequant, ahead in ((BlockDequant("BF16"), True), (None, True), (_Stateful(), False)):
        outs = convert_group(src, refs, dst, dequant=dequant)
        computed = [t for t in outs if isinstance(t.recipe, Compute)]
        if dequant is not None:
            assert len(computed) == len(outs) and all(t.recipe.op == "dequant" for t in computed)
        assert computed or dequant is None
        assert all(t.recipe.ahead is ahead for t in computed), [(t.key, t.recipe.ahead) for t in computed]


def _fp8_fused(make_fixture, tmp_path: Path) -> Path:
    src = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_128)
    fused = tmp_path / "fused-fp8"
    ckpt("fuse-experts", src, "-o", fused)  # FP8 codes and scales restacked (I a block multiple)
    return fused


def _expert_keys(out: Path) -> set[str]:
    return {k for k in tensors_of(out) if ".experts." in k}


@pytest.mark.parametrize("verb", ["unfuse", "fuse", "extract"])
def test_dequantized_experts_are_identical_for_any_threads_and_start_ahead(make_fixture, tmp_path, monkeypatch, verb):
    per_expert = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_128)
    if verb == "unfuse":
        src, args = _fp8_fused(make_fixture, tmp_path), ("unfuse-experts",)
    elif verb == "fuse":
        src, args = per_expert, ("fuse-experts",)
    else:
        src, args = per_expert, ("extract",)
    submitted: list[Compute] = []
    real = lookahead.submit

    def counting(fn, recipe, *rest, **kw):
        submitted.append(recipe)
        return real(fn, recipe, *rest, **kw)

    monkeypatch.setattr(lookahead, "submit", counting)
    written = {}
    for n in (1, 2, 3):
        submitted.clear()
        out = tmp_path / f"out-{n}"
        ckpt(*args, src, "-o", out, "--dequant", "bf16", "--threads", n)
        written[n] = tensors_of(out)
        experts = _expert_keys(out)
        assert experts and all(written[n][k][0] == "torch.bfloat16" for k in experts)
        # every dequantized expert tensor was decoded by a pool task, ahead of the writer
        ahead = [r for r in submitted if r.op == "dequant" and any(".experts." in i for i in r.inputs)]
        assert len(ahead) == len(experts), (len(ahead), sorted(experts))
    assert written[1] == written[2] == written[3]
    if verb == "extract":
        return
    # and they are the values the writer decodes with the lookahead off (window 0)
    monkeypatch.setattr(writer, "lookahead", lambda tensors, window=None: lookahead.Lookahead(tensors, 0))
    submitted.clear()
    ckpt(*args, src, "-o", tmp_path / "off", "--dequant", "bf16", "--threads", 2)
    assert not submitted and tensors_of(tmp_path / "off") == written[1]


def test_an_expert_tensor_over_the_lookahead_size_streams_on_the_writer(make_fixture, tmp_path, monkeypatch):
    """A fused [E, 2I, H] output larger than the lookahead's ``small`` is not decoded whole on the pool: it streams
    expert by expert as its recipe yields (memory: one expert's slab), with the same bytes."""
    src = make_fixture("deepseek_v3", fp8=True, config_overrides=FP8_128)
    ckpt("fuse-experts", src, "-o", tmp_path / "pooled", "--dequant", "bf16", "--threads", 2)
    pooled = tensors_of(tmp_path / "pooled")
    fused = [k for k in _expert_keys(tmp_path / "pooled") if k.endswith("gate_up_proj")]
    assert fused
    smallest = min(len(pooled[k][2]) for k in fused)
    submitted: list[Compute] = []
    real = lookahead.submit
    monkeypatch.setattr(lookahead, "submit", lambda fn, r, *a, **k: submitted.append(r) or real(fn, r, *a, **k))
    monkeypatch.setattr(writer, "lookahead", lambda tensors, window=None: lookahead.Lookahead(tensors, window,
                                                                                              small=smallest - 1))
    ckpt("fuse-experts", src, "-o", tmp_path / "streamed", "--dequant", "bf16", "--threads", 2)
    assert not [r for r in submitted if any(i.endswith(("gate_proj.weight", "up_proj.weight")) and ".experts." in i
                                            for i in r.inputs)]
    assert tensors_of(tmp_path / "streamed") == pooled
