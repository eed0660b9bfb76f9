"""FP8 block quantization against independent oracles.

The oracles here never use torch's float8 casts: e4m3 / e5m2 bytes are decoded with
tables built from the bit layout, products are exact in float64, roundings are done
with numpy (float32 division, float32 -> bfloat16 by bit arithmetic, e4m3 round to
nearest even by searching the table). Files are written by safetensors.save_file and
read back by safetensors, so the writer and our reader are checked too.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ckpt_tools import fp8, fp8_decode
from ckpt_tools.config import ConfigView
from ckpt_tools.errors import InputError, PlanError
from ckpt_tools.plan import OutputTensor, Plan
from ckpt_tools.safetensors_io import LocalFile, read_header, refs_from_header
from ckpt_tools.writer import execute

# ---------------------------------------------------------------------------
# Independent oracles (numpy, float64)


def e4m3_table() -> np.ndarray:
    """float64 value of every e4m3fn byte: sign, 4-bit exponent (bias 7), 3-bit mantissa; 0x7f/0xff NaN."""
    out = np.empty(256)
    for b in range(256):
        sign = -1.0 if b >> 7 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            out[b] = np.nan
        elif e == 0:
            out[b] = sign * (m / 8) * 2.0**-6
        else:
            out[b] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return out


def e5m2_table() -> np.ndarray:
    """float64 value of every e5m2 byte: 5-bit exponent (bias 15), 2-bit mantissa, IEEE inf/NaN."""
    out = np.empty(256)
    for b in range(256):
        sign = -1.0 if b >> 7 else 1.0
        e, m = (b >> 2) & 0x1F, b & 0x3
        if e == 0x1F:
            out[b] = sign * np.inf if m == 0 else np.nan
        elif e == 0:
            out[b] = sign * (m / 4) * 2.0**-14
        else:
            out[b] = sign * (1 + m / 4) * 2.0 ** (e - 15)
    return out


E4M3 = e4m3_table()
E5M2 = e5m2_table()
FINITE_BYTES = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)


def ref_dequant(qb: np.ndarray, scale: np.ndarray, block, table=E4M3) -> np.ndarray:
    """float64 q * scale with explicit loops over blocks (the product is exact: 4 x 24 bits < 53)."""
    br, bc = block
    lead = qb.shape[:-2]
    rows, cols = qb.shape[-2:]
    out = np.empty(qb.shape)
    for li in np.ndindex(*lead):
        for i in range(scale.shape[-2]):
            for j in range(scale.shape[-1]):
                rs = slice(i * br, min((i + 1) * br, rows))
                cs = slice(j * bc, min((j + 1) * bc, cols))
                out[li + (rs, cs)] = table[qb[li + (rs, cs)]] * np.float64(scale[li + (i, j)])
    return out


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) by bit arithmetic; NaNs stay NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def ref_e4m3_rne(v: np.ndarray) -> np.ndarray:
    """Bytes of the nearest e4m3fn value (ties to even mantissa), saturating at +-448."""
    pos = E4M3[:127]  # bytes 0x00..0x7e, increasing
    a = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(pos, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = a - pos[lo], pos[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(pos[hi] == a, hi, pick)
    return (pick | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def ref_quantize(w32: np.ndarray, block):
    """numpy block quantization with the documented rule: max(fl32(amax / 448), 2**-126)."""
    br, bc = block
    lead = w32.shape[:-2]
    rows, cols = w32.shape[-2:]
    gr, gc = -(-rows // br), -(-cols // bc)
    scale = np.empty((*lead, gr, gc), dtype=np.float32)
    qb = np.empty(w32.shape, dtype=np.uint8)
    for li in np.ndindex(*lead):
        for i in range(gr):
            for j in range(gc):
                idx = li + (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
                tile = w32[idx]
                amax = np.abs(tile).max()
                s = np.float32(amax) / np.float32(448.0)
                s = np.float32(2.0**-126) if s < 2.0**-126 else s
                scale[li + (i, j)] = s
                qb[idx] = ref_e4m3_rne((tile / s).astype(np.float32).astype(np.float64))
    return qb, scale


def q_bytes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def random_fp8(rng, shape, block, *, finite_only=True, scale_exp=(-20, 4)):
    """Random fp8 bytes and float32 scales spanning many binades."""
    qb = rng.choice(FINITE_BYTES if finite_only else np.arange(256, dtype=np.uint8), size=shape).astype(np.uint8)
    gshape = fp8.grid_shape(shape, block)
    scale = (rng.uniform(1, 2, gshape) * 2.0 ** rng.integers(*scale_exp, gshape)).astype(np.float32)
    scale *= rng.choice([-1, 1], gshape).astype(np.float32)
    return qb, scale


def as_fp8(qb: np.ndarray, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    return torch.from_numpy(qb.copy()).view(dtype)


# ---------------------------------------------------------------------------
# Files: written by safetensors, read through our refs, written by our writer


class Recording:
    """A ByteSource that records every range read (to prove a recipe stays inside its tensors)."""

    def __init__(self, inner: LocalFile) -> None:
        self.inner = inner
        self.name = inner.name
        self.ranges: list[tuple[int, int]] = []

    @property
    def size(self) -> int:
        return self.inner.size

    def readinto(self, offset, buf) -> None:
        self.ranges.append((offset, len(buf)))
        self.inner.readinto(offset, buf)

    def local_fd(self):
        return self.inner.local_fd()


def write_refs(path, tensors: dict[str, torch.Tensor]):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    src = Recording(LocalFile(path))
    return refs_from_header(src, read_header(src)), src


def run_plan(tmp_path, outputs: list[OutputTensor], name="out") -> dict[str, torch.Tensor]:
    out = tmp_path / name
    execute(Plan(command="test", tensors=outputs), out)
    return load_file(str(out / "model.safetensors"))


# ---------------------------------------------------------------------------
# Dequantization


@pytest.mark.parametrize("fmt,table", [(torch.float8_e4m3fn, E4M3), (torch.float8_e5m2, E5M2)])
def test_every_byte_decodes_as_the_bit_layout_says(fmt, table):
    qb = np.arange(256, dtype=np.uint8).reshape(2, 128)
    for s in (1.0, 0.75, 2.0**-100, 2.0**120 * 1.5):  # the last takes the overflow-safe path
        scale = np.full((1, 1), s, dtype=np.float32)
        got = fp8.dequantize(as_fp8(qb, fmt), torch.from_numpy(scale)).numpy()
        with np.errstate(over="ignore"):
            want = (table[qb] * np.float64(s)).astype(np.float32)
        np.testing.assert_array_equal(got, want)  # NaN == NaN here; inf and signed zeros must match
        assert np.array_equal(np.signbit(got[~np.isnan(got)]), np.signbit(want[~np.isnan(want)]))


@pytest.mark.parametrize(
    "shape,block",
    [
        ((300, 200), (128, 128)),
        ((576, 896), (128, 128)),  # kv_a_proj_with_mqa proportions: 576 = 4.5 blocks
        ((4, 130, 257), (128, 128)),  # expert stack with edge tiles both ways
        ((1, 5), (128, 128)),
        ((200, 100), (64, 48)),  # non-square block
    ],
)
def test_dequantize_matches_float64_reference(shape, block):
    rng = np.random.default_rng(sum(shape))
    qb, scale = random_fp8(rng, shape, block)
    qb.reshape(-1)[:3] = [0x7F, 0xFF, 0x80]  # NaNs and -0
    got = fp8.dequantize(as_fp8(qb), torch.from_numpy(scale), block).numpy()
    want = ref_dequant(qb, scale, block).astype(np.float32)  # one rounding of the exact product
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32 and got.shape == shape


def test_dequantize_to_other_dtypes_and_from_a_stream(monkeypatch):
    monkeypatch.setattr(fp8, "BAND_ELEMS", 4000)
    rng = np.random.default_rng(12)
    qb, scale = random_fp8(rng, (3, 130, 257), (128, 128))
    q, s = as_fp8(qb), torch.from_numpy(scale)
    exact32 = ref_dequant(qb, scale, (128, 128)).astype(np.float32)
    got = fp8.dequantize(q, s, dtype=torch.bfloat16)
    np.testing.assert_array_equal(got.view(torch.int16).numpy().view(np.uint16), f32_to_bf16_bits(exact32))
    np.testing.assert_array_equal(fp8.dequantize(q, s, dtype=torch.float16).numpy(), exact32.astype(np.float16))
    # a sequential reader (e.g. over another recipe's bytes), consumed in odd-sized pieces
    data = qb.tobytes()
    pos = 0

    def read(n):
        nonlocal pos
        pos += n
        piece = data[pos - n : pos]
        return bytearray(piece) if pos % 2 else piece  # writable (used in place) or read-only (copied)

    monkeypatch.setattr(fp8_decode, "BAND_ELEMS", 4000)
    chunks = list(fp8_decode.dequant_stream(read, qb.shape, "F8_E4M3", scale, "BF16"))
    assert len(chunks) > 3 and pos == len(data)
    streamed = np.concatenate([c.reshape(-1) for c in chunks])
    np.testing.assert_array_equal(streamed, f32_to_bf16_bits(exact32).reshape(-1))
    with pytest.raises(InputError, match="fp8-stream"):
        list(fp8_decode.dequant_stream(lambda n: b"\0" * (n - 1), qb.shape, "F8_E4M3", scale))


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("out", ["BF16", "F16", "F32"])
def test_numpy_dequantizer_matches_torch_byte_for_byte(fmt, out, monkeypatch):
    """fp8_decode (numpy, the extract path) against fp8.dequantize (torch): every code, scales
    from subnormal products to overflow, NaN and Inf scales, edge tiles, stacked experts."""
    from ckpt_tools.dtypes import torch_dtype

    monkeypatch.setattr(fp8_decode, "BAND_ELEMS", 3000)  # several bands per block row and across rows
    rng = np.random.default_rng(7)
    shape, block = (2, 300, 261), (128, 128)
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[0, 0, :256] = np.arange(256, dtype=np.uint8)  # every code at least once
    grid = (2, 3, 3)
    scale = np.exp2(rng.uniform(-30, 30, size=grid)).astype(np.float32)
    scale[0, 0, 0] = 2.0**-140  # products go subnormal
    scale[0, 1, 1] = 3e38  # products overflow to +-inf
    scale[1, 2, 2] = np.nan
    scale[1, 0, 1] = np.inf
    tdt = torch_dtype(out)
    q = torch.from_numpy(codes).view(torch.float8_e4m3fn if fmt == "F8_E4M3" else torch.float8_e5m2)
    want = fp8.dequantize(q, torch.from_numpy(scale), block, dtype=tdt).contiguous()
    got = fp8_decode.dequant_array(codes, scale, block, fmt, out)
    assert got.shape == shape
    want_bits = want.view(torch.int16 if out != "F32" else torch.int32).numpy()
    got_bits = got.view(want_bits.dtype)
    nan = torch.isnan(want.float()).numpy()
    got_values = torch.from_numpy(got_bits.copy()).view(tdt).float().numpy()
    assert nan.any()
    # NaN signs and payloads follow no standard (torch differs between its own paths): NaN where
    # torch has NaN, every other value byte for byte
    np.testing.assert_array_equal(np.isnan(got_values), nan)
    np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])


def test_dequantize_survives_flush_denormal_mode():
    qb = np.arange(0, 128, dtype=np.uint8).reshape(1, 128)  # includes e4m3 subnormals 0x01..0x07
    want = ref_dequant(qb, np.ones((1, 1), np.float32), (128, 128)).astype(np.float32)
    assert torch.set_flush_denormal(True)
    try:
        got = fp8.dequantize(as_fp8(qb), torch.ones(1, 1)).numpy()
    finally:
        torch.set_flush_denormal(False)
    np.testing.assert_array_equal(got, want)


def test_dequantize_rejects_a_wrong_scale_grid():
    q = torch.zeros(300, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(PlanError, match="fp8-scale-shape"):
        fp8.dequantize(q, torch.ones(2, 2))
    with pytest.raises(InputError, match="fp8-dtype"):
        fp8.dequantize(torch.zeros(4, 4), torch.ones(1, 1))


def test_dequantize_agrees_with_transformers_fp8_dequantize():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rng = np.random.default_rng(7)
    qb, scale = random_fp8(rng, (2, 256, 384), (128, 128))
    q, s = as_fp8(qb), torch.from_numpy(scale)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)
    assert torch.equal(fp8.dequantize(q, s).to(torch.bfloat16).view(torch.int16), theirs.view(torch.int16))


@pytest.mark.parametrize(
    "out_dtype,band",
    [
        ("BF16", 3000),  # several bands per block row, partial bands included
        ("F16", 3000),
        ("F32", 3000),
        ("BF16", 60000),  # bands of two block rows (a), of one (e)
        ("BF16", 1 << 20),  # whole matrices per band
    ],
)
def test_dequant_recipe_through_writer(tmp_path, monkeypatch, out_dtype, band):
    monkeypatch.setattr(fp8, "BAND_ELEMS", band)
    rng = np.random.default_rng(3)
    qa, sa = random_fp8(rng, (300, 200), (128, 128), scale_exp=(-12, 0))
    qe, se = random_fp8(rng, (3, 130, 257), (128, 128), scale_exp=(-12, 0))
    refs, src = write_refs(
        tmp_path / "in.safetensors",
        {
            "a.weight": as_fp8(qa),
            "a.weight_scale_inv": torch.from_numpy(sa),
            "pad": torch.ones(7, dtype=torch.bfloat16),  # neighbours that must not be read
            "e.weight": as_fp8(qe),
            "e.weight_scale_inv": torch.from_numpy(se),
        },
    )
    src.ranges.clear()  # header reads are done; from here on only the recipes read
    outs = [
        OutputTensor(k, out_dtype, refs[k].shape, fp8.dequant_recipe(refs[k], refs[k + "_scale_inv"], out_dtype))
        for k in ("a.weight", "e.weight")
    ]
    got = run_plan(tmp_path, outs)
    for k, qb, sc in (("a.weight", qa, sa), ("e.weight", qe, se)):
        exact32 = ref_dequant(qb, sc, (128, 128)).astype(np.float32)
        if out_dtype == "BF16":
            np.testing.assert_array_equal(got[k].view(torch.int16).numpy().view(np.uint16), f32_to_bf16_bits(exact32))
        elif out_dtype == "F16":
            np.testing.assert_array_equal(got[k].numpy(), exact32.astype(np.float16))
        else:
            np.testing.assert_array_equal(got[k].numpy(), exact32)
    # every read stays inside the weights and scales it was given
    allowed = [(refs[k].offset, refs[k].offset + refs[k].nbytes) for k in refs if k != "pad"]
    data_reads = [(o, n) for o, n in src.ranges if n]
    for o, n in data_reads:
        assert any(a <= o and o + n <= b for a, b in allowed), (o, n)
    assert sum(n for o, n in data_reads) == sum(b - a for a, b in allowed)


def test_dequant_recipe_checks_at_plan_time(tmp_path):
    refs, _ = write_refs(
        tmp_path / "x.safetensors",
        {
            "w": torch.zeros(300, 200, dtype=torch.float8_e4m3fn),
            "s_bad": torch.ones(2, 2),
            "s": torch.ones(3, 2),
            "b": torch.zeros(300, 200, dtype=torch.bfloat16),
        },
    )
    with pytest.raises(PlanError, match="fp8-scale-shape") as e:
        fp8.dequant_recipe(refs["w"], refs["s_bad"])
    assert "x.safetensors" in str(e.value) and "s_bad" in str(e.value)
    with pytest.raises(PlanError, match="fp8-dtype"):
        fp8.dequant_recipe(refs["b"], refs["s"])
    with pytest.raises(PlanError, match="fp8-out-dtype"):
        fp8.dequant_recipe(refs["w"], refs["s"], "F8_E4M3")
    assert fp8.dequant_recipe(refs["w"], refs["s"], "bf16").describe()["to"] == "BF16"


def test_dequant_recipe_windows_and_e8m0_scales(tmp_path):
    rng = np.random.default_rng(4)
    qb, sc = random_fp8(rng, (3, 256, 200), (128, 128), scale_exp=(-12, 0))
    e8 = rng.integers(100, 130, (3, 2, 2)).astype(np.uint8)  # UE8M0 scales: 2**(b - 127)
    refs, _ = write_refs(
        tmp_path / "w.safetensors",
        {"w": as_fp8(qb), "s": torch.from_numpy(sc), "s8": torch.from_numpy(e8).view(torch.float8_e8m0fnu)},
    )
    outs = [
        OutputTensor("one", "BF16", (256, 200),
                     fp8.dequant_recipe(fp8.TensorRows(refs["w"], expert=2), fp8.TensorRows(refs["s"], expert=2))),
        OutputTensor("up", "F32", (3, 128, 200),  # rows 128..256 of every expert, e.g. the up half of gate_up
                     fp8.dequant_recipe(fp8.TensorRows(refs["w"], rows=(128, 256)),
                                        fp8.TensorRows(refs["s"], rows=(1, 2)), "F32")),
        OutputTensor("e8", "F32", (3, 256, 200), fp8.dequant_recipe(refs["w"], refs["s8"], "F32")),
    ]
    got = run_plan(tmp_path, outs)
    full = ref_dequant(qb, sc, (128, 128)).astype(np.float32)
    np.testing.assert_array_equal(got["one"].view(torch.int16).numpy().view(np.uint16), f32_to_bf16_bits(full[2]))
    np.testing.assert_array_equal(got["up"].numpy(), full[:, 128:])
    want8 = ref_dequant(qb, (2.0 ** (e8.astype(np.float64) - 127)).astype(np.float32), (128, 128))
    np.testing.assert_array_equal(got["e8"].numpy(), want8.astype(np.float32))
    with pytest.raises(PlanError, match="fp8-block-misaligned"):
        fp8.dequant_recipe(fp8.TensorRows(refs["w"], rows=(64, 192)), fp8.TensorRows(refs["s"], rows=(0, 1)))


def test_prefetch_worker_stops_and_restores_threads(tmp_path):
    rng = np.random.default_rng(8)
    qb, sc = random_fp8(rng, (4, 128, 300), (128, 128))
    refs, _ = write_refs(tmp_path / "p.safetensors", {"w": as_fp8(qb), "s": torch.from_numpy(sc)})
    threads_before, workers_before = torch.get_num_threads(), threading.active_count()
    gen = fp8.dequant_recipe(refs["w"], refs["s"]).produce()
    first = next(gen)
    assert first.dtype == torch.bfloat16
    gen.close()  # the writer stops early (an error elsewhere): the worker must end
    assert threading.active_count() == workers_before
    assert torch.get_num_threads() == threads_before
    chunks = list(fp8.dequant_recipe(refs["w"], refs["s"]).produce())
    assert sum(c.numel() for c in chunks) == qb.size and torch.get_num_threads() == threads_before
    assert not any(c.untyped_storage().data_ptr() == chunks[0].untyped_storage().data_ptr() for c in chunks[1:])


# ---------------------------------------------------------------------------
# Quantization


def test_quantize_matches_numpy_oracle_and_error_bound():
    rng = np.random.default_rng(11)
    block = (128, 128)
    w = (rng.standard_normal((3, 260, 300)) * 0.02).astype(np.float32)
    w[0, :128, :128] *= 1e-3  # blocks of very different magnitudes
    w[1, 128:256, 128:256] = 0.0  # a zero block
    w[2, 5, 7] = -0.0
    w[2, 256:, 256:] = rng.standard_normal((4, 44)).astype(np.float32) * 1e-40  # float32 subnormals
    q, s = fp8.quantize(torch.from_numpy(w), block)
    want_q, want_s = ref_quantize(w, block)
    np.testing.assert_array_equal(s.numpy(), want_s)
    np.testing.assert_array_equal(q_bytes(q), want_q)
    assert s[1, 1, 1] == 2.0**-126 and not q_bytes(q)[1, 128:256, 128:256].any()
    assert s[2, 2, 2] == 2.0**-126 and torch.isfinite(s).all()

    # per-block error: half an e4m3 step (2**-4 relative for normals, 2**-10 * scale below 2**-6 * scale)
    sf = s.double().repeat_interleave(128, -2)[:, :260].repeat_interleave(128, -1)[..., :300].numpy()
    v = w.astype(np.float64) / sf
    err = np.abs(E4M3[q_bytes(q)] - v)
    normal = np.abs(v) >= 2.0**-6
    slack = 1 + 2.0**-20  # one float32 rounding of w / s before the e4m3 rounding
    assert (err[normal] <= 2.0**-4 * np.abs(v[normal]) * slack).all()
    assert (err[~normal] <= 2.0**-10 * slack).all()


def test_quantize_rounds_ties_to_even():
    # with 448 in the block the scale is exactly 1, so these are the e4m3 inputs themselves
    ties = [1.0625, 1.1875, 248.0, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 0.5 * 2.0**-9, -1.0625, 1.0625 + 2.0**-20]
    want = [1.0, 1.25, 256.0, 2 * 2.0**-9, 2 * 2.0**-9, 0.0, -1.0, 1.125]
    q, s = fp8.quantize(torch.tensor([[448.0, *ties]]))
    assert s.item() == 1.0
    assert E4M3[q_bytes(q)[0, 1:]].tolist() == want
    assert np.array_equal(q_bytes(q)[0], ref_e4m3_rne(np.array([448.0, *ties])))


def test_quantize_saturates_at_448():
    # a block whose amax maps to exactly 448: q is 0x7e and the scale is exact
    w = torch.tensor([[448.0, -448.0, 1.0, 0.0]])
    q, s = fp8.quantize(w)
    assert s.item() == 1.0 and q_bytes(q).tolist() == [[0x7E, 0xFE, 0x38, 0x00]]
    # values beyond 448 clamp (torch's cast alone differs between versions and devices)
    y = torch.tensor([448.0, 449.0, 463.9, 464.0, 470.0, 1e6, -1e30])
    assert q_bytes(fp8._to_e4m3(y)).tolist() == [0x7E] * 6 + [0xFE]
    # amaxes for which fl(amax / fl(amax / 448)) > 448 still give 0x7e
    x = (torch.rand(4096, dtype=torch.float64) * 1000 + 1).to(torch.float32)
    over = x / (x / 448.0) > 448.0
    assert over.any()
    for amax in x[over][:16]:
        q, s = fp8.quantize(torch.tensor([[amax.item(), -amax.item() / 3]]))
        assert q_bytes(q)[0, 0] == 0x7E and s.item() == np.float32(amax.item()) / np.float32(448)


def test_quantize_refuses_nan_and_inf():
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.zeros(256, 256)
        w[200, 3] = bad
        with pytest.raises(InputError, match="fp8-nonfinite") as e:
            fp8.quantize(w)
        assert "[1, 0]" in str(e.value)  # the block is named


def test_fixed_point_scale_formula_exhaustive():
    """fl(fl(448 * s) / 448) == s for every s = fl(x / 448), x over a whole binade [448, 896).

    Scaling x by a power of two scales every intermediate exactly (normal range), so one binade
    is a proof for all normal scales; the dequantized block maximum is fl(448 * s)."""
    lo, hi = np.array([448.0, 896.0], dtype=np.float32).view(np.uint32)
    x = np.arange(lo, hi, dtype=np.uint32).view(np.float32)
    c = np.float32(448.0)
    s = x / c
    assert np.array_equal((s * c) / c, s)
    assert np.abs(x / s - 448).max() < 16  # the amax element always rounds to 448


def test_fixed_point_every_code_and_many_scales():
    """e4m3(fl(fl(q * s) / s)) == q for all 254 finite codes and 4096 scales of quantize's form."""
    rng = np.random.default_rng(5)
    x = (rng.uniform(1, 2, 4096) * 2.0 ** rng.integers(-118, 100, 4096)).astype(np.float32)
    s = np.maximum(x / np.float32(448), np.float32(2.0**-126))  # down to the floor: subnormal products too
    qv = E4M3[FINITE_BYTES].astype(np.float32)
    w = qv[None, :] * s[:, None]  # float32 products: dequantize
    back = ref_e4m3_rne((w / s[:, None]).astype(np.float64))
    assert np.array_equal(back, np.broadcast_to(FINITE_BYTES, back.shape))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 300), cols=st.integers(1, 300), lead=st.integers(0, 2),
    br=st.sampled_from([16, 64, 128]), bc=st.sampled_from([32, 48, 128]),
    exp=st.integers(-60, 40), seed=st.integers(0, 2**32 - 1),
)
def test_property_random_shapes_and_blocks(rows, cols, lead, br, bc, exp, seed):
    rng = np.random.default_rng(seed)
    shape = (lead, rows, cols) if lead else (rows, cols)
    w = (rng.standard_normal(shape) * 2.0**exp).astype(np.float32)
    q, s = fp8.quantize(torch.from_numpy(w), (br, bc))
    want_q, want_s = ref_quantize(w, (br, bc))
    assert np.array_equal(q_bytes(q), want_q) and np.array_equal(s.numpy(), want_s)
    d = fp8.dequantize(q, s, (br, bc))
    np.testing.assert_array_equal(d.numpy(), ref_dequant(want_q, want_s, (br, bc)).astype(np.float32))
    q2, s2 = fp8.quantize(d, (br, bc))
    assert np.array_equal(q_bytes(q2), want_q) and torch.equal(s2, s)


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 257), (256, 384)])
def test_quantize_dequantize_is_a_fixed_point(shape):
    rng = np.random.default_rng(len(shape))
    w = rng.standard_normal(shape).astype(np.float32) * 2.0 ** rng.integers(-30, 10)
    w.reshape(-1)[:254] = E4M3[FINITE_BYTES]  # every finite code appears
    w[..., :128, :128] = 0.0  # a zero block
    q, s = fp8.quantize(torch.from_numpy(w))
    q2, s2 = fp8.quantize(fp8.dequantize(q, s))
    assert np.array_equal(q_bytes(q2), q_bytes(q)) and torch.equal(s2.view(torch.int32), s.view(torch.int32))
    # tiny blocks (floored scale, some rounding to all-zero codes) too
    q, s = fp8.quantize(torch.from_numpy(w * np.float32(1e-36)))
    assert (s >= 2.0**-126).all() and (s == 2.0**-126).any()
    q2, s2 = fp8.quantize(fp8.dequantize(q, s))
    assert np.array_equal(q_bytes(q2), q_bytes(q)) and torch.equal(s2, s)


