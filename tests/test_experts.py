"""Expert layout conversions (ckpt_tools.model.experts): exact round trips, semantics, errors.

Sources are written with safetensors.torch.save_file, every plan runs through the real
writer, and results are read back with safetensors.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_tools.errors import PlanError
from ckpt_tools.io.safetensors_io import IO_STATS, LocalFile, read_header, refs_from_header
from ckpt_tools.model.expert_layouts import ExpertGroup, ExpertLayout, scale_key, scale_shape
from ckpt_tools.model.experts import check_group, convert_group, layout_from_label
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.plan import Compute, CopyBytes, Plan

GATED = [
    "per-expert", "fused", "fused:up-first", "stacked", "stacked-transposed", "fused-transposed",
    "fused-transposed:up-first", "fused-transposed:interleaved", "fused-transposed:up-first,interleaved",
]
NON_GATED = ["per-expert", "fused", "stacked", "stacked-transposed", "fused-transposed"]
CASES = [(a, True) for a in GATED] + [(a, False) for a in NON_GATED]
TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
BITS = {"BF16": torch.int16, "F16": torch.int16, "F32": torch.int32, "F8_E4M3": torch.uint8}
TMP = Path(tempfile.gettempdir())


def group(layout: str, E: int, H: int, inter: int, gated: bool = True, prefix: str = "src.experts") -> ExpertGroup:
    return ExpertGroup(prefix, E, H, inter, gated, ExpertLayout.parse(layout))


def random_bits(shape, dtype: str, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads included): byte identity is what counts."""
    if dtype == "F8_E4M3":
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    lo, hi = (-(2**15), 2**15) if dtype in ("BF16", "F16") else (-(2**31), 2**31)
    return torch.randint(lo, hi, shape, dtype=torch.int64, generator=gen).to(BITS[dtype]).view(TORCH[dtype])


