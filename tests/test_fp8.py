"""FP8 block dequantization (fp8_decode, numpy) and quantization (fp8, torch) against independent oracles,
through the interfaces the commands run: the block-format decode recipe (``Codec.decode``, model/quant's
``Codec.decode``) / ``encode_block.requantize`` recipes written by the writer, and the band kernels under them.

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

from ckpt_tools.arrays import as_bytes
from ckpt_tools.errors import InputError, PlanError
from ckpt_tools.io.config import ConfigView
from ckpt_tools.io.safetensors_io import LocalFile, read_header, refs_from_header
from ckpt_tools.model.quant import decode_fp8 as fp8_decode
from ckpt_tools.model.quant import encode_block as fp8
from ckpt_tools.model.quant.codec import checkpoint_codec
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.plan import CopyBytes, OutputTensor, Plan

from quant_helpers import dequant_array, dequant_stream, grid_shape, quantize

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
    gshape = grid_shape(shape, block)
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
# Dequantization: fp8_decode (numpy), the one dequantizer the commands run


def deq(q: torch.Tensor, s: torch.Tensor, block=(128, 128), out: str = "F32") -> torch.Tensor:
    """``fp8_decode.dequant_array`` on torch tensors (its values, as a torch tensor of ``out``)."""
    from ckpt_tools.dtypes import torch_dtype

    fmt = "F8_E4M3" if q.dtype == torch.float8_e4m3fn else "F8_E5M2"
    got = dequant_array(q.view(torch.uint8).numpy(), s.numpy(), block, fmt, out)
    return torch.from_numpy(got.copy()).view(torch_dtype(out))


@pytest.mark.parametrize("fmt,table", [("F8_E4M3", E4M3), ("F8_E5M2", E5M2)])
def test_every_byte_decodes_as_the_bit_layout_says(fmt, table):
    qb = np.arange(256, dtype=np.uint8).reshape(2, 128)
    for s in (1.0, 0.75, 2.0**-100, 2.0**120 * 1.5):  # the last overflows for the largest codes
        scale = np.full((1, 1), s, dtype=np.float32)
        got = dequant_array(qb, scale, (128, 128), fmt, "F32")
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
    got = dequant_array(qb, scale, block, "F8_E4M3", "F32")
    want = ref_dequant(qb, scale, block).astype(np.float32)  # one rounding of the exact product
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32 and got.shape == shape


def test_dequantize_to_other_dtypes_and_from_a_stream(monkeypatch):
    monkeypatch.setattr(fp8_decode, "BAND_ELEMS", 4000)
    rng = np.random.default_rng(12)
    qb, scale = random_fp8(rng, (3, 130, 257), (128, 128))
    exact32 = ref_dequant(qb, scale, (128, 128)).astype(np.float32)
    got = dequant_array(qb, scale, (128, 128), "F8_E4M3", "BF16")
    np.testing.assert_array_equal(got, f32_to_bf16_bits(exact32))
    np.testing.assert_array_equal(dequant_array(qb, scale, (128, 128), "F8_E4M3", "F16"),
                                  exact32.astype(np.float16))
    # a sequential reader (e.g. over another recipe's bytes), consumed in odd-sized pieces
    data = qb.tobytes()
    pos = 0

    def read(n):
        nonlocal pos
        pos += n
        piece = data[pos - n : pos]
        return bytearray(piece) if pos % 2 else piece  # writable (used in place) or read-only (copied)

    chunks = list(dequant_stream(read, qb.shape, "F8_E4M3", scale, "BF16"))
    assert len(chunks) > 3 and pos == len(data)
    streamed = np.concatenate([c.reshape(-1) for c in chunks])
    np.testing.assert_array_equal(streamed, f32_to_bf16_bits(exact32).reshape(-1))
    with pytest.raises(InputError, match="fp8-stream"):
        list(dequant_stream(lambda n: b"\0" * (n - 1), qb.shape, "F8_E4M3", scale))


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("out", ["BF16", "F16", "F32"])
def test_dequantizer_matches_the_exact_product_cast_by_torch(fmt, out, monkeypatch):
    """Every code, scales from subnormal products to overflow, NaN and Inf scales, edge tiles, stacked
    experts: the float64 product rounded once to float32, then torch's cast to the output dtype."""
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
    with np.errstate(over="ignore", invalid="ignore"):
        exact32 = ref_dequant(codes, scale, block, E4M3 if fmt == "F8_E4M3" else E5M2).astype(np.float32)
    want = torch.from_numpy(exact32).to(tdt)
    got = dequant_array(codes, scale, block, fmt, out)
    assert got.shape == shape
    want_bits = want.view(torch.int16 if out != "F32" else torch.int32).numpy()
    got_bits = got.view(want_bits.dtype)
    nan = np.isnan(exact32)
    got_values = torch.from_numpy(got_bits.copy()).view(tdt).float().numpy()
    assert nan.any()
    # NaN signs and payloads follow no standard (torch differs between its own paths): NaN where
    # the product is NaN, every other value byte for byte
    np.testing.assert_array_equal(np.isnan(got_values), nan)
    np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])


