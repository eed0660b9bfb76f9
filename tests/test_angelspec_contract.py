"""AngelSpec is not on PyPI: our `--format angelspec` output is held to a contract written by hand
from its code (fixtures/golden/formats/angelspec_contract.yaml, Tencent/AngelSpec at d3412be).

For every family the format accepts, the config we write must carry each MTPConfig field that
changes the module AngelSpec builds, and the draft's keys and shapes must be exactly the
module's state dict evaluated over that config (a field we leave out takes MTPConfig's Hy3
default, as AngelSpec would). Fixtures with non-default values check that the values are the
source's, not the defaults'.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from ckpt_tools.ops.inspect.tables import tables_info

from conftest import run_ckpt as ckpt

CONTRACT = yaml.safe_load(
    (Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "formats" / "angelspec_contract.yaml").read_text()
)
ACCEPTED = sorted(r["family"] for r in tables_info() if r["formats"]["angelspec"] == "ok")
KIND = {r["family"]: r["kind"] for r in tables_info()}


def _eval(expr, env: dict):
    """The contract's tiny expressions (names, arithmetic, comparisons) over a config dict."""
    if isinstance(expr, (int, float, bool)):
        return expr
    tree = ast.parse(str(expr), mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.BoolOp, ast.Compare, ast.Name, ast.Constant, ast.Load, ast.Mult,
               ast.Add, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Gt, ast.UnaryOp, ast.Not)
    assert all(isinstance(n, allowed) for n in ast.walk(tree)), expr
    return eval(compile(tree, "<contract>", "eval"), {"__builtins__": {}}, env)  # noqa: S307


def _as_mtpconfig(written: dict) -> dict:
    """What MTPConfig ends up with: the written fields, MTPConfig's defaults for the rest."""
    fields = {**CONTRACT["config_fields"], **CONTRACT["informational"]}
    return {**{k: v["default"] for k, v in fields.items()}, **written}


def _draft(path: Path) -> dict[str, list[int]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = list(fh.get_slice(k).get_shape())
    return out


def check_contract(draft: Path, with_embed: bool = False) -> dict:
    written = json.loads((draft / "config.json").read_text())
    assert written["architectures"] == ["MTPDraftModel"] and written["model_type"] == "mtp"
    cfg = _as_mtpconfig(written)
    needed = [name for name, f in CONTRACT["config_fields"].items() if _eval(f.get("when", True), cfg)]
    assert [n for n in needed if n not in written] == [], "fields left to MTPConfig's Hy3 defaults"
    expected = {}
    for entry in CONTRACT["state_dict"]:
        if entry["key"] == "embed_tokens.weight" and not with_embed:
            continue  # frozen copy of the target's: only with --with-embed
        if _eval(entry.get("when", True), cfg):
            expected[entry["key"]] = [_eval(d, cfg) for d in entry["shape"]]
    assert _draft(draft) == expected
    return written


def _draft_of(family: str, make_fixture, tmp_path: Path, *extra, **fixture_kw) -> Path:
    out = tmp_path / "angelspec"
    if KIND[family] == "template":  # no MTP layer to extract: a fresh draft for the target
        ckpt("init-draft", make_fixture(family, **fixture_kw), "-o", out, "--format", "angelspec", *extra)
    else:
        ckpt("extract", make_fixture(family, **fixture_kw), "-o", out, "--format", "angelspec", *extra)
    return out


def test_the_families_angelspec_accepts():
    # Hy3 and EXAONE-MoE natively, Llama / Qwen3 / Qwen3-MoE as init-draft templates; ERNIE-4.5 is
    # refused (no MTP final norm), zero-centred and MLA families too
    assert {"hy_v3", "exaone_moe"} <= set(ACCEPTED)
    assert "ernie4_5_moe" not in ACCEPTED and "qwen3_next" not in ACCEPTED


@pytest.mark.parametrize("family", ACCEPTED)
def test_output_meets_the_contract(family, make_fixture, tmp_path):
    check_contract(_draft_of(family, make_fixture, tmp_path))


def test_with_embed_meets_the_contract(make_fixture, tmp_path):
    check_contract(_draft_of("hy_v3", make_fixture, tmp_path, "--with-embed"), with_embed=True)


# Non-default values, each written by hand beside the source key it comes from.
HY3 = {
    "num_experts_per_tok": 3, "router_scaling_factor": 1.75, "rms_norm_eps": 1.0e-6, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}, "route_norm": False,
    "moe_router_use_sigmoid": False,
}
HY3_WRITTEN = {
    "num_experts_per_tok": 3, "router_scaling_factor": 1.75, "rms_norm_eps": 1.0e-6, "max_position_embeddings": 4096,
    "rope_theta": 250000.0, "route_norm": False, "moe_router_use_sigmoid": False, "qk_norm": True,
    "moe_router_enable_expert_bias": True, "mlp_type": "moe", "num_experts": 4, "num_shared_experts": 1,
    "moe_intermediate_size": 32, "head_dim": 16, "hidden_act": "silu", "mtp_init_from_target_layer": 3,
}
EXAONE = {
    "num_experts_per_tok": 3, "routed_scaling_factor": 1.25, "rms_norm_eps": 1.0e-6, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "norm_topk_prob": False,
}
EXAONE_WRITTEN = {
    "num_experts_per_tok": 3, "router_scaling_factor": 1.25, "rms_norm_eps": 1.0e-6, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "route_norm": False, "moe_router_use_sigmoid": True, "qk_norm": True,
    "mlp_type": "dense", "intermediate_size": 96,
}


@pytest.mark.parametrize(("family", "overrides", "want"), [("hy_v3", HY3, HY3_WRITTEN),
                                                            ("exaone_moe", EXAONE, EXAONE_WRITTEN)],
                         ids=["hy_v3", "exaone_moe"])
def test_non_default_values_are_the_sources(family, overrides, want, make_fixture, tmp_path):
    written = check_contract(_draft_of(family, make_fixture, tmp_path, config_overrides=overrides))
    assert {k: written.get(k) for k in want} == want
    if family == "exaone_moe":  # no warm start: AngelSpec reads model.layers.<N>.*, EXAONE keeps mtp.*
        assert "mtp_init_from_target_layer" not in written


def test_ernie_is_refused_with_the_reason(make_fixture, tmp_path):
    r = ckpt("extract", make_fixture("ernie4_5_moe"), "-o", tmp_path / "o", "--format", "angelspec", code=3)
    assert "format-unsupported" in r.output and "final_layernorm" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"hidden_act": "gelu"}, "hard-code SiLU"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0e6, "factor": 4.0}}, "unscaled RoPE"),
    ],
    ids=["gelu", "yarn"],
)
def test_what_angelspec_cannot_build_is_refused(overrides, why, make_fixture, tmp_path):
    src = make_fixture("hy_v3", config_overrides=overrides)
    r = ckpt("extract", src, "-o", tmp_path / "o", "--format", "angelspec", code=3)
    assert "format-unsupported" in r.output and why in r.output, r.output


def test_a_field_the_source_lacks_is_required_not_defaulted(make_fixture, tmp_path):
    # a Qwen3-MoE config without num_experts_per_tok: AngelSpec would route top-8 (Hy3's);
    # the template declares no default for it, so the draft is refused and the key named
    cfg = json.loads((make_fixture("qwen3_moe") / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(cfg))
    r = ckpt("init-draft", target / "config.json", "-o", tmp_path / "o", "--format", "angelspec", code=3)
    assert "num_experts_per_tok" in r.output and "format-unsupported" in r.output, r.output
