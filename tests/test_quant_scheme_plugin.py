"""A new quantization scheme is one table plus one decoder and one encoder, added from outside the package.

The toy scheme here - 8-bit sign-magnitude codes (bit 7 the sign, bits 0-6 the magnitude: no built-in code
kind reads them) times a per-row absmax F32 scale ``weight_scale_row`` [rows, 1], declared in config.json as
``quantization_config: {quant_method: toy-int8, ignore: [...]}`` - is known to this test alone: its table is
written into a temporary directory (``register_scheme_dir``), its decoder is its code values
(``register_codes``: the rest of decoding - scale tiles, one float32 product, one rounding - is the table's
``decoder:`` data) and its encoder is registered (``register_codec``). A deepseek_v3 fixture (trunk and
MTP) quantized that way then works in every verb with no other change to the tool: ``inspect`` names the
scheme, ``validate`` accepts it and refuses a missing companion, ``dequant`` writes exactly the decoded
floats, ``stitch`` writes a changed MTP in the toy storage (the encoder's bytes) and keeps an unchanged one
byte for byte, ``graft --mtp-quant toy-int8`` writes the release's MTP in it. Unregistered, the scheme is
unknown (rule ``quant-unknown``). A block scheme (FP8 codes, one scale per tile) needs the table alone: the shipped
block encoder and the e4m3 decoder write and read it under the scale name and tile its table gives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import TableError
from ckpt_tools.model.quant import (
    EncodeArgs,
    all_schemes,
    get_scheme,
    register_codec,
    register_codes,
    register_scheme_dir,
    unregister_codec,
    unregister_codes,
    unregister_scheme_dir,
)
from ckpt_tools.model.quant.codec import CODECS

from conftest import run_ckpt
from quant_helpers import same_bits, tensors_of

NAME = "toy-int8"
CODES = "toy-sm8"  # the scheme's code kind
MTP = "model.layers.3."  # deepseek_v3 fixture: three trunk layers, one MTP layer
SCALE = "weight_scale_row"

TABLE = f"""\
scheme: {NAME}
title: toy int8 per-row absmax
declared_in:
  - file: config.json
    section: quantization_config
    match: {{quant_method: [{NAME}]}}
    exclude:
      - {{field: ignore, matcher: exact, create: true}}
storage:
  - name: int8-row
    label: "INT8 per row"
    weight: {{suffix: weight, dtypes: [U8]}}
    tensors:
      - {{suffix: {SCALE}, role: scale, dtypes: [F32]}}
    encoder: {NAME}
    decoder:
      codes: {CODES}
      scale: {{tensor: {SCALE}, granularity: "[1, cols]"}}
"""


# -- the toy scheme: everything a new scheme needs besides its table ----------------------------------------


def toy_code_values() -> list[float]:
    """The decoder: the value of each stored byte (sign-magnitude; 0x80 is -0)."""
    return [(-1.0 if b & 0x80 else 1.0) * (b & 0x7F) for b in range(256)]


def toy_encode(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """Per row: ``scale = absmax / 127`` in float32 (1 for a zero row), ``q = round(x / scale)`` stored as
    ``|q| | 0x80 if q < 0``."""
    x = values.float()
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int16)
    codes = (q.abs() | torch.where(q < 0, 0x80, 0)).to(torch.uint8)
    return {"weight": codes.contiguous(), SCALE: scale.contiguous()}


def toy_layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {"weight": ("U8", shape), SCALE: ("F32", (shape[0], 1))}


def toy_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What the scheme means, written here apart from the tool: the signed code times its row's scale, one
    float32 product, one rounding."""
    c = codes.to(torch.int16)
    q = torch.where(c >= 0x80, -(c - 0x80), c).float()
    return (q * scale.float()).to(dtype)


def register_toy(tables: Path) -> None:
    (tables / f"{NAME}.yaml").write_text(TABLE)
    register_codes(CODES, toy_code_values())
    register_codec(NAME, toy_encode, toy_layout)
    register_scheme_dir(tables)


def unregister_toy(tables: Path) -> None:
    unregister_scheme_dir(tables)
    unregister_codec(NAME)
    unregister_codes(CODES)