def source_tensors(g: ExpertGroup, dtype: str, seed: int, block=(128, 128)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in g.tensors():
        out[t.key] = random_bits(t.shape, dtype, gen)
        if dtype == "F8_E4M3":
            out[scale_key(t.key)] = torch.rand(scale_shape(t.shape, block), generator=gen) + 0.5
    return out


def save(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    save_file(tensors, str(path), metadata={"format": "pt"})
    src = LocalFile(path)
    return refs_from_header(src, read_header(src))


def write(outputs, out_dir: Path) -> tuple[Path, dict]:
    """Execute a plan with the real writer; the written file and its refs."""
    execute(Plan("test", outputs), out_dir)
    path = out_dir / "model.safetensors"
    src = LocalFile(path)
    return path, refs_from_header(src, read_header(src))


def load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(torch.uint8).numpy())


def joins_scales(layout: str, gated: bool) -> bool:
    """Gate and up scales share one tensor (independent of the code under test)."""
    lay = ExpertLayout.parse(layout)
    return gated and lay.name in ("fused", "fused-transposed")


def round_trip_all(a: str, gated: bool, E: int, H: int, inter: int, dtype: str, seed: int) -> None:
    """A -> every B -> A, all B in one file (renamed prefixes), then compared with the source."""
    targets = GATED if gated else NON_GATED
    with tempfile.TemporaryDirectory(dir=TMP) as d:
        d = Path(d)
        src = group(a, E, H, inter, gated)
        tensors = source_tensors(src, dtype, seed)
        refs = save(tensors, d / "src.safetensors")
        fp8 = dtype == "F8_E4M3"
        ok, outs, refused = [], [], []
        for i, b in enumerate(targets):
            mid = src.with_layout(ExpertLayout.parse(b), prefix=f"b{i}.experts")
            aligned = inter % 128 == 0
            interleaved = "interleaved" in (a + b)
            expect_error = fp8 and a != b and ((joins_scales(a, gated) or joins_scales(b, gated)) and not aligned
                                               or interleaved)
            if expect_error:
                with pytest.raises(PlanError) as err:
                    convert_group(src, refs, mid)
                assert err.value.rule == "fp8-scale-fusion"
                refused.append(b)
                continue
            outs += convert_group(src, refs, mid)
            ok.append((i, b, mid))
        if not ok:
            return
        _, mid_refs = write(outs, d / "mid")
        for _, _, mid in ok:  # the intermediate has exactly the target layout's keys and shapes
            for t in mid.tensors():
                assert mid_refs[t.key].shape == t.shape and mid_refs[t.key].dtype == dtype
                if fp8:
                    assert mid_refs[scale_key(t.key)].shape == scale_shape(t.shape)
        back = []
        for i, _, mid in ok:
            back += convert_group(mid, mid_refs, src.with_layout(src.layout, prefix=f"a{i}.experts"))
        path, _ = write(back, d / "back")
        got = load(path)
        expected_keys = len(tensors) * len(ok)
        assert len(got) == expected_keys
        for i, b, _ in ok:
            for k, v in tensors.items():
                k2 = f"a{i}.experts" + k[len("src.experts"):]
                assert same_bytes(got[k2], v), f"{a} -> {b} -> {a}: {k} differs"


@pytest.mark.parametrize(("a", "gated"), CASES)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(E=st.integers(1, 4), H=st.integers(1, 33), inter=st.integers(1, 33),
       dtype=st.sampled_from(["BF16", "F16", "F32"]), seed=st.integers(0, 2**16))
def test_round_trip_every_pair(a, gated, E, H, inter, dtype, seed):
    round_trip_all(a, gated, E, H, inter, dtype, seed)


@pytest.mark.parametrize(("a", "gated"), CASES)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(E=st.integers(1, 3), H=st.integers(1, 300), inter=st.sampled_from([128, 256, 64, 200]),
       seed=st.integers(0, 2**16))
def test_round_trip_every_pair_fp8(a, gated, E, H, inter, seed):
    """FP8 with scales: exact when I is a multiple of the block; a clear refusal otherwise."""
    round_trip_all(a, gated, E, H, inter, "F8_E4M3", seed)


# ---------------------------------------------------------------------------
# Semantics: an MoE forward from every layout, with each layout's own reading rules


def expert_fn(layout: str, W: dict[str, torch.Tensor], P: str, gated: bool):
    """y = expert_e(x), written from the layout's documented semantics (not from ckpt_tools)."""
    lay = ExpertLayout.parse(layout)

    def act(g, u):
        return F.silu(g) * u if gated else torch.relu(u) ** 2

    def f(e: int, x: torch.Tensor) -> torch.Tensor:
        if lay.name == "per-expert":
            u = F.linear(x, W[f"{P}.{e}.up_proj.weight"])
            g = F.linear(x, W[f"{P}.{e}.gate_proj.weight"]) if gated else None
            return F.linear(act(g, u), W[f"{P}.{e}.down_proj.weight"])
        if lay.name == "stacked":
            u = F.linear(x, W[f"{P}.up_proj.weight"][e])
            g = F.linear(x, W[f"{P}.gate_proj.weight"][e]) if gated else None
            return F.linear(act(g, u), W[f"{P}.down_proj.weight"][e])
        if lay.name == "stacked-transposed":  # [E, in, out]: x @ W
            u = x @ W[f"{P}_up_proj"][e]
            g = x @ W[f"{P}_gate_proj"][e] if gated else None
            return act(g, u) @ W[f"{P}_down_proj"][e]
        if lay.name == "fused":  # [E, 2I, H]: gate rows then up rows
            if gated:
                first, second = W[f"{P}.gate_up_proj"][e].chunk(2, dim=0)
                gw, uw = (second, first) if lay.up_first else (first, second)
                g, u = F.linear(x, gw), F.linear(x, uw)
            else:
                g, u = None, F.linear(x, W[f"{P}.up_proj"][e])
            return F.linear(act(g, u), W[f"{P}.down_proj"][e])
        assert lay.name == "fused-transposed"  # [E, H, 2I]: x @ W, blocked or interleaved columns
        if gated:
            y = x @ W[f"{P}.gate_up_proj"][e]
            first, second = (y[..., 0::2], y[..., 1::2]) if lay.interleaved else y.chunk(2, dim=-1)
            g, u = (second, first) if lay.up_first else (first, second)
        else:
            g, u = None, x @ W[f"{P}.up_proj"][e]
        return act(g, u) @ W[f"{P}.down_proj"][e]

    return f


def moe_forward(x: torch.Tensor, router: torch.Tensor, E: int, fn, k: int = 2) -> torch.Tensor:
    probs = torch.softmax(x @ router.T, dim=-1)
    w, idx = probs.topk(min(k, E), dim=-1)
    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if len(tok):
            out[tok] += w[tok, slot, None] * fn(e, x[tok])
    return out


@pytest.mark.parametrize(("layout", "gated"), CASES)
def test_moe_forward_matches_per_expert(layout, gated, tmp_path):
    E, H, inter, T = 4, 24, 20, 32
    gen = torch.Generator().manual_seed(7)
    src = group("per-expert", E, H, inter, gated, prefix="m.experts")
    tensors = {t.key: torch.randn(t.shape, generator=gen) * 0.2 for t in src.tensors()}
    refs = save(tensors, tmp_path / "src.safetensors")
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(E, H, generator=gen)
    reference = moe_forward(x, router, E, expert_fn("per-expert", tensors, "m.experts", gated))

    dst = src.with_layout(ExpertLayout.parse(layout))
    path, _ = write(convert_group(src, refs, dst), tmp_path / "out")
    got = moe_forward(x, router, E, expert_fn(layout, load(path), "m.experts", gated))
    if ExpertLayout.parse(layout).transposed:
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, reference)  # pure stacking: the very same weights