def test_requant_recipes_match_quantize(tmp_path):
    rng = np.random.default_rng(2)
    a = torch.from_numpy(rng.standard_normal((300, 200)).astype(np.float32) * 0.02).to(torch.bfloat16)
    e = torch.from_numpy(rng.standard_normal((3, 260, 257)).astype(np.float32) * 0.02)
    refs, src = write_refs(tmp_path / "d.safetensors", {"a": a, "e": e})
    outs = fp8.requant_recipes(refs["a"]).outputs("a.weight", "a.weight_scale_inv", meta={"source": "a"})
    outs += fp8.requant_recipes(refs["e"]).outputs("e.weight", "e.weight_scale_inv")
    # a window: expert 1, the second half of its rows (like the up half of a fused gate_up)
    win = fp8.requant_recipes(fp8.TensorRows(refs["e"], expert=1, rows=(130, 260)))
    outs += win.outputs("up.weight", "up.weight_scale_inv")
    assert outs[0].dtype == "F8_E4M3" and outs[1].dtype == "F32" and outs[1].shape == (3, 2)
    assert win.shape == (130, 257) and win.scale_shape == (2, 3)
    got = run_plan(tmp_path, outs)
    for key, values in (("a", a), ("e", e), ("up", e[1, 130:])):
        q, s = fp8.quantize(values)
        assert got[f"{key}.weight"].dtype == torch.float8_e4m3fn
        assert np.array_equal(q_bytes(got[f"{key}.weight"]), q_bytes(q))
        assert torch.equal(got[f"{key}.weight_scale_inv"], s)