@pytest.fixture
def toy_scheme(tmp_path_factory):
    tables = tmp_path_factory.mktemp("toy-tables")
    register_toy(tables)
    try:
        yield get_scheme(NAME)
    finally:
        unregister_toy(tables)


# -- a real family layout quantized with it -----------------------------------------------------------------


def _quantizable(key: str, t: torch.Tensor) -> bool:
    """The linears a recipe quantizes: 2-D weights but the embeddings, heads and routers."""
    module, _, param = key.rpartition(".")
    leaf = module.rpartition(".")[2]
    return param == "weight" and t.dim() == 2 and leaf not in ("embed_tokens", "lm_head", "head", "gate")


def toy_quantize(src: Path, dst: Path) -> Path:
    """``src`` (a BF16 checkpoint) with every quantizable linear in the toy storage, shard by shard, and the
    config declaring the scheme with every other 2-D module in its exact-name ``ignore`` list."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "ckpt_manifest.json"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = {}
    ignore: list[str] = []
    total = 0
    for shard in sorted({*index["weight_map"].values()}):
        out: dict[str, torch.Tensor] = {}
        for k, t in load_file(src / shard).items():
            if _quantizable(k, t):
                module = k.removesuffix(".weight")
                out.update({f"{module}.{s}": v for s, v in toy_encode(t, EncodeArgs()).items()})
            else:
                out[k] = t
                if k.endswith(".weight") and t.dim() == 2:
                    ignore.append(k.removesuffix(".weight"))
        save_file(out, dst / shard, metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in out.values())
        weight_map.update(dict.fromkeys(out, shard))
    index["weight_map"] = dict(sorted(weight_map.items()))
    index["metadata"]["total_size"] = total
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": NAME, "ignore": sorted(ignore)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def release(make_fixture) -> Path:
    return make_fixture("deepseek_v3")


@pytest.fixture(scope="module")
def toy(release, tmp_path_factory) -> Path:
    return toy_quantize(release, tmp_path_factory.mktemp("toy") / "verifier")


def _modules(ckpt_dir: Path, prefix: str = "") -> list[str]:
    return sorted(k.removesuffix("." + SCALE) for k in tensors_of(ckpt_dir) if k.endswith(SCALE) and
                  k.startswith(prefix))


# -- unregistered: unknown ----------------------------------------------------------------------------------


def test_without_the_registration_the_scheme_is_unknown(toy, tmp_path, tmp_path_factory):
    from ckpt_tools.model.quant.decode import REGISTERED_CODES

    assert NAME not in all_schemes() and NAME not in CODECS and CODES not in REGISTERED_CODES
    for verb, code in ((("validate", toy), 1), (("dequant", toy, "-o", tmp_path / "out"), 3)):
        res = run_ckpt(*verb, code=code)
        assert "quant-unknown" in res.output and NAME in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_a_table_loads_once_its_decoder_and_encoder_are_registered(toy, tmp_path_factory):
    """Each registration is seen by the next load (the loaded tables are memoised): the table alone is refused
    (its code kind is unknown), then with its codes (its encoder is unknown), then it loads; undone, it is gone."""
    tables = tmp_path_factory.mktemp("one-by-one")
    (tables / f"{NAME}.yaml").write_text(TABLE)
    assert NAME not in all_schemes()  # loaded and memoised before the registrations
    register_scheme_dir(tables)
    try:
        with pytest.raises(TableError) as e:
            all_schemes()
        assert f"{NAME}.yaml" in str(e.value) and "decoder.codes" in str(e.value) and CODES in str(e.value)
        register_codes(CODES, toy_code_values())
        with pytest.raises(TableError) as e:
            all_schemes()
        assert f"{NAME}.yaml" in str(e.value) and "storage[0].encoder" in str(e.value)
        register_codec(NAME, toy_encode, toy_layout)
        assert all_schemes()[NAME].storage[0].label == "INT8 per row"
        run_ckpt("validate", toy)
        with pytest.raises(ValueError, match="already"):
            register_codec(NAME, toy_encode, toy_layout)
        with pytest.raises(ValueError, match="already"):
            register_codes(CODES, toy_code_values())
        with pytest.raises(ValueError, match="already"):
            register_codes("int", toy_code_values())  # a built-in kind
        packed = tmp_path_factory.mktemp("packed")  # one code per byte cannot be packed two per U8
        bad = TABLE.replace(f"scheme: {NAME}", "scheme: toy-packed").replace("dtypes: [U8]}", "dtypes: [U8], pack: 2}")
        (packed / "toy-packed.yaml").write_text(bad.replace(f"    encoder: {NAME}\n", ""))
        register_scheme_dir(packed)
        try:
            with pytest.raises(TableError) as e:
                all_schemes()
            assert "toy-packed.yaml" in str(e.value) and "storage[0].weight.pack" in str(e.value)
        finally:
            unregister_scheme_dir(packed)
    finally:
        unregister_toy(tables)
    assert NAME not in all_schemes()
    out = run_ckpt("validate", toy, code=1).output
    assert "quant-unknown" in out and "register_scheme_dir" in out, out  # the refusal says how to add one


# -- registered: every verb, no other code ------------------------------------------------------------------


def test_inspect_reports_the_scheme(toy_scheme, toy):
    rep = json.loads(run_ckpt("inspect", toy, "--json").stdout)
    assert rep["quantization"]["scheme"] == NAME and rep["quantization"]["quant_method"] == NAME
    mods = {m["module"]: m for m in rep["mtp_quant"]["modules"]}
    assert set(_modules(toy, MTP)) <= set(mods)
    eh = mods[MTP + "eh_proj"]
    assert (eh["stored"]["state"], eh["stored"]["label"], eh["declared"]["state"], eh["ok"]) == \
        ("quantized", "INT8 per row", "quantized", True)
    assert not rep.get("findings")


def test_validate_accepts_it_and_refuses_a_missing_companion(toy_scheme, toy, tmp_path):
    run_ckpt("validate", toy)
    broken = tmp_path / "broken"
    shutil.copytree(toy, broken)
    from safetensors.torch import load_file, save_file

    key = f"{MTP}self_attn.o_proj.{SCALE}"
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop(key)
    state = load_file(broken / shard)
    del state[key]
    save_file(state, broken / shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    res = run_ckpt("validate", broken, code=1)
    assert "mtp-quant-config" in res.output and key in " ".join(res.output.split()), res.output


def test_dequant_writes_the_decoders_floats_and_drops_the_config(toy_scheme, toy, tmp_path):
    out = tmp_path / "out"
    run_ckpt("dequant", toy, "-o", out)
    state, got = tensors_of(toy), tensors_of(out)
    modules = _modules(toy)
    assert len(modules) > 40 and any(m.startswith(MTP) for m in modules)
    for m in modules:
        want = toy_decode(state[f"{m}.weight"], state[f"{m}.{SCALE}"])
        assert f"{m}.{SCALE}" not in got and same_bits(got[f"{m}.weight"], want), m
    for k, v in got.items():  # everything else as stored
        if k.removesuffix(".weight") not in modules:
            assert same_bits(v, state[k]), k
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    run_ckpt("validate", out)


@pytest.fixture(scope="module")
def drafts(toy, tmp_path_factory):
    """The toy verifier's MTP as BF16 (extract --dequant bf16), and a finetuned copy of it."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("drafts")
    tables = root / "tables"  # module scope: the function fixture is not at hand
    tables.mkdir()
    register_toy(tables)
    try:
        run_ckpt("extract", toy, "-o", root / "same", "--dequant", "bf16")
        run_ckpt("extract", toy, "-o", root / "tuned", "--dequant", "bf16")
    finally:
        unregister_toy(tables)
    for f in (root / "tuned").glob("*.safetensors"):
        t = load_file(f)
        g = torch.Generator().manual_seed(0)
        t = {k: (v + 0.01 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype)
             if v.is_floating_point() and v.dim() == 2 else v for k, v in t.items()}
        save_file(t, f, metadata={"format": "pt"})
    return root / "same", root / "tuned"


