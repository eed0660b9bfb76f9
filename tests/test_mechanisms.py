"""Generic mechanisms added for the families of issue 11 (part B), tested on their own:

* repeated MTP sub-blocks (``mtp.blocks[].repeat`` with ``j`` / ``item``), driven by a pattern string;
* the column-wise join / split link that carries a family's two ``[H, H]`` fusion halves
  (``fusion_embed`` / ``fusion_hidden``) through a format's single ``[H, 2H]`` fusion slot;
* expert key templates (``names:``) surviving a same-layout, same-prefix regrouping.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.errors import InputError, PlanError, TableError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.config import ConfigView
from ckpt_tools.io.safetensors_io import LocalFile, read_header, refs_from_header
from ckpt_tools.model.expert_layouts import ExpertLayout
from ckpt_tools.model.formats import check_expressible, correspond, get_format
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.tables.loader import get_table, load_table, mappings_dir
from ckpt_tools.model.tables.resolve import resolve
from ckpt_tools.numeric import transforms
from ckpt_tools.stream.plan import CopyBytes, OutputTensor
from ckpt_tools.testing import fixture_config

from conftest import run_ckpt as ckpt


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                out[k] = fh.get_tensor(k)
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------- repeated sub-blocks


def test_repeat_expands_one_sub_block_per_pattern_element_and_depth():
    t = get_table("nemotron_h")
    res = resolve(t, ConfigView(fixture_config("nemotron_h", {"mtp_hybrid_override_pattern": "E*"})), mtp_count=2)
    assert [layer.block_prefixes for layer in res.layers] == [
        ["mtp.layers.0.", "mtp.layers.1."], ["mtp.layers.2.", "mtp.layers.3."]]
    # the element decides the parts: MoE first, attention second, in both depths
    for layer in res.layers:
        first, second = layer.block_prefixes
        assert [g.prefix for g in layer.experts] == [first + "mixer.experts"]
        assert any(s.key == second + "mixer.q_proj.weight" for s in layer.block)
        assert {s.block for s in layer.block} == {0, 1}
        assert layer.glue["final_norm"].key == second + "final_layernorm.weight"


def test_tensors_of_a_depth_beyond_the_count_are_reported(make_fixture):
    """Sub-block prefixes count for the 'beyond the declared count' check, not only the step's first one."""
    path = make_fixture("nemotron_h", config_overrides={"num_nextn_predict_layers": 2})
    ckpt_ = Checkpoint.open(path)
    view = open_mtp(ckpt_, count=1)
    assert "mtp.layers.3.final_layernorm.weight" in view.beyond
    assert "mtp.layers.2.enorm.weight" in view.beyond
    assert not view.missing


def _table_with(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load((mappings_dir() / "architectures" / "nemotron_h.yaml").read_text())
    data["family"] = "repeat_probe"
    edit(data)
    path = tmp_path / "repeat_probe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_repeat_variables_are_known_to_the_checker_but_others_are_not(tmp_path):
    ok = load_table(_table_with(tmp_path, lambda d: None))
    assert ok.mtp.blocks[0].repeat == "mtp_pattern"

    def bad(d):
        d["mtp"]["blocks"][0]["repeat"] = "mtp_patern"

    with pytest.raises(TableError, match=r"mtp\.blocks\[0\]\.repeat.*mtp_patern"):
        load_table(_table_with(tmp_path, bad))


def test_repeat_over_a_number_is_a_table_error(tmp_path):
    def number(d):
        d["mtp"]["blocks"][0]["repeat"] = "len(mtp_pattern)"

    t = load_table(_table_with(tmp_path, number))
    # config values took part, so the error names the config field (InputError), else the table (TableError)
    with pytest.raises((TableError, InputError), match="string or a list"):
        resolve(t, ConfigView(t.fixture))


def test_multi_sub_block_steps_are_refused_by_renaming_formats(make_fixture):
    view = open_mtp(Checkpoint.open(make_fixture("nemotron_h")))
    with pytest.raises(InputError, match="2 sub-blocks"):
        check_expressible(get_format("angelspec"), view, [0])
    check_expressible(get_format("native"), view, [0])


# --------------------------------------------------------------------------- column join / split


def _ot(key: str, arr: np.ndarray, dtype: str, tmp_path: Path) -> OutputTensor:
    """An OutputTensor whose recipe copies ``arr``'s bytes out of a file written by the safetensors library."""
    from ckpt_tools.dtypes import torch_dtype

    t = torch.from_numpy(arr) if dtype == "U8" else torch.from_numpy(arr).to(torch_dtype(dtype))
    path = tmp_path / f"{key}.safetensors"
    save_file({key: t}, str(path))
    src = LocalFile(path)
    ref = refs_from_header(src, read_header(src))[key]
    return OutputTensor(key, ref.dtype, ref.shape, CopyBytes([ref.segment()]))


def _bytes(t: OutputTensor) -> bytes:
    return b"".join(bytes(b) for b in transforms.recipe_bytes(t.recipe, 1 << 20))


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F16"])
def test_concat_then_split_columns_is_byte_exact(dtype, tmp_path, monkeypatch):
    monkeypatch.setattr(transforms, "BAND_BYTES", 64)  # force many bands
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 16)).astype(np.float32)
    b = rng.standard_normal((37, 24)).astype(np.float32)
    ta, tb = _ot("a", a, dtype, tmp_path), _ot("b", b, dtype, tmp_path)
    joined = transforms.concat_columns([ta, tb], "ab")
    assert (joined.shape, joined.dtype) == ((37, 40), dtype)
    # independent oracle: torch.cat of the tensors the safetensors library reads
    from ckpt_tools.dtypes import torch_dtype

    expect = torch.cat([torch.from_numpy(a).to(torch_dtype(dtype)), torch.from_numpy(b).to(torch_dtype(dtype))], 1)
    assert _bytes(joined) == raw(expect)
    pa, pb = transforms.split_columns(joined, [("a", 16), ("b", 24)])
    assert (pa.shape, pb.shape) == ((37, 16), (37, 24))
    assert _bytes(pa) == _bytes(ta) and _bytes(pb) == _bytes(tb)