def test_requant_recipe_refuses_nonfinite_when_producing(tmp_path):
    w = torch.zeros(130, 10)
    w[129, 9] = float("nan")
    refs, _ = write_refs(tmp_path / "n.safetensors", {"w": w, "i": torch.zeros(4, 4, dtype=torch.int32)})
    r = fp8.requant_recipes(refs["w"])
    for recipe in (r.scale, r.weight):  # the weight recipe raises from its worker thread
        with pytest.raises(InputError, match="fp8-nonfinite") as e:
            list(recipe.produce())
        assert "w (rows 128..130)" in str(e.value) and "n.safetensors" in str(e.value)
    with pytest.raises(PlanError, match="fp8-dtype"):
        fp8.requant_recipes(refs["i"])


# ---------------------------------------------------------------------------
# Round trip: dequantize -> bf16 draft -> unchanged?


@pytest.mark.parametrize("band", [5000, 1 << 20])
def test_unchanged_after_dequant(tmp_path, monkeypatch, band):
    monkeypatch.setattr(fp8, "BAND_ELEMS", band)
    rng = np.random.default_rng(9)
    qb, sc = random_fp8(rng, (3, 130, 257), (128, 128), scale_exp=(-12, 0))
    vrefs, _ = write_refs(tmp_path / "v.safetensors", {"w": as_fp8(qb), "w_scale_inv": torch.from_numpy(sc)})
    drafts = {}
    for dt in ("BF16", "F16", "F32"):
        drafts[dt] = run_plan(tmp_path, [OutputTensor("w", dt, (3, 130, 257),
                                                      fp8.dequant_recipe(vrefs["w"], vrefs["w_scale_inv"], dt))],
                              name=f"d{dt}")["w"]
    bf = drafts["BF16"]
    poked = bf.clone()
    poked[2, 129, 256] = (poked[2, 129, 256].float() * 1.01).to(torch.bfloat16)  # one element, last edge tile
    assert not torch.equal(poked, bf)
    lowbit = bf.clone()
    lowbit.view(torch.int16)[0, 0, 0] ^= 1  # one ulp
    drefs, _ = write_refs(
        tmp_path / "drafts.safetensors",
        {"bf": bf, "f16": drafts["F16"], "f32": drafts["F32"], "poked": poked, "lowbit": lowbit,
         "short": bf[:, :129]},
    )

    def same(k):
        return fp8.unchanged_after_dequant(drefs[k], vrefs["w"], vrefs["w_scale_inv"], (128, 128))

    assert same("bf") and same("f16") and same("f32")
    assert not same("poked") and not same("lowbit") and not same("short")
    # per-expert draft against one expert of the stacked verifier
    one, _ = write_refs(tmp_path / "one.safetensors", {"x": bf[1].clone()})
    sc1, _ = write_refs(tmp_path / "sc1.safetensors", {"s": torch.from_numpy(sc[1].copy())})
    assert fp8.unchanged_after_dequant(one["x"], fp8.TensorRows(vrefs["w"], expert=1), sc1["s"])
    assert not fp8.unchanged_after_dequant(one["x"], fp8.TensorRows(vrefs["w"], expert=0), sc1["s"])


