"""Decoders against the reference implementations, bit for bit.

compressed-tensors schemes: our streamed decode equals the library's own decompression (its
compressors' ``decompress``) in BF16 byte for byte; FP4 codes, MX scales and int packing are
checked against the library's own unpack functions over every byte value. ModelOpt NVFP4
against ModelOpt's formula (NVFP4QTensor.dequantize, codes unpacked by the library), DeepSeek-V4
FP4 experts against an independent float64 reference of the format.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpt_tools.arrays import as_bytes
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.quant import detect_scheme, module_storage
from ckpt_tools.model.quant.decode import code_table, scale_values, zero_point_values
from ckpt_tools.model.quant.dequant import dequant_module, dequant_parts
from ckpt_tools.model.quant.storage import Storage

pytest.importorskip("compressed_tensors")
from quant_helpers import ct, scheme_for, write_quantized  # noqa: E402

IGNORE = ["lm_head", "re:.*mlp\\.gate$"]
TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def materialize(t) -> torch.Tensor:
    data = bytearray(b"".join(bytes(as_bytes(c)) for c in t.recipe.produce()))
    return torch.frombuffer(data, dtype=TORCH[t.dtype]).reshape(t.shape) if data else torch.empty(t.shape)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    same = a.shape == b.shape and a.dtype == b.dtype
    return same and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def test_fp4_codes_equal_the_librarys_unpacking_for_every_byte():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    theirs = unpack_fp4_from_uint8(every, 16, 32, dtype=torch.float32)
    ours = torch.from_numpy(code_table("e2m1")).reshape(16, 32)
    assert bits_equal(ours, theirs)  # -0.0 included


def test_mx_scales_equal_the_librarys_for_every_exponent():
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale

    every = np.arange(256, dtype=np.uint8)
    theirs = decompress_mx_scale(torch.from_numpy(every)).float()
    ours = torch.from_numpy(scale_values(every, "U8", "e8m0", "inf"))
    assert bits_equal(ours, theirs)  # 2**-127 .. 2**127 and 255 -> inf, as the library reads them
    e8m0 = scale_values(every, "F8_E8M0")
    assert np.isnan(e8m0[255]) and np.array_equal(e8m0[:255], ours.numpy()[:255])


@pytest.mark.parametrize("bits", [4, 8])
def test_int_packing_equals_the_librarys_unpack(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    for rows, cols in [(17, 64), (9, 40), (23, 33)]:  # >= 9 rows: the library cannot unpack one-word zero points
        q = torch.randint(lo, hi, (rows, cols), generator=g, dtype=torch.int8)
        packed = pack_to_int32(q, bits)
        table = code_table("int", bits, 1 << (bits - 1))
        ours = table[packed.numpy().view(np.uint8)].reshape(rows, -1)[:, :cols]
        assert np.array_equal(ours, unpack_from_int32(packed, bits, torch.Size((rows, cols))).float().numpy())
        zp = torch.randint(lo, hi, (rows, 3), generator=g, dtype=torch.int8)
        zpacked = pack_to_int32(zp, bits, packed_dim=0)
        got = zero_point_values(zpacked.numpy(), "I32", bits, 1 << (bits - 1), "rows", rows)
        assert np.array_equal(got, unpack_from_int32(zpacked, bits, torch.Size((rows, 3)), packed_dim=0).float())


CASES = [
    ("NVFP4", {}), ("NVFP4A16", {}), ("MXFP4", {}), ("FP8_DYNAMIC", {}), ("FP8", {}),
    ("FP8_BLOCK", {"block_structure": [32, 48]}), ("W4A16", {"group_size": 16}), ("W4A16_ASYM", {"group_size": 32}),
    ("W8A16", {"group_size": 32}), ("W8A8", {}), ("W4A16", {"strategy": "channel", "group_size": None}),
    ("W8A8", {"symmetric": False}),  # I8 zero points, required (and applied) under symmetric: false
]


@pytest.fixture(scope="module")
def ct_checkpoint(make_fixture, tmp_path_factory):
    src = make_fixture("deepseek_v3")
    made = {}

    def build(preset, weights):
        key = (preset, repr(sorted(weights.items())))
        if key not in made:
            sch = scheme_for(preset, weights or None)
            made[key] = (write_quantized(src, tmp_path_factory.mktemp(preset.lower()), sch, list(IGNORE)), sch)
        return made[key]

    return build


@pytest.mark.parametrize(("preset", "weights"), CASES, ids=[f"{p}{'-' + str(w) if w else ''}" for p, w in CASES])
def test_compressed_tensors_modules_decode_to_the_librarys_decompression(ct_checkpoint, preset, weights):
    from safetensors.torch import load_file

    lib = ct()
    path, sch = ct_checkpoint(preset, weights)
    ck = Checkpoint.open(path)
    qs = detect_scheme(ck)
    state = load_file(path / "model.safetensors")
    comp = lib["BaseCompressor"].get_value_from_registry(sch.format)
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")})
    assert len(modules) > 20
    for m in modules:
        st = module_storage(ck, qs, m)
        assert st.quantized and st.complete, st
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == m}
        theirs = comp.decompress(local, sch)["weight"]
        ours = materialize(dequant_module(ck, st, f"{m}.weight", "BF16"))
        assert bits_equal(ours, theirs.to(torch.bfloat16)), (m, preset)
    # float32: the exact product (the library's own float32 arithmetic where its scale is float32)
    m = modules[0]
    st = module_storage(ck, qs, m)
    f32 = materialize(dequant_module(ck, st, f"{m}.weight", "F32"))
    assert bits_equal(f32.to(torch.bfloat16), materialize(dequant_module(ck, st, f"{m}.weight", "BF16")))


def _random_nvfp4(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)  # every code, -0 included
    scale = (torch.rand((rows, cols // 16), generator=g) * 400 + 2**-6).to(torch.float8_e4m3fn)
    return packed, scale


def test_nvfp4_every_code_and_ragged_scales_equal_the_library():
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    packed, scale = _random_nvfp4(48, 96, 1)
    gs = torch.tensor([1234.567], dtype=torch.float32)
    sch = scheme_for("NVFP4")
    theirs = NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale,
                                               "weight_global_scale": gs}, sch)["weight"]
    ours = _decode_parts("ct-nvfp4", "nvfp4", {"weight_packed": packed, "weight_scale": scale,
                                               "weight_global_scale": gs}, (48, 96), {"group_size": 16})
    assert bits_equal(ours, theirs)


def test_modelopt_nvfp4_equals_modelopts_formula():
    """NVFP4QTensor.dequantize: codes (unpacked by compressed-tensors) * fl32(weight_scale * weight_scale_2)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed, scale = _random_nvfp4(32, 64, 2)
    ws2 = torch.tensor(0.000123, dtype=torch.float32)
    codes = unpack_fp4_from_uint8(packed, 32, 64, dtype=torch.float32)
    per_block = scale.to(torch.float32) * ws2
    want = (codes.view(32, 4, 16) * per_block.unsqueeze(-1)).view(32, 64)
    parts = {"weight": packed, "weight_scale": scale, "weight_scale_2": ws2}
    for out in ("BF16", "F32"):
        ours = _decode_parts("modelopt-nvfp4", "nvfp4", parts, (32, 64), {"group_size": 16}, out)
        assert bits_equal(ours, want.to(TORCH[out]))