def test_dequantize_survives_flush_denormal_mode():
    qb = np.arange(0, 128, dtype=np.uint8).reshape(1, 128)  # includes e4m3 subnormals 0x01..0x07
    want = ref_dequant(qb, np.ones((1, 1), np.float32), (128, 128)).astype(np.float32)
    assert torch.set_flush_denormal(True)
    try:
        got = dequant_array(qb, np.ones((1, 1), np.float32), (128, 128), "F8_E4M3", "F32")
    finally:
        torch.set_flush_denormal(False)
    np.testing.assert_array_equal(got, want)


def test_dequantize_rejects_a_wrong_scale_grid_or_format():
    q = np.zeros((300, 200), dtype=np.uint8)
    with pytest.raises(PlanError, match="fp8-scale-shape"):
        dequant_array(q, np.ones((2, 2), np.float32), (128, 128), "F8_E4M3", "BF16")
    with pytest.raises(PlanError, match="fp8-dtype"):
        dequant_array(q, np.ones((3, 2), np.float32), (128, 128), "BF16", "BF16")
    with pytest.raises(PlanError, match="fp8-scale-dtype"):
        dequant_array(q, np.ones((3, 2), np.int32), (128, 128), "F8_E4M3", "BF16", "I32")


def test_dequantize_agrees_with_transformers_fp8_dequantize():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rng = np.random.default_rng(7)
    qb, scale = random_fp8(rng, (2, 256, 384), (128, 128))
    q, s = as_fp8(qb), torch.from_numpy(scale)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)
    assert torch.equal(deq(q, s, out="BF16").view(torch.int16), theirs.view(torch.int16))


def tensor_of(ref) -> OutputTensor:
    return OutputTensor(ref.key, ref.dtype, tuple(ref.shape), CopyBytes([ref.segment()]))


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
def test_dequantize_recipe_through_writer(tmp_path, monkeypatch, out_dtype, band):
    """The block-FP8 decode recipe the verbs plan (``Codec.decode``: dequant, extract --dequant, stitch's
    comparisons) written by the writer."""
    monkeypatch.setattr(fp8_decode, "BAND_ELEMS", band)
    rng = np.random.default_rng(3)
    qa, sa = random_fp8(rng, (300, 200), (128, 128), scale_exp=(-12, 0))
    qe, se = random_fp8(rng, (3, 130, 257), (128, 128), scale_exp=(-12, 0))
    e8 = rng.integers(100, 130, (3, 2, 3)).astype(np.uint8)  # UE8M0 scales: 2**(b - 127)
    refs, src = write_refs(
        tmp_path / "in.safetensors",
        {
            "a.weight": as_fp8(qa),
            "a.weight_scale_inv": torch.from_numpy(sa),
            "pad": torch.ones(7, dtype=torch.bfloat16),  # neighbours that must not be read
            "e.weight": as_fp8(qe),
            "e.weight_scale_inv": torch.from_numpy(se),
            "e8.weight_scale_inv": torch.from_numpy(e8).view(torch.float8_e8m0fnu),
        },
    )
    src.ranges.clear()  # header reads are done; from here on only the recipes read
    fmt = checkpoint_codec(hint="fp8-block")
    outs = [fmt.decode(tensor_of(refs[w]), tensor_of(refs[s]), out_dtype)
            for w, s in (("a.weight", "a.weight_scale_inv"), ("e.weight", "e.weight_scale_inv"))]
    e8_out = fmt.decode(tensor_of(refs["e.weight"]), tensor_of(refs["e8.weight_scale_inv"]), "F32")
    assert [o.meta["dequantized_from"] for o in (*outs, e8_out)] == [
        {"dtype": "F8_E4M3", "scale": s, "block": [128, 128]}
        for s in ("a.weight_scale_inv", "e.weight_scale_inv", "e8.weight_scale_inv")]
    outs.append(OutputTensor("e8.weight", "F32", e8_out.shape, e8_out.recipe))
    got = run_plan(tmp_path, outs)
    for k, qb, sc in (("a.weight", qa, sa), ("e.weight", qe, se)):
        exact32 = ref_dequant(qb, sc, (128, 128)).astype(np.float32)
        if out_dtype == "BF16":
            np.testing.assert_array_equal(got[k].view(torch.int16).numpy().view(np.uint16), f32_to_bf16_bits(exact32))
        elif out_dtype == "F16":
            np.testing.assert_array_equal(got[k].numpy(), exact32.astype(np.float16))
        else:
            np.testing.assert_array_equal(got[k].numpy(), exact32)
    want8 = ref_dequant(qe, (2.0 ** (e8.astype(np.float64) - 127)).astype(np.float32), (128, 128))
    np.testing.assert_array_equal(got["e8.weight"].numpy(), want8.astype(np.float32))
    # every read stays inside the weights and scales it was given, each read once per recipe
    allowed = [(refs[k].offset, refs[k].offset + refs[k].nbytes) for k in refs if k != "pad"]
    data_reads = [(o, n) for o, n in src.ranges if n]
    for o, n in data_reads:
        assert any(a <= o and o + n <= b for a, b in allowed), (o, n)
    assert sum(n for o, n in data_reads) == sum(b - a for a, b in allowed) + refs["e.weight"].nbytes