# ---------------------------------------------------------------------------
# Config


def test_config_helpers():
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 128]}
    assert fp8.is_fp8_config({"quantization_config": qc})
    assert fp8.block_size({"quantization_config": qc}) == (64, 128)
    nested = ConfigView({"text_config": {"hidden_size": 8}, "quantization_config": qc})
    assert fp8.is_fp8_config(nested) and fp8.block_size(nested) == (64, 128)
    assert fp8.block_size({"quantization_config": {"quant_method": "fp8"}}) == (128, 128)
    assert fp8.block_size({}) == (128, 128) and not fp8.is_fp8_config({})
    assert not fp8.is_fp8_config({"quantization_config": {"quant_method": "compressed-tensors"}})
    for bad in (None, [128], [0, 128], [128.0, 128], "128"):
        with pytest.raises(InputError, match="fp8-block-size"):
            fp8.block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": bad}})


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 257)])
def test_power_of_two_scales_for_ue8m0(shape):
    """scale_fmt ue8m0: every scale is 2 ** ceil(log2(amax / 448)) (DeepSeek's rule), the codes are the
    values divided by it (exact: a power of two), and quantizing the dequantized values gives them back."""
    rng = np.random.default_rng(7)
    w = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.02)
    w[..., :128, :128] = 0.0
    q, s = fp8.quantize(w, pow2=True)
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()  # powers of two only
    plain_q, plain_s = fp8.quantize(w)
    expect = torch.exp2(torch.ceil(torch.log2(plain_s.double()))).float()  # plain_s = fl(amax / 448)
    assert torch.equal(s, expect)
    # values are a fixed point (bytes may not be: a block whose largest code rounded down to 224 comes back
    # with half the scale and doubled codes, the same values; stitch keeps unchanged FP8 bytes by value)
    d = fp8.dequantize(q, s)
    q2, s2 = fp8.quantize(d, pow2=True)
    assert torch.equal(fp8.dequantize(q2, s2), d)
    err = (fp8.dequantize(q, s) - w).abs().max()
    assert err <= w.abs().max() * 2.0**-3  # e4m3 keeps 3 mantissa bits; a larger scale costs at most one
    assert not torch.equal(s, plain_s)  # the option does something