def test_stitch_writes_a_changed_mtp_with_the_registered_encoder(toy_scheme, toy, drafts, tmp_path):
    _, tuned = drafts
    out = tmp_path / "out"
    run_ckpt("stitch", tuned, toy, "-o", out)
    v, d, c = tensors_of(toy), tensors_of(tuned), tensors_of(out)
    mtp = _modules(toy, MTP)
    assert len(mtp) >= 15
    for m in mtp:
        want = toy_encode(d[f"{m}.weight"], EncodeArgs())
        assert sorted(k for k in c if k.startswith(m + ".")) == sorted(f"{m}.{s}" for s in want), m  # toy storage
        for s, t in want.items():
            assert same_bits(c[f"{m}.{s}"], t), (m, s)
        assert not same_bits(c[f"{m}.weight"], v[f"{m}.weight"]), m  # the finetune changed it
    for k, t in v.items():  # the trunk as it was
        if not k.startswith(MTP):
            assert same_bits(c[k], t), k
    assert (out / "config.json").read_bytes() == (toy / "config.json").read_bytes()
    run_ckpt("validate", out)


def test_stitch_of_the_unchanged_mtp_is_byte_identical(toy_scheme, toy, drafts, tmp_path):
    same, _ = drafts
    out = tmp_path / "out"
    rep = json.loads(run_ckpt("stitch", same, toy, "-o", out, "--json").output)
    assert {t["status"] for t in rep["tensors"]} == {"unchanged"}, rep["totals"]
    for f in sorted(toy.glob("*.safetensors")) + [toy / "config.json"]:
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_graft_writes_the_release_mtp_with_the_registered_encoder(toy_scheme, release, toy, tmp_path):
    """A toy-int8 conversion that lost its MTP gets the BF16 release's back, written in the toy storage."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(toy, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    for shard in sorted({*index["weight_map"].values()}):
        t = load_file(target / shard)
        save_file({k: v for k, v in t.items() if not k.startswith(MTP)}, target / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: s for k, s in index["weight_map"].items() if not k.startswith(MTP)}
    index["metadata"]["total_size"] = sum(v.numel() * v.element_size() for v in tensors_of(target).values())
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    run_ckpt("graft", release, target, "-o", out, "--mtp-quant", NAME)
    src, got = tensors_of(release), tensors_of(out)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    encoded = _modules(out, MTP)  # the weights the family table marks quantizable (quant: true)
    assert len(encoded) >= 15
    for m in _modules(toy, MTP):
        if m in encoded:
            for s, t in toy_encode(src[f"{m}.weight"], EncodeArgs()).items():
                assert same_bits(got[f"{m}.{s}"], t), (m, s)
            assert m not in ignore, m
        else:  # the fusion (eh_proj) is not marked quantizable: written as the release stores it, and excluded
            assert same_bits(got[f"{m}.weight"], src[f"{m}.weight"]) and m in ignore, m
    run_ckpt("validate", out)


# -- a block scheme is one table too: the shipped block encoder, the scale named by the table ---------------

BLOCK = "toy-block"
BLOCK_SCALE = "weight_tile_scale"  # neither fp8-block's weight_scale_inv nor DeepSeek-V4's scale
BLOCK_TABLE = f"""\
scheme: {BLOCK}
title: toy block FP8 with its own scale name
declared_in:
  - file: config.json
    section: quantization_config
    match: {{quant_method: [{BLOCK}]}}
    exclude:
      - {{field: ignore, matcher: exact, create: true}}
    params:
      block: {{keys: [weight_block_size], default: [64, 64]}}