def test_dequantize_recipe_checks_at_plan_time(tmp_path):
    refs, _ = write_refs(
        tmp_path / "x.safetensors",
        {
            "w": torch.zeros(300, 200, dtype=torch.float8_e4m3fn),
            "s_bad": torch.ones(2, 2),
            "s": torch.ones(3, 2),
            "s_int": torch.ones(3, 2, dtype=torch.int32),
            "b": torch.zeros(300, 200, dtype=torch.bfloat16),
        },
    )
    w, s = tensor_of(refs["w"]), tensor_of(refs["s"])
    fmt = checkpoint_codec(hint="fp8-block")
    with pytest.raises(PlanError, match="fp8-scale") as e:
        fmt.decode(w, tensor_of(refs["s_bad"]), "BF16")
    assert "s_bad" in str(e.value)
    with pytest.raises(PlanError, match="dequant"):
        fmt.decode(tensor_of(refs["b"]), s, "BF16")
    with pytest.raises(PlanError, match="dequant-dtype"):
        fmt.decode(w, s, "F8_E4M3")
    with pytest.raises(PlanError, match="fp8-scale-dtype"):
        fmt.decode(w, tensor_of(refs["s_int"]), "BF16")


def test_stream_worker_stops_when_the_consumer_does():
    rng = np.random.default_rng(8)
    qb, sc = random_fp8(rng, (4, 128, 300), (128, 128))
    data = memoryview(qb.tobytes())
    pos = 0

    def read(n):
        nonlocal pos
        pos += n
        return data[pos - n : pos]

    workers_before = threading.active_count()
    gen = dequant_stream(read, qb.shape, "F8_E4M3", sc, "BF16")
    first = next(gen)
    assert first.dtype == np.uint16
    gen.close()  # the writer stops early (an error elsewhere): the worker must end
    assert threading.active_count() == workers_before
    pos = 0
    chunks = list(dequant_stream(read, qb.shape, "F8_E4M3", sc, "BF16"))
    assert sum(c.size for c in chunks) == qb.size
    assert not any(np.shares_memory(c, chunks[0]) for c in chunks[1:])  # fresh arrays: consumers may keep them


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
    q, s = quantize(torch.from_numpy(w), block)
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
    q, s = quantize(torch.tensor([[448.0, *ties]]))
    assert s.item() == 1.0
    assert E4M3[q_bytes(q)[0, 1:]].tolist() == want
    assert np.array_equal(q_bytes(q)[0], ref_e4m3_rne(np.array([448.0, *ties])))


def test_quantize_saturates_at_448():
    # a block whose amax maps to exactly 448: q is 0x7e and the scale is exact
    w = torch.tensor([[448.0, -448.0, 1.0, 0.0]])
    q, s = quantize(w)
    assert s.item() == 1.0 and q_bytes(q).tolist() == [[0x7E, 0xFE, 0x38, 0x00]]
    # values beyond 448 clamp (torch's cast alone differs between versions and devices)
    y = torch.tensor([448.0, 449.0, 463.9, 464.0, 470.0, 1e6, -1e30])
    assert q_bytes(fp8._to_e4m3(y)).tolist() == [0x7E] * 6 + [0xFE]
    # amaxes for which fl(amax / fl(amax / 448)) > 448 still give 0x7e
    x = (torch.rand(4096, dtype=torch.float64) * 1000 + 1).to(torch.float32)
    over = x / (x / 448.0) > 448.0
    assert over.any()
    for amax in x[over][:16]:
        q, s = quantize(torch.tensor([[amax.item(), -amax.item() / 3]]))
        assert q_bytes(q)[0, 0] == 0x7E and s.item() == np.float32(amax.item()) / np.float32(448)