# ---------------------------------------------------------------------------
# Recipes: byte copies where the layout allows it, one expert per computed chunk


@pytest.mark.parametrize(("a", "b", "kind"), [
    ("per-expert", "fused", CopyBytes), ("fused", "per-expert", CopyBytes), ("fused", "stacked", CopyBytes),
    ("stacked", "fused:up-first", CopyBytes), ("fused:up-first", "fused", CopyBytes),
    ("per-expert", "stacked-transposed", Compute), ("stacked-transposed", "fused-transposed", Compute),
    ("fused-transposed", "fused-transposed:interleaved", Compute),
])
def test_recipe_kinds(a, b, kind, tmp_path):
    """Stacking is byte ranges (FP8 included); transposes and interleaving compute one expert per chunk."""
    src = group(a, 3, 8, 128)
    dtype = "BF16" if "interleaved" in b else "F8_E4M3"  # FP8 scales cannot be interleaved
    refs = save(source_tensors(src, dtype, 1), tmp_path / "s.safetensors")
    outs = convert_group(src, refs, src.with_layout(ExpertLayout.parse(b)))
    assert all(isinstance(t.recipe, kind) for t in outs if "down_proj" not in t.key)  # down may stay put
    for t in outs:
        if isinstance(t.recipe, Compute):
            IO_STATS.reset()
            chunks = list(t.recipe.produce())
            assert IO_STATS.bytes_read == t.recipe.read_bytes  # the plan's read total is what is read
            assert len(chunks) == 3  # one expert per chunk: memory bounded by one expert
            assert all(np.asarray(c).nbytes == t.nbytes // 3 for c in chunks)


@pytest.mark.parametrize("layout", GATED)
def test_same_layout_is_one_segment_per_tensor(layout, tmp_path):
    src = group(layout, 4, 16, 8)
    tensors = source_tensors(src, "F8_E4M3", 3)
    refs = save(tensors, tmp_path / "s.safetensors")
    outs = convert_group(src, refs, src)
    assert sorted(t.key for t in outs) == sorted(tensors)
    for t in outs:
        assert isinstance(t.recipe, CopyBytes) and len(t.recipe.segments) == 1 and t.recipe.op == "copy"
        seg, ref = t.recipe.segments[0], refs[t.key]
        assert (seg.offset, seg.length) == (ref.offset, ref.nbytes)
    renamed = convert_group(src, refs, src.with_layout(src.layout, prefix="mtp_layers.0.mlp.experts"))
    assert all(isinstance(t.recipe, CopyBytes) and len(t.recipe.segments) == 1 for t in renamed)
    assert all(t.key.startswith("mtp_layers.0.mlp.experts") for t in renamed)
    assert all(t.meta["layout"] == src.layout.label() and len(t.meta["source"]) == 1 for t in renamed)


def test_fused_from_per_expert_is_gate_then_up_bytes(tmp_path):
    """The fused tensor is the concatenation over e of gate_e || up_e (transformers' MergeModulelist+Concatenate)."""
    src = group("per-expert", 3, 5, 4)
    tensors = source_tensors(src, "BF16", 11)
    refs = save(tensors, tmp_path / "s.safetensors")
    path, _ = write(convert_group(src, refs, src.with_layout(ExpertLayout("fused"))), tmp_path / "o")
    got = load(path)
    gate = torch.stack([tensors[f"src.experts.{e}.gate_proj.weight"] for e in range(3)])
    up = torch.stack([tensors[f"src.experts.{e}.up_proj.weight"] for e in range(3)])
    assert same_bytes(got["src.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
    assert set(got) == {"src.experts.gate_up_proj", "src.experts.down_proj"}  # no .weight suffix


def test_fused_fp8_scales_follow_transformers_fp8experts(tmp_path):
    """gate_up_proj_scale_inv [E, 2I/128, ceil(H/128)] = gate and up scales concatenated along rows."""
    src = group("per-expert", 2, 200, 256)
    tensors = source_tensors(src, "F8_E4M3", 5)
    refs = save(tensors, tmp_path / "s.safetensors")
    path, _ = write(convert_group(src, refs, src.with_layout(ExpertLayout("fused"))), tmp_path / "o")
    got = load(path)
    s = got["src.experts.gate_up_proj_scale_inv"]
    assert s.shape == (2, 4, 2)
    for e in range(2):
        want = torch.cat([tensors[f"src.experts.{e}.gate_proj.weight_scale_inv"],
                          tensors[f"src.experts.{e}.up_proj.weight_scale_inv"]])
        assert torch.equal(s[e], want)
    assert torch.equal(got["src.experts.down_proj_scale_inv"][1], tensors["src.experts.1.down_proj.weight_scale_inv"])


def test_transposed_fp8_transposes_the_scale_grid(tmp_path):
    src = group("per-expert", 2, 300, 128)
    tensors = source_tensors(src, "F8_E4M3", 9)
    refs = save(tensors, tmp_path / "s.safetensors")
    path, _ = write(convert_group(src, refs, src.with_layout(ExpertLayout("stacked-transposed"))), tmp_path / "o")
    got = load(path)
    assert got["src.experts_gate_proj_scale_inv"].shape == (2, 3, 1)
    assert torch.equal(got["src.experts_down_proj_scale_inv"][1],
                       tensors["src.experts.1.down_proj.weight_scale_inv"].T)
    w = got["src.experts_gate_proj"][0].view(torch.uint8)
    assert torch.equal(w, tensors["src.experts.0.gate_proj.weight"].view(torch.uint8).T)


def test_dequant_hook_pairs_each_piece_with_its_scales(tmp_path):
    """A dequantizer sees canonical pieces with their own scale grids, whatever the layouts."""
    E, H, inter = 2, 136, 128

    class Ref:  # a float64 reference dequantizer, test-local (the real one is the block codec, model.quant.decode_fp8)
        dtype = "F32"

        def __call__(self, w, s, block, weight_dtype, scale_dtype):
            assert (weight_dtype, scale_dtype) == ("F8_E4M3", "F32")
            vals = torch.from_numpy(np.ascontiguousarray(w)).view(torch.float8_e4m3fn).to(torch.float64)
            full = torch.from_numpy(np.asarray(s, dtype=np.float64)).repeat_interleave(block[0], 0)
            full = full.repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
            return (vals * full).to(torch.float32).numpy()

    src = group("fused", E, H, inter)
    gen = torch.Generator().manual_seed(2)
    tensors = {}
    for t in src.tensors():  # finite FP8 codes only
        tensors[t.key] = (torch.rand(t.shape, generator=gen) * 8 - 4).to(torch.float8_e4m3fn)
        tensors[scale_key(t.key)] = torch.rand(scale_shape(t.shape), generator=gen) + 0.5
    refs = save(tensors, tmp_path / "s.safetensors")
    per = src.with_layout(ExpertLayout("per-expert"))
    path, _ = write(convert_group(src, refs, per, dequant=Ref()), tmp_path / "per")
    reference = load(path)
    gu = tensors["src.experts.gate_up_proj"].to(torch.float64)
    sc = tensors["src.experts.gate_up_proj_scale_inv"].to(torch.float64)
    want_up1 = gu[1, inter:] * sc[1, 1:].repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :H]
    assert torch.equal(reference["src.experts.1.up_proj.weight"], want_up1.to(torch.float32))
    for layout in ("fused-transposed:interleaved", "stacked-transposed"):
        dst = src.with_layout(ExpertLayout.parse(layout))
        out, _ = write(convert_group(src, refs, dst, dequant=Ref()), tmp_path / layout)
        got = load(out)
        assert all(v.dtype == torch.float32 for v in got.values()) and not any("scale" in k for k in got)
        per_refs = save(reference, tmp_path / f"{layout}-ref.safetensors")
        ref_out, _ = write(convert_group(per, per_refs, dst), tmp_path / f"{layout}-ref")
        want = load(ref_out)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


# ---------------------------------------------------------------------------
# Errors: every problem named, with its key and rule


def _refs_without(tmp_path, g: ExpertGroup, drop=(), rename=None, dtype="BF16", reshape=None) -> dict:
    tensors = source_tensors(g, dtype, 0)
    for k in drop:
        del tensors[k]
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    for k, shape in (reshape or {}).items():
        tensors[k] = torch.zeros(shape, dtype=tensors[k].dtype)
    return save(tensors, tmp_path / "bad.safetensors")


def test_missing_projection_is_named(tmp_path):
    g = group("per-expert", 4, 8, 4)
    refs = _refs_without(tmp_path, g, drop=["src.experts.2.up_proj.weight"])
    with pytest.raises(PlanError) as err:
        convert_group(g, refs, g.with_layout(ExpertLayout("fused")))
    assert err.value.rule == "expert-missing"
    assert "src.experts.2.up_proj.weight" in str(err.value)


def test_non_contiguous_expert_indices(tmp_path):
    g = group("per-expert", 4, 8, 4)
    ren = {f"src.experts.2.{p}_proj.weight": f"src.experts.7.{p}_proj.weight" for p in ("gate", "up", "down")}
    refs = _refs_without(tmp_path, g, rename=ren)
    with pytest.raises(PlanError) as err:
        check_group(g, refs)
    msg = str(err.value)
    assert "[expert-noncontiguous]" in msg and "found 0-1, 3, 7, no 2, 4-6" in msg
    assert "src.experts.7.gate_proj.weight: expert index 7" in msg and "missing src.experts.2.down_proj.weight" in msg


def test_fewer_experts_than_config(tmp_path):
    g = group("per-expert", 4, 8, 4)
    refs = _refs_without(tmp_path, g, drop=[f"src.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")])
    with pytest.raises(PlanError, match=r"\[expert-count\] src.experts has experts 0..2, the config has 4"):
        check_group(g, refs)


def test_shape_disagreeing_with_config(tmp_path):
    g = group("fused", 4, 8, 4)
    refs = _refs_without(tmp_path, g, reshape={"src.experts.gate_up_proj": (4, 6, 8)})
    with pytest.raises(PlanError) as err:
        check_group(g, refs)
    assert err.value.rule == "expert-shape"
    assert "src.experts.gate_up_proj in " in str(err.value) and "[4, 6, 8], the config implies [4, 8, 8]" in str(
        err.value)


def test_stale_other_layout_left_over(tmp_path):
    """Fused tensors next to per-expert ones (the speculators single-file stitch bug) are refused."""
    g = group("per-expert", 2, 8, 4)
    tensors = source_tensors(g, "BF16", 0)
    tensors["src.experts.gate_up_proj"] = torch.zeros(2, 8, 8, dtype=torch.bfloat16)
    refs = save(tensors, tmp_path / "s.safetensors")
    with pytest.raises(PlanError, match=r"\[expert-layouts-mixed\] src.experts.gate_up_proj: a tensor of the fused "):
        check_group(g, refs)  # the gate's rule (consistency.mixed_layout_problems): the same finding


def test_fp8_without_scale(tmp_path):
    g = group("stacked", 2, 8, 4)
    refs = _refs_without(tmp_path, g, dtype="F8_E4M3", drop=["src.experts.up_proj.weight_scale_inv"])
    with pytest.raises(PlanError, match=r"\[fp8-scale-missing\] FP8 weight src.experts.up_proj.weight has no "
                                        r"src.experts.up_proj.weight_scale_inv"):
        check_group(g, refs)


def test_fp8_scale_fusion_needs_aligned_inter(tmp_path):
    g = group("per-expert", 2, 64, 32)
    refs = _refs_without(tmp_path, g, dtype="F8_E4M3")
    with pytest.raises(PlanError) as err:
        convert_group(g, refs, g.with_layout(ExpertLayout("fused")))
    msg = str(err.value)
    assert err.value.rule == "fp8-scale-fusion" and "src.experts.gate_up_proj_scale_inv" in msg
    assert "I=32 is not a multiple of the 128" in msg and "--dequant" in msg
    stacked = convert_group(g, refs, g.with_layout(ExpertLayout("stacked")))  # gate and up kept apart: fine
    assert len(stacked) == 6


def test_mixed_dtypes_refused(tmp_path):
    g = group("per-expert", 2, 8, 4)
    tensors = source_tensors(g, "BF16", 0)
    tensors["src.experts.1.down_proj.weight"] = tensors["src.experts.1.down_proj.weight"].float()
    refs = save(tensors, tmp_path / "s.safetensors")
    with pytest.raises(PlanError, match=r"\[expert-dtype\] src.experts.1.down_proj.weight is F32"):
        check_group(g, refs)


def test_non_gated_cannot_hold_gate_up_options(tmp_path):
    g = group("per-expert", 2, 8, 4, gated=False)
    refs = save(source_tensors(g, "BF16", 0), tmp_path / "s.safetensors")
    with pytest.raises(PlanError) as err:
        convert_group(g, refs, g.with_layout(ExpertLayout.parse("fused-transposed:interleaved")))
    assert err.value.rule == "layout-unsupported" and "non-gated" in str(err.value)


def test_layout_labels_parse_back():
    for text in GATED:
        lay = ExpertLayout.parse(text)
        assert layout_from_label(lay.label()) == lay == layout_from_label(text)


def test_block_dequant_adapter_matches_fp8_module(tmp_path):
    """The shipped Dequantizer (BlockDequant: ckpt_tools.model.quant.decode_fp8) gives each expert exactly the block-FP8
    definition of its own pieces."""
    from ckpt_tools.model.experts import BlockDequant

    from quant_helpers import fp8_dequant

    src = group("per-expert", 2, 130, 256)
    gen = torch.Generator().manual_seed(4)
    tensors = {}
    for t in src.tensors():
        tensors[t.key] = (torch.rand(t.shape, generator=gen) * 8 - 4).to(torch.float8_e4m3fn)
        tensors[scale_key(t.key)] = torch.rand(scale_shape(t.shape), generator=gen) + 0.5
    refs = save(tensors, tmp_path / "s.safetensors")
    dst = src.with_layout(ExpertLayout("fused-transposed"))
    path, _ = write(convert_group(src, refs, dst, dequant=BlockDequant("BF16")), tmp_path / "o")
    got = load(path)
    assert set(got) == {"src.experts.gate_up_proj", "src.experts.down_proj"}
    for e in range(2):
        def deq(p, e=e):
            k = f"src.experts.{e}.{p}_proj.weight"
            return fp8_dequant(tensors[k], tensors[scale_key(k)], dtype=torch.bfloat16)

        assert torch.equal(got["src.experts.gate_up_proj"][e], torch.cat([deq("gate").T, deq("up").T], dim=1))
        assert torch.equal(got["src.experts.down_proj"][e], deq("down").T)


def test_detect_tells_fused_from_fused_transposed_by_shape(tmp_path):
    """Both store P.gate_up_proj / P.down_proj: only the shapes differ (mtp.detect_group_layout)."""
    from ckpt_tools.model.mtp import detect_group_layout

    shipped = group("per-expert", 3, 8, 6)
    for layout in ("fused", "fused-transposed", "stacked-transposed", "per-expert"):
        g = shipped.with_layout(ExpertLayout(layout))
        refs = save(source_tensors(g, "BF16", 0), tmp_path / f"{layout}.safetensors")
        assert detect_group_layout(shipped, refs).name == layout