storage:
  - name: tiles
    label: "FP8 tiles {{block}}"
    weight: {{suffix: weight, dtypes: [F8_E4M3]}}
    tensors:
      - {{suffix: {BLOCK_SCALE}, role: scale, dtypes: [F32]}}
    encoder: fp8-block
    decoder:
      codes: e4m3
      scale: {{tensor: {BLOCK_SCALE}, granularity: "block"}}
"""
BLOCK_ARGS = EncodeArgs({"block": [64, 64]}, suffixes={"weight": "weight", "scale": BLOCK_SCALE})


@pytest.fixture
def block_scheme(tmp_path_factory):
    """Only a table: its encoder (fp8-block, the streamed block requantizer) and its decoder (e4m3 codes times
    the tile's scale) are the shipped ones; the scale's name and the tile size are the table's."""
    tables = tmp_path_factory.mktemp("block-tables")
    (tables / f"{BLOCK}.yaml").write_text(BLOCK_TABLE)
    register_scheme_dir(tables)
    try:
        yield get_scheme(BLOCK)
    finally:
        unregister_scheme_dir(tables)


def block_quantize(src: Path, dst: Path, drop_mtp: bool = False) -> Path:
    """``src`` with every quantizable linear in the toy block storage (the shipped encoder run in memory, the scale
    under the table's name), the config declaring the scheme; ``drop_mtp``: the MTP layer left out, as a quantizer
    that loses it writes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "ckpt_manifest.json"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = {}
    ignore: list[str] = []
    for shard in sorted({*index["weight_map"].values()}):
        out: dict[str, torch.Tensor] = {}
        for k, t in load_file(src / shard).items():
            if drop_mtp and k.startswith(MTP):
                continue
            if _quantizable(k, t):
                module = k.removesuffix(".weight")
                out.update({f"{module}.{s}": v for s, v in CODECS["fp8-block"].encode(t, BLOCK_ARGS).items()})
            else:
                out[k] = t
                if k.endswith(".weight") and t.dim() == 2:
                    ignore.append(k.removesuffix(".weight"))
        save_file(out, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard))
    index["weight_map"] = dict(sorted(weight_map.items()))
    index["metadata"]["total_size"] = sum(v.numel() * v.element_size() for v in tensors_of(dst).values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": BLOCK, "ignore": sorted(ignore)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def test_a_block_scheme_table_alone_works_for_graft_and_stitch(block_scheme, release, tmp_path):
    """graft --mtp-quant toy-block writes the release's MTP with the scale named as the table says, byte for byte
    the encoder's; the MTP extracted from it stitches back byte-identical, and a finetuned one is written in the
    same storage. While the table is registered, --mtp-quant lists it; unregistered, it refuses it."""
    from ckpt_tools.ops.stitch.graft import mtp_quants

    assert BLOCK in mtp_quants()
    target = block_quantize(release, tmp_path / "target", drop_mtp=True)
    grafted = tmp_path / "grafted"
    run_ckpt("graft", release, target, "-o", grafted, "--mtp-quant", BLOCK)
    src, got = tensors_of(release), tensors_of(grafted)
    encoded = sorted(k.removesuffix("." + BLOCK_SCALE) for k in got if k.startswith(MTP) and k.endswith(BLOCK_SCALE))
    assert len(encoded) >= 15 and not any(k.endswith(("weight_scale_inv", ".scale")) for k in got)
    for m in encoded:
        for s, t in CODECS["fp8-block"].encode(src[f"{m}.weight"], BLOCK_ARGS).items():
            assert same_bits(got[f"{m}.{s}"], t), (m, s)
    run_ckpt("validate", grafted)

    draft, back, out = tmp_path / "draft", tmp_path / "back", tmp_path / "out"
    run_ckpt("extract", grafted, "-o", draft, "--dequant", "bf16")
    run_ckpt("stitch", draft, grafted, "-o", back)
    for f in sorted(grafted.glob("*.safetensors")) + [grafted / "config.json"]:
        assert (back / f.name).read_bytes() == f.read_bytes(), f.name
    from safetensors.torch import load_file, save_file

    for f in draft.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: (v * 1.01).to(v.dtype) if v.is_floating_point() and v.dim() == 2 else v for k, v in t.items()},
                  f, metadata={"format": "pt"})
    run_ckpt("stitch", draft, grafted, "-o", out)
    d, c = tensors_of(draft), tensors_of(out)
    for m in encoded:
        for s, t in CODECS["fp8-block"].encode(d[f"{m}.weight"], BLOCK_ARGS).items():
            assert same_bits(c[f"{m}.{s}"], t), (m, s)
    assert (out / "config.json").read_bytes() == (grafted / "config.json").read_bytes()
    run_ckpt("validate", out)


def test_an_unregistered_block_table_is_not_an_mtp_quant(release, tmp_path):
    from ckpt_tools.ops.stitch.graft import mtp_quants

    assert BLOCK not in mtp_quants()
    res = run_ckpt("graft", release, release, "-o", tmp_path / "o", "--mtp-quant", BLOCK, code=2)
    assert "[mtp-quant-scheme]" in res.output and "no scheme table" in res.output