def test_quantize_refuses_nan_and_inf():
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.zeros(256, 256)
        w[200, 3] = bad
        with pytest.raises(InputError, match="fp8-nonfinite") as e:
            quantize(w)
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
    q, s = quantize(torch.from_numpy(w), (br, bc))
    want_q, want_s = ref_quantize(w, (br, bc))
    assert np.array_equal(q_bytes(q), want_q) and np.array_equal(s.numpy(), want_s)
    d = deq(q, s, (br, bc))
    np.testing.assert_array_equal(d.numpy(), ref_dequant(want_q, want_s, (br, bc)).astype(np.float32))
    q2, s2 = quantize(d, (br, bc))
    assert np.array_equal(q_bytes(q2), want_q) and torch.equal(s2, s)


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 257), (256, 384)])
def test_quantize_dequantize_is_a_fixed_point(shape):
    rng = np.random.default_rng(len(shape))
    w = rng.standard_normal(shape).astype(np.float32) * 2.0 ** rng.integers(-30, 10)
    w.reshape(-1)[:254] = E4M3[FINITE_BYTES]  # every finite code appears
    w[..., :128, :128] = 0.0  # a zero block
    q, s = quantize(torch.from_numpy(w))
    q2, s2 = quantize(deq(q, s))
    assert np.array_equal(q_bytes(q2), q_bytes(q)) and torch.equal(s2.view(torch.int32), s.view(torch.int32))
    # tiny blocks (floored scale, some rounding to all-zero codes) too
    q, s = quantize(torch.from_numpy(w * np.float32(1e-36)))
    assert (s >= 2.0**-126).all() and (s == 2.0**-126).any()
    q2, s2 = quantize(deq(q, s))
    assert np.array_equal(q_bytes(q2), q_bytes(q)) and torch.equal(s2, s)


# ---------------------------------------------------------------------------
# Banded re-quantization: encode_block.requantize (stitch and graft)


def requantized(ref, block=(128, 128), pow2=False):
    return fp8.requantize(tensor_of(ref), block, ref.key + "_scale_inv", pow2=pow2)


def test_requantize_recipes_match_quantize(tmp_path):
    rng = np.random.default_rng(2)
    a = torch.from_numpy(rng.standard_normal((300, 200)).astype(np.float32) * 0.02).to(torch.bfloat16)
    e = torch.from_numpy(rng.standard_normal((3, 260, 257)).astype(np.float32) * 0.02)
    refs, src = write_refs(tmp_path / "d.safetensors", {"a": a, "e": e})
    outs = [*requantized(refs["a"]), *requantized(refs["e"]), *requantized(refs["e"], pow2=True)]
    outs[-2:] = [OutputTensor("p" + t.key, t.dtype, t.shape, t.recipe) for t in outs[-2:]]
    assert outs[0].dtype == "F8_E4M3" and outs[1].dtype == "F32" and outs[3].shape == (3, 3, 3)
    got = run_plan(tmp_path, outs)
    for key, values, pow2 in (("a", a, False), ("e", e, False), ("pe", e, True)):
        q, s = quantize(values, pow2=pow2)
        assert got[key].dtype == torch.float8_e4m3fn
        assert np.array_equal(q_bytes(got[key]), q_bytes(q))
        assert torch.equal(got[f"{key}_scale_inv"], s)