def test_deepseek_v4_fp4_experts_equal_a_float64_reference():
    g = torch.Generator().manual_seed(3)
    rows, cols = 24, 96
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8)
    exps = torch.randint(100, 140, (rows, cols // 32), generator=g, dtype=torch.uint8)
    scale = exps.view(torch.float8_e8m0fnu)
    # the format, independently: byte b holds codes b & 15 then b >> 4; e2m1 = (-1)^s * 2^(e-1) * (1 + m/2)
    # (e > 0) or m/2 (e == 0); a scale byte e is 2^(e - 127)
    u = packed.view(torch.uint8).numpy().astype(np.int64)
    codes = np.stack([u & 15, u >> 4], axis=-1).reshape(rows, cols)
    sign = np.where(codes & 8, -1.0, 1.0)
    e, m = (codes >> 1) & 3, codes & 1
    mag = np.where(e == 0, m * 0.5, 2.0 ** (e - 1.0) * (1 + m / 2.0))
    ref = sign * mag * np.repeat(2.0 ** (exps.numpy().astype(np.float64) - 127), 32, axis=1)
    ref_t = torch.from_numpy(ref)
    parts = {"weight": packed, "scale": scale}
    for out in ("BF16", "F32"):
        ours = _decode_parts("deepseek-v4", "fp4-experts", parts, (rows, cols), {"block": [128, 128]}, out)
        assert bits_equal(ours, ref_t.to(TORCH[out]))


def test_block_fp8_with_ue8m0_scales_equals_the_fp8_module():
    from quant_helpers import fp8_dequant, quantize

    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 300, generator=g, dtype=torch.float32)
    q, _ = quantize(w, (128, 128))
    scale = torch.randint(110, 135, (2, 3), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    want = fp8_dequant(q, scale, (128, 128), dtype=torch.bfloat16)
    ours = _decode_parts("fp8-block", "fp8-block", {"weight": q, "weight_scale_inv": scale}, (200, 300),
                         {"block": [128, 128]})
    assert bits_equal(ours, want)


def _decode_parts(scheme: str, fmt: str, tensors: dict, shape, params, out="BF16") -> torch.Tensor:
    from ckpt_tools.dtypes import from_torch
    from ckpt_tools.stream.plan import Compute, OutputTensor

    parts = {}
    for suffix, t in tensors.items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        parts[suffix] = OutputTensor(f"m.{suffix}", from_torch(t.dtype), tuple(t.shape),
                                     Compute(lambda data=data: iter([data]), "const"))
    st = Storage("m", "quantized", parts[next(iter(tensors))].dtype, scheme, fmt, fmt,
                 {s: f"m.{s}" for s in tensors}, shape=tuple(shape), params=params)
    return materialize(dequant_parts("m.weight", parts, st, out))


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "modelopt-nvfp4"])
@pytest.mark.parametrize("tile", [(1, 16), (3, 16)])
@pytest.mark.parametrize("gscale", [1234.567, 1e-30, 1e30, 0.0, None])
def test_nvfp4_pair_tables_equal_the_band_arithmetic(scheme, tile, gscale):
    """The pair-table decoder (one lookup per byte in finished outputs per scale byte) writes the bits of the
    band arithmetic (lookup, product, cast) for every scale byte and code, Inf / NaN / subnormal products
    included, in every output dtype; scales that are not all e4m3 values take the band arithmetic."""
    from ckpt_tools.arrays import numpy_storage_dtype
    from ckpt_tools.model.quant import decode
    from ckpt_tools.model.quant.decode_fp8 import TABLES
    from ckpt_tools.model.quant.tables import get_scheme

    spec = next(f for f in get_scheme(scheme).storage if f.name == "nvfp4").decoder
    rows, cols = 700, 512  # above PAIR_TABLE_MIN elements; ragged last tile row for (3, 16)
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    grid = (-(-rows // tile[0]), cols // tile[1])
    sbytes = rng.integers(0, 256, grid, dtype=np.uint8)
    sbytes[(sbytes & 0x7F) == 0x7F] = 0x7E
    sbytes.flat[:254] = [b for b in range(256) if b & 0x7F != 0x7F]  # every non-NaN scale byte
    scale = TABLES["F8_E4M3"][sbytes]
    g = None if gscale is None else np.array([gscale], dtype=np.float32)

    def run(dec):
        out = np.empty((rows, cols), dtype=numpy_storage_dtype(dec.d.out_dtype))
        for li, r0, r1 in dec.bands():
            dec.decode(packed[r0:r1], li, r0, out[r0:r1])
        return out

    for out_dtype in ("BF16", "F16", "F32"):
        d = decode.Decoding(spec, "U8", (rows, cols), cols // 2, cols // 2, tile, out_dtype)
        fast, slow = decode.BandDecoder(d, scale, g), decode.BandDecoder(d, scale, g)
        assert fast._keys is not None
        slow._keys = None
        with np.errstate(all="ignore"):
            assert run(fast).tobytes() == run(slow).tobytes()
    odd = scale.copy()
    odd.flat[5] = np.nan  # not an e4m3 byte's value: the band arithmetic
    assert decode.BandDecoder(d, odd, g)._keys is None
    odd.flat[5] = 0.3
    assert decode.BandDecoder(d, odd, g)._keys is None


def test_nvfp4_pair_tables_vouch_for_finite_bands_and_still_refuse_overflow(monkeypatch):
    """Bands decoded from pair tables without a NaN / Inf entry are not scanned again (the tables vouch for
    them); a global scale whose products overflow still refuses the weight, naming the first index."""
    from ckpt_tools.errors import InputError
    from ckpt_tools.model.quant import finite

    scanned = []
    real = finite.first_nonfinite
    monkeypatch.setattr(finite, "first_nonfinite", lambda v, d: scanned.append(v.size) or real(v, d))
    rows, cols = 700, 512  # above PAIR_TABLE_MIN: the pair tables
    packed, scale = _random_nvfp4(rows, cols, 5)

    def parts(gscale):
        return {"weight_packed": packed, "weight_scale": scale,
                "weight_global_scale": torch.tensor([gscale], dtype=torch.float32)}

    got = _decode_parts("ct-nvfp4", "nvfp4", parts(1234.567), (rows, cols), {"group_size": 16})
    assert got.shape == (rows, cols) and not scanned
    packed[0, :8] = 0
    packed[0, 3] = 0x70  # codes 0 and 6 (e2m1's largest) at [0, 6] and [0, 7]
    scale[0, 0] = 448.0  # 448 / 4.48e-36 = 1e38 is a float32; 6e38 is past bfloat16's range
    with pytest.raises(InputError, match="nonfinite") as e:
        _decode_parts("ct-nvfp4", "nvfp4", parts(4.48e-36), (rows, cols), {"group_size": 16})
    assert "index [0, 7]" in str(e.value) and "inf" in str(e.value) and scanned


def test_fp8_bf16_bands_are_judged_by_their_maximum_and_a_nan_or_overflow_still_refused(monkeypatch):
    """Block-FP8 tables whose one non-finite output is bf16 0xFFFF (a NaN code) let a band's maximum judge it: no
    masked scan of a finite band; a NaN code, and a scale whose products pass bfloat16's range (Inf entries: the
    maximum cannot show +Inf), are still refused, naming the index."""
    from ckpt_tools.errors import InputError
    from ckpt_tools.model.quant import finite

    from quant_helpers import quantize

    scanned = []
    real = finite.first_nonfinite
    monkeypatch.setattr(finite, "first_nonfinite", lambda v, d: scanned.append(v.size) or real(v, d))
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(9), dtype=torch.float32)
    q, scale = quantize(w, (128, 128))

    def run(q, scale):
        return _decode_parts("fp8-block", "fp8-block", {"weight": q, "weight_scale_inv": scale}, (200, 300),
                             {"block": [128, 128]})

    assert run(q, scale).shape == (200, 300) and not scanned
    nan = q.clone()
    nan.view(torch.uint8)[150, 7] = 0x7F  # an e4m3 NaN code
    with pytest.raises(InputError, match="nonfinite") as e:
        run(nan, scale)
    assert "index [150, 7]" in str(e.value) and "NaN" in str(e.value) and scanned
    scanned.clear()
    big = scale.clone()
    big[1, 2] = 1e36  # 448 * 1e36 is a float32 past bfloat16's largest: Inf entries in that block's table
    q2 = q.clone()
    q2.view(torch.uint8)[128:, 256:] = 0x7E  # 448 in every element of that block
    with pytest.raises(InputError, match="nonfinite") as e:
        run(q2, big)
    assert "index [128, 256]" in str(e.value) and "inf" in str(e.value) and scanned


def test_bf16_rounding_in_uint32_equals_the_wide_formula_on_edge_patterns():
    """arrays.encode_floats rounds float32 to bfloat16 in uint32 (the sum wraps only for NaN payloads, rewritten
    as 0xFFFF): equal to the overflow-free uint64 formula and to torch's cast on every sign, exponent and the
    mantissa patterns around each rounding boundary, into a given output through a scratch buffer too."""
    from ckpt_tools.arrays import Scratch, encode_floats

    mant = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x10000, 0x17FFF, 0x18000, 0x18001, 0x7F7FFF, 0x7F8000,
                     0x7FFFFF], dtype=np.uint32)
    bits = ((np.arange(512, dtype=np.uint32)[:, None] << 23) | mant[None, :]).reshape(-1)  # sign and exponent
    values = bits.view(np.float32)
    u = bits.astype(np.uint64)
    wide = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    wide[np.isnan(values)] = 0xFFFF
    out = np.empty(values.shape, np.uint16)
    assert np.array_equal(encode_floats(values, "BF16"), wide)
    assert encode_floats(values.reshape(-1, 13), "BF16", out.reshape(-1, 13), Scratch()) is not None
    assert np.array_equal(out, wide)
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(wide, theirs)