def test_concat_columns_keeps_leading_dimensions_and_any_dtype(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    b = (np.arange(2 * 3 * 2, dtype=np.uint8) + 100).reshape(2, 3, 2)
    joined = transforms.concat_columns([_ot("a", a, "U8", tmp_path), _ot("b", b, "U8", tmp_path)], "ab")
    assert joined.shape == (2, 3, 6)
    assert _bytes(joined) == np.concatenate([a, b], axis=-1).tobytes()


def test_join_and_split_refuse_what_they_cannot_do(tmp_path):
    a = _ot("a", np.zeros((4, 2), np.float32), "F32", tmp_path)
    b = _ot("b", np.zeros((5, 2), np.float32), "F32", tmp_path)
    with pytest.raises(PlanError, match="leading dimensions"):
        transforms.concat_columns([a, b], "ab")
    c = _ot("c", np.zeros((4, 2), np.float32), "BF16", tmp_path)
    with pytest.raises(PlanError, match="different dtypes"):
        transforms.concat_columns([a, c], "ac")
    with pytest.raises(PlanError, match="does not split"):
        transforms.split_columns(a, [("x", 1), ("y", 2)])


# --------------------------------------------------------------------------- fusion halves through a format


def _fusion_link(view, fmt):
    corr = correspond(fmt, view, [0])
    (link,) = [t for t in corr.tensors if t.columns]
    return link


def any_block(name: str):
    """A registered format without its consumer's block restrictions (to exercise name mapping)."""
    from ckpt_tools.model.formats import Supports

    return get_format(name).model_copy(update={"supports": Supports()})


def test_fusion_halves_join_in_the_format_order(make_fixture):
    view = open_mtp(Checkpoint.open(make_fixture("deepseek_v4")))
    fmt = any_block("angelspec")
    link = _fusion_link(view, fmt)
    assert link.draft_key == "eh_proj.weight" and link.shape == (64, 128)
    assert link.verifier_keys() == ["mtp.0.e_proj.weight", "mtp.0.h_proj.weight"]  # embed first
    hidden_first = fmt.model_copy(update={"concat_order": "hidden_first"})
    assert _fusion_link(view, hidden_first).verifier_keys() == ["mtp.0.h_proj.weight", "mtp.0.e_proj.weight"]
    # the native format keeps the family's two tensors
    native = correspond(get_format("native"), view, [0])
    assert not any(t.columns for t in native.tensors)
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight"} <= {t.draft_key for t in native.tensors}


def test_fusion_halves_extract_joined_and_stitch_back_split(make_fixture, tmp_path, monkeypatch):
    from ckpt_tools.model import formats
    from ckpt_tools.model.formats import table

    registered = dict(formats.all_formats(), angelspec=any_block("angelspec"))
    monkeypatch.setattr(table, "all_formats", lambda: registered)  # where get_format looks it up
    src = make_fixture("deepseek_v4")
    draft = tmp_path / "draft"
    ckpt("extract", src, "-o", draft, "--format", "angelspec")
    d = tensors(draft)
    v = tensors(src)
    assert raw(d["eh_proj.weight"]) == raw(torch.cat([v["mtp.0.e_proj.weight"], v["mtp.0.h_proj.weight"]], 1))
    assert not [k for k in d if k.split(".")[-2] in ("e_proj", "h_proj")]  # only the joined tensor

    # perturb only the hidden half of the joined tensor: stitch changes h_proj and nothing else
    data = load_file(str(draft / "model.safetensors"))
    w = data["eh_proj.weight"].clone()
    w[:, 64:] = (w[:, 64:].float() * 1.25).to(w.dtype)  # a change finetuning could make (not a divergent one)
    data["eh_proj.weight"] = w
    save_file(data, str(draft / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    r = ckpt("stitch", draft, src, "-o", out, "--json")
    report = json.loads(r.output[r.output.index("{"):])
    changed = {t["key"] for t in report["tensors"] if t["status"] != "unchanged"}
    assert changed == {"mtp.0.h_proj.weight"}
    o = tensors(out)
    assert raw(o["mtp.0.h_proj.weight"]) == raw(w[:, 64:].contiguous())
    assert raw(o["mtp.0.e_proj.weight"]) == raw(v["mtp.0.e_proj.weight"])


@pytest.mark.parametrize("suffix,grid,codec", [("weight_scale_inv", (1, 1), "fp8-block"),
                                               ("weight_scale", (64, 1), "ct-fp8")])
def test_a_quantized_fused_draft_tensor_is_refused_its_split_by_its_codec(make_fixture, tmp_path, monkeypatch,
                                                                          suffix, grid, codec):
    from ckpt_tools.model import formats
    from ckpt_tools.model.formats import table

    registered = dict(formats.all_formats(), angelspec=any_block("angelspec"))
    monkeypatch.setattr(table, "all_formats", lambda: registered)
    src = make_fixture("deepseek_v4")
    draft = tmp_path / "draft"
    ckpt("extract", src, "-o", draft, "--format", "angelspec")
    data = load_file(str(draft / "model.safetensors"))
    w = data["eh_proj.weight"]
    assert w.shape[0] == grid[0] or grid == (1, 1)
    data["eh_proj.weight"] = w.float().to(torch.float8_e4m3fn)  # the fused weight stored FP8 with its scale
    data["eh_proj." + suffix] = torch.ones(grid, dtype=torch.float32)
    save_file(data, str(draft / "model.safetensors"), metadata={"format": "pt"})
    out = ckpt("stitch", draft, src, "-o", tmp_path / "out", code=3).output
    assert "[quant-capability]" in out and f"whose codec ({codec}) cannot split its columns" in out
    assert "eh_proj" in out and not (tmp_path / "out").exists()


def test_a_missing_half_is_named(make_fixture, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(make_fixture("deepseek_v4"), src)
    ckpt_ = Checkpoint.open(src)
    view = open_mtp(ckpt_)
    view.present = [s for s in view.present if s.key != "mtp.0.h_proj.weight"]
    with pytest.raises(InputError, match="fusion_hidden is missing"):
        correspond(any_block("angelspec"), view, [0])


# --------------------------------------------------------------------------- expert key templates


def test_expert_names_survive_same_layout_same_prefix():
    res = resolve(get_table("deepseek_v4"), ConfigView(fixture_config("deepseek_v4")))
    (g,) = res.experts()
    assert g.key("gate", 2) == "mtp.0.ffn.experts.2.w1.weight"
    assert g.with_layout(g.layout, prefix=g.prefix).key("up", 1) == "mtp.0.ffn.experts.1.w3.weight"
    assert g.with_layout(ExpertLayout("fused")).key("gate_up") == "mtp.0.ffn.experts.gate_up_proj"


# --------------------------------------------------------------------------- block tensors from the root


def test_a_part_tensor_with_a_leading_slash_lives_at_the_root_once(make_fixture):
    """qwen4_exp's top-level mtp.fc_* / mixer tensors: a part tensor keyed '/...' is placed from the root (not
    under the MTP layer prefix), listed with depth 0 only (its part's ``when: i == 0``), and a checkpoint with
    more depths declared than present does not count it past the declared count."""
    t = get_table("qwen4_exp")
    res = resolve(t, ConfigView(fixture_config("qwen4_exp", {"mtp_num_hidden_layers": 2})))
    keys = [[s.key for s in layer.block] for layer in res.layers]
    assert "mtp.fc_embedding.weight" in keys[0] and not any(k.startswith("mtp.layers.0.mtp.") for k in keys[0])
    assert not any("fc_embedding" in k for k in keys[1])
    assert all(k.startswith("mtp.layers.1.") for k in keys[1])
    view = open_mtp(Checkpoint.open(make_fixture("qwen4_exp")))
    assert "mtp.fc_embedding.weight" in view.keys() and view.beyond == [] and view.extra == []