@pytest.mark.parametrize("first", ["scale", "weight"])
def test_requantize_computes_each_scale_grid_once(tmp_path, monkeypatch, first):
    """The weight and scale recipes of one tensor share its grid, whichever runs first (the writer runs
    F32 scales first): one amax per block row, one division; run again, the same bytes."""
    rng = np.random.default_rng(6)
    e = torch.from_numpy(rng.standard_normal((2, 300, 200)).astype(np.float32))
    refs, _ = write_refs(tmp_path / "d.safetensors", {"e": e})
    q, want_s = quantize(e)
    calls = {"scales": 0, "codes": 0}
    for name, count in (("block_scales", "scales"), ("quantize_with", "codes")):
        real = getattr(fp8, name)
        monkeypatch.setattr(fp8, name, lambda *a, real=real, count=count, **k: (
            calls.__setitem__(count, calls[count] + 1), real(*a, **k))[1])
    w, s = requantized(refs["e"])

    def run(t):
        return b"".join(bytes(as_bytes(c)) for c in t.recipe.produce())

    order = (s, w) if first == "scale" else (w, s)
    got = {t.key: run(t) for t in order}
    block_rows = 2 * 3
    assert calls == {"scales": block_rows, "codes": block_rows}
    assert got[w.key] == bytes(as_bytes(q)) and got[s.key] == bytes(as_bytes(want_s))
    assert run(w) == got[w.key] and run(s) == got[s.key]  # a second run (the grid was dropped) is the same


def test_requantize_refuses_nonfinite_when_producing(tmp_path):
    w = torch.zeros(130, 10)
    w[129, 9] = float("nan")
    refs, _ = write_refs(tmp_path / "n.safetensors", {"w": w, "i": torch.zeros(4, 4, dtype=torch.int32)})
    weight, scale = requantized(refs["w"])
    for t in (scale, weight):
        with pytest.raises(InputError, match="fp8-nonfinite") as e:
            list(t.recipe.produce())
        assert "w (rows 128..130)" in str(e.value) and "block [0, 0]" in str(e.value)
    with pytest.raises(PlanError, match="fp8-dtype"):
        requantized(refs["i"])


# ---------------------------------------------------------------------------
# Config


def test_weight_block_size_is_read_once_by_the_scheme_table():
    """``weight_block_size`` and ``scale_fmt`` are the block table's declared parameters (model/quant/detect, the
    one reader): a list is the tile, absent is 128x128, an explicit null one per-tensor scale (transformers'
    FineGrainedFP8: a scalar weight_scale_inv) - for the audit, the storage check and the encoder alike."""
    from types import SimpleNamespace

    from ckpt_tools.model.quant.block_audit import declared_block
    from ckpt_tools.model.quant.codec import checkpoint_codec, config_params
    from ckpt_tools.model.quant.tables import get_scheme

    fmt = checkpoint_codec(hint="fp8-block")
    table = get_scheme("fp8-block")

    def ckpt(qc):
        return SimpleNamespace(config=ConfigView({"text_config": {"hidden_size": 8}, "quantization_config": qc}),
                               local_dir=None, root="x")

    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 128]}
    assert declared_block(ckpt(qc), fmt) == ((64, 128), True, None)
    assert config_params(table, ckpt(qc))["scale_fmt"] is None
    assert config_params(table, ckpt({**qc, "scale_fmt": "UE8M0"}))["scale_fmt"] == "UE8M0"
    assert declared_block(ckpt({"quant_method": "fp8"}), fmt) == ((128, 128), True, None)
    assert declared_block(ckpt({**qc, "weight_block_size": None}), fmt) == (None, True, None)
    assert declared_block(ckpt({"quant_method": "compressed-tensors"}), fmt) == ((128, 128), False, None)
    for bad in ([128], [0, 128], [128.0, 128], "128", [True, 128]):  # no tile: the format's for the grid check,
        assert declared_block(ckpt({**qc, "weight_block_size": bad}), fmt) == ((128, 128), True, bad)  # refused


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 257)])
def test_power_of_two_scales_for_ue8m0(shape):
    """scale_fmt ue8m0: every scale is 2 ** ceil(log2(amax / 448)) (DeepSeek's rule), the codes are the
    values divided by it (exact: a power of two), and quantizing the dequantized values gives them back."""
    rng = np.random.default_rng(7)
    w = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.02)
    w[..., :128, :128] = 0.0
    q, s = quantize(w, pow2=True)
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()  # powers of two only
    plain_q, plain_s = quantize(w)
    expect = torch.exp2(torch.ceil(torch.log2(plain_s.double()))).float()  # plain_s = fl(amax / 448)
    assert torch.equal(s, expect)
    # values are a fixed point (bytes may not be: a block whose largest code rounded down to 224 comes back
    # with half the scale and doubled codes, the same values; stitch keeps unchanged FP8 bytes by value)
    d = deq(q, s)
    q2, s2 = quantize(d, pow2=True)
    assert torch.equal(deq(q2, s2), d)
    err = (deq(q, s) - w).abs().max()
    assert err <= w.abs().max() * 2.0**-3  # e4m3 keeps 3 mantissa bits; a larger scale costs at most one
    assert not torch.equal(s, plain_s)  # the option does something
