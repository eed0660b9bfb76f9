"""Quantization-aware validate / inspect, and `validate --fix-quant-config`, on one fixture per real failure mode.

Each failure mode seen in public trackers (a BF16 MTP whose exclusion list misses ``eh_proj`` /
``mtp.fc``, exclusions written for names engines do not match, a quantized MTP excluded, a missing
scale, a config declaring MTP with no MTP weights) is built by ``make_quantized_checkpoint`` and:

- ``validate`` exits 1 naming the rule and the module;
- ``validate --fix-quant-config -o OUT`` repairs what a config change can: OUT validates, every file
  but config.json / hf_quant_config.json is byte-identical (the same inode when hardlinked), and the
  consumer's own matcher agrees (compressed-tensors ``match_name``, ModelOpt's fnmatch, transformers'
  ``should_convert_module``); what it cannot repair is refused (exit 3) with nothing written.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

import pytest

from ckpt_tools.testing import FixtureOptions
from ckpt_tools.testing.quantized import ENGINE_FUSED, QuantOptions, make_quantized_checkpoint

from conftest import run_ckpt

pytest.importorskip("compressed_tensors", reason="compressed-tensors comes with the test extra")
from compressed_tensors.utils.match import match_name  # noqa: E402
from transformers.quantizers.quantizers_utils import should_convert_module  # noqa: E402

DS, QW = "model.layers.3.", "mtp."  # the fixtures' MTP prefixes (deepseek_v3, qwen3_5_moe)
CONFIG_FILES = {"config.json", "hf_quant_config.json"}
# id -> (family, QuantOptions kwargs, a module the findings name)
FIXABLE = {
    "bf16-no-fusion-ct-fp8-block": ("deepseek_v3", dict(scheme="ct-fp8-block", mtp="bf16", mtp_exclude="no-fusion"),
                                    DS + "eh_proj"),
    "bf16-no-fusion-ct-nvfp4": ("qwen3_5_moe", dict(scheme="ct-nvfp4", mtp="bf16", mtp_exclude="no-fusion"),
                                "mtp.fc"),
    "bf16-blocks-modelopt-nvfp4": ("qwen3_5_moe", dict(scheme="modelopt-nvfp4", mtp="bf16", mtp_exclude="blocks"),
                                   "mtp.fc"),
    "bf16-no-fusion-modelopt-mixed": ("qwen3_5_moe", dict(scheme="modelopt-mixed", mtp="bf16",
                                                          mtp_exclude="no-fusion"), "mtp.fc"),
    "fused-names-only-ct-w4a16": ("deepseek_v3", dict(scheme="ct-w4a16-g32", mtp="bf16", mtp_exclude="fused"),
                                  DS + "self_attn.q_a_proj"),
    "partial-fused-ct-nvfp4": ("qwen3_5_moe", dict(scheme="ct-nvfp4", mtp="bf16", mtp_exclude="partial"),
                               "mtp.layers.0.self_attn.k_proj"),
    "unfused-names-only-fp8-block": ("deepseek_v3", dict(scheme="fp8-block-ue8m0", mtp="bf16", mtp_exclude="no-fusion"),
                                     DS + "self_attn.fused_qkv_a_proj"),
    "quantized-excluded-exact-ct-nvfp4": ("qwen3_5_moe", dict(scheme="ct-nvfp4", mtp_exclude="exact"), "mtp.fc"),
    "quantized-excluded-pattern-ct-fp8-block": ("deepseek_v3", dict(scheme="ct-fp8-block", mtp_exclude="pattern"),
                                                DS + "eh_proj"),
}
# id -> (family, QuantOptions kwargs, rule, module named, what the refusal points to)
UNFIXABLE = {
    "missing-scale-ct-nvfp4": ("deepseek_v3", dict(scheme="ct-nvfp4",
                                                   drop_keys=(DS + "self_attn.o_proj.weight_scale",)),
                               "mtp-quant-config", DS + "self_attn.o_proj", "ckpt graft"),
    "missing-scale-modelopt-nvfp4": ("qwen3_5_moe", dict(scheme="modelopt-nvfp4",
                                                         drop_keys=("mtp.fc.weight_scale_2",)),
                                     "mtp-quant-config", "mtp.fc", "ckpt graft"),
    "quantized-excluded-modelopt-mixed": ("deepseek_v3", dict(scheme="modelopt-mixed", mtp_exclude="pattern"),
                                          "mtp-quant-config", DS + "eh_proj", "quantized_layers"),
    "declared-no-weights-ct-nvfp4": ("qwen3_5_moe", dict(scheme="ct-nvfp4", mtp="dropped", mtp_count="kept"),
                                     "mtp-missing", QW, "ckpt graft"),
    "declared-no-weights-fp8-block": ("deepseek_v3", dict(scheme="fp8-block-ue8m0", mtp="dropped", mtp_count="kept"),
                                      "mtp-missing", DS, "ckpt graft"),
}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(family, **QuantOptions)`` -> a read-only quantized fixture, made once per module."""
    cache: dict = {}

    def make(family: str, num_shards: int = 4, **kw) -> Path:
        key = (family, num_shards, tuple(sorted(kw.items())))
        if key not in cache:
            out = make_quantized_checkpoint(family, tmp_path_factory.mktemp("q"), QuantOptions(**kw),
                                            FixtureOptions(num_shards=num_shards))
            for p in out.iterdir():
                p.chmod(0o444)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="module")
def fixed(build, tmp_path_factory):
    """``fixed(case)`` -> (input, OUT, the --json report of the fix, validate --json of the input); cached."""
    cache: dict = {}

    def make(case: str):
        if case not in cache:
            family, kw, _ = FIXABLE[case]
            src = build(family, **kw)
            before = json.loads(run_ckpt("validate", src, "--json", code=1).stdout)
            out = tmp_path_factory.mktemp("fixed") / "out"
            rep = json.loads(run_ckpt("validate", "--fix-quant-config", src, "-o", out, "--link", "hardlink",
                                      "--json").stdout)
            cache[case] = (src, out, rep, before)
        return cache[case]

    return make


def _read(path: Path, name: str) -> dict | None:
    p = path / name
    return json.loads(p.read_text()) if p.is_file() else None


def _excluded(out: Path, module: str) -> dict[str, bool]:
    """Every place the output declares quantization in, read by its consumer's own matcher: excluded?"""
    cfg = _read(out, "config.json")
    qc = cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config") or {}
    seen: dict[str, bool] = {}
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        seen["compressed-tensors ignore"] = any(match_name(module, i) for i in qc.get("ignore") or [])
    elif method == "modelopt":
        listed = qc.get("quantized_layers")
        seen["modelopt ignore"] = any(fnmatch.fnmatchcase(module, p) for p in qc.get("ignore") or []) or (
            listed is not None and module not in listed)
    elif method == "fp8":
        seen["transformers modules_to_not_convert"] = not should_convert_module(
            module, qc.get("modules_to_not_convert"))
    hf = _read(out, "hf_quant_config.json")
    if hf is not None:
        q = hf["quantization"]
        listed = q.get("quantized_layers")
        seen["modelopt exclude_modules"] = any(fnmatch.fnmatchcase(module, p) for p in q.get("exclude_modules") or []) \
            or (listed is not None and module not in listed)
    assert seen, f"no quantization declared in {out}"
    return seen


def _files(path: Path) -> dict[str, Path]:
    return {str(p.relative_to(path)): p for p in path.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------
# validate names the rule and the module; the fix repairs the config only


@pytest.mark.parametrize("case", sorted(FIXABLE))
def test_validate_flags_the_failure_mode(build, case):
    family, kw, module = FIXABLE[case]
    src = build(family, **kw)
    result = run_ckpt("validate", src, code=1)
    assert "mtp-quant-config" in result.stdout and module in result.stdout
    assert f"--fix-quant-config {src} -o OUT" in result.stdout
    report = json.loads(run_ckpt("validate", src, "--json", code=1).stdout)
    assert set(report["counts"]) == {"mtp-quant-config"}
    assert module in {p["key"] for p in report["problems"]}
    quant = report["mtp_quant"]  # the per-module audit behind the rule
    assert quant["scheme"] and not quant["ok"] and quant["modules"]
    assert module in {f["key"] for f in quant["findings"]}


@pytest.mark.parametrize("case", sorted(FIXABLE))
def test_fix_quant_config_repairs_only_the_config(fixed, case):
    src, out, rep, before = fixed(case)
    assert rep["status"] == "fixed" and rep["written"] and rep["link"] == "hardlink"
    run_ckpt("validate", out)  # OUT passes validate, mtp-quant-config included
    assert json.loads(run_ckpt("validate", out, "--json").stdout)["mtp_quant"]["ok"]
    # every other file: the same bytes, the same inode (hardlinked); only the config files differ
    ins, outs = _files(src), _files(out)
    assert set(ins) <= set(outs)
    changed = {name for name in ins if ins[name].read_bytes() != outs[name].read_bytes()}
    assert changed == set(rep["changed_files"]) and changed <= CONFIG_FILES and "config.json" in changed
    for name in ins:
        if name.endswith(".safetensors"):
            assert os.stat(ins[name]).st_ino == os.stat(outs[name]).st_ino, name
    assert set(outs) - set(ins) == {"ckpt_manifest.json"}
    assert _read(out, "model.safetensors.index.json")["weight_map"] == \
        _read(src, "model.safetensors.index.json")["weight_map"]
    # the config change is only the diff the report shows
    assert rep["diff"] and all(d["file"] in changed and (d["added"] or d["removed"]) for d in rep["diff"])
    manifest = _read(out, "ckpt_manifest.json")
    assert manifest["kind"] == "quant-config-fixed" and manifest["quant_config"]["changes"] == rep["changes"]
    # each module the findings name is now declared as stored, by the consumer's own matcher
    for f in before["mtp_quant"]["findings"]:
        for name in f["names"]:
            want = f["fix"] == "exclude"
            assert set(_excluded(out, name).values()) == {want}, (name, _excluded(out, name))


@pytest.mark.parametrize("case", ["bf16-no-fusion-ct-fp8-block", "bf16-no-fusion-ct-nvfp4",
                                  "bf16-blocks-modelopt-nvfp4", "fused-names-only-ct-w4a16", "partial-fused-ct-nvfp4"])
def test_every_bf16_mtp_module_and_its_fused_layer_is_excluded_for_the_consumer(fixed, case):
    """Independent of our audit: every 2-D BF16 MTP weight of the files, and the engines' fused names."""
    src, out, _, _ = fixed(case)
    prefix = DS if FIXABLE[case][0] == "deepseek_v3" else QW
    index = _read(src, "model.safetensors.index.json")["weight_map"]
    from safetensors import safe_open

    modules = []
    for key, shard in index.items():
        if key.startswith(prefix) and key.endswith(".weight") and not key.endswith(("norm.weight", "gate.weight")):
            with safe_open(src / shard, "pt") as f:
                sl = f.get_slice(key)
                if sl.get_dtype() == "BF16" and len(sl.get_shape()) == 2 and "embed" not in key and "head" not in key:
                    modules.append(key.removesuffix(".weight"))
    assert len(modules) > 10
    # routed experts are probed per expert, never fused into one linear
    fused = set()
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        for name, shards in ENGINE_FUSED.items():
            if ".experts." not in m and leaf in shards and all(f"{parent}.{s}" in modules for s in shards):
                fused.add(f"{parent}.{name}")
    for m in [*modules, *sorted(fused)]:
        assert all(_excluded(out, m).values()), (m, _excluded(out, m))


def test_quantized_mtp_is_no_longer_excluded_and_the_rest_stays_excluded(fixed):
    src, out, rep, _ = fixed("quantized-excluded-pattern-ct-fp8-block")
    before = _read(src, "config.json")["quantization_config"]["ignore"]
    after = _read(out, "config.json")["quantization_config"]["ignore"]
    dropped = [p for p in before if p not in after]
    assert dropped and all(p.startswith("re:") for p in dropped)  # the pattern that excluded the MTP
    for m in (DS + "eh_proj", DS + "self_attn.q_a_proj", DS + "mlp.experts.0.up_proj"):
        assert not any(match_name(m, i) for i in after), m
    # what the dropped pattern also excluded stays excluded, by name
    for m in (DS + "mlp.gate", DS + "shared_head.head"):
        assert any(match_name(m, i) for i in before) and any(match_name(m, i) for i in after), m
    assert any(d["removed"] == dropped for d in rep["diff"])


@pytest.mark.parametrize("case", sorted(UNFIXABLE))
def test_unfixable_is_refused_and_nothing_is_written(build, tmp_path, case):
    family, kw, rule, module, hint = UNFIXABLE[case]
    src = build(family, **kw)
    shown = run_ckpt("validate", src, code=1).stdout
    assert rule in shown and module in shown
    if rule == "mtp-missing":
        assert "ckpt graft SOURCE" in shown
    out = tmp_path / "out"
    result = run_ckpt("validate", "--fix-quant-config", src, "-o", out, code=3)
    err = " ".join(result.stderr.split())
    assert f"[{rule}]" in err and module in err and hint in err, err
    assert "Nothing was written" in err
    assert not out.exists()


# ---------------------------------------------------------------------------
# the options


def test_nothing_to_fix_writes_nothing(build, tmp_path):
    src = build("qwen3_5_moe", scheme="ct-fp8-block")
    run_ckpt("validate", src)
    out = tmp_path / "out"
    result = run_ckpt("validate", "--fix-quant-config", src, "-o", out)
    assert "nothing to fix" in result.stdout and not out.exists()
    rep = json.loads(run_ckpt("validate", "--fix-quant-config", src, "-o", out, "--json").stdout)
    assert (rep["status"], rep["written"], rep["diff"]) == ("nothing-to-fix", False, []) and not out.exists()


def test_dry_run_prints_the_diff_and_writes_nothing(build, tmp_path):
    src = build("qwen3_5_moe", scheme="modelopt-nvfp4", mtp="bf16", mtp_exclude="blocks")
    out = tmp_path / "out"
    result = run_ckpt("validate", "--fix-quant-config", src, "-o", out, "--dry-run")
    text = result.stdout
    assert "config.json: quantization_config.ignore" in text
    assert "hf_quant_config.json: quantization.exclude_modules" in text and "+ mtp.fc" in text
    assert "dry run" in text and not out.exists()
    rep = json.loads(run_ckpt("validate", "--fix-quant-config", src, "--dry-run", "--json").stdout)
    assert rep["written"] is False and rep["status"] == "fixed"
    assert {(d["file"], d["field"], tuple(d["added"])) for d in rep["diff"]} == {
        ("config.json", "quantization_config.ignore", ("mtp.fc",)),
        ("hf_quant_config.json", "quantization.exclude_modules", ("mtp.fc",))}


def test_copy_overwrite_and_output_inside_the_input(build, tmp_path):
    src = build("deepseek_v3", scheme="ct-fp8-block", mtp="bf16", mtp_exclude="no-fusion")
    out = tmp_path / "out"
    run_ckpt("validate", "--fix-quant-config", src, "-o", out)  # default: copy
    shard = next(p for p in src.glob("*.safetensors"))
    assert os.stat(shard).st_ino != os.stat(out / shard.name).st_ino
    assert (out / shard.name).read_bytes() == shard.read_bytes()
    result = run_ckpt("validate", "--fix-quant-config", src, "-o", out, code=4)
    assert "--overwrite" in result.stderr
    run_ckpt("validate", "--fix-quant-config", src, "-o", out, "--overwrite")
    run_ckpt("validate", out)
    result = run_ckpt("validate", "--fix-quant-config", src, "-o", src / "sub", code=2)
    assert "inside the input" in result.stderr
    run_ckpt("validate", "--fix-quant-config", src, code=2)  # needs -o (or --dry-run)
    run_ckpt("validate", src, "-o", out, code=2)  # -o goes with --fix-quant-config
    run_ckpt("validate", "--fix-quant-config", src, "-o", tmp_path / "o2", "--link", "symlink", code=2)


def test_a_lone_model_safetensors_is_linked_and_gets_an_index(build, tmp_path):
    src = build("qwen3_5_moe", num_shards=1, scheme="modelopt-nvfp4", mtp="bf16", mtp_exclude="blocks")
    out = tmp_path / "out"
    run_ckpt("validate", "--fix-quant-config", src, "-o", out, "--link", "hardlink")
    assert os.stat(src / "model.safetensors").st_ino == os.stat(out / "model.safetensors").st_ino
    assert set(_read(out, "model.safetensors.index.json")["weight_map"].values()) == {"model.safetensors"}
    assert all(_excluded(out, "mtp.fc").values())
    run_ckpt("validate", out)


# ---------------------------------------------------------------------------
# inspect: per MTP module, stored as what versus declared as what


def test_inspect_shows_storage_versus_declaration(build):
    src = build("qwen3_5_moe", scheme="ct-nvfp4", mtp="bf16", mtp_exclude="partial")
    rep = json.loads(run_ckpt("inspect", src, "--json").stdout)  # inspect reports what other verbs refuse
    assert {f["rule"] for f in rep["findings"]} == {"mtp-quant-config"}
    assert {f["key"] for f in rep["findings"]} == {m["module"] for m in rep["mtp_quant"]["modules"] if not m["ok"]}
    assert "allowed_invalid" not in rep
    assert rep["quantization"]["scheme"] == "ct-nvfp4" and rep["quantization"]["quant_method"] == "compressed-tensors"
    by = {m["module"]: m for m in rep["mtp_quant"]["modules"]}
    k, q = by["mtp.layers.0.self_attn.k_proj"], by["mtp.layers.0.self_attn.q_proj"]
    assert (k["stored"]["label"], k["declared"]["state"], k["ok"]) == ("BF16", "quantized", False)
    assert k["declared"]["group"] == "group_0" and k["declared"]["scheme"] == "ct-nvfp4"
    assert (q["declared"]["state"], q["declared"]["entry"]["pattern"], q["ok"]) == (
        "excluded", "mtp.layers.0.self_attn.q_proj", True)
    text = " ".join(run_ckpt("inspect", src).stdout.split())  # words wrap at the terminal's width
    assert run_ckpt("inspect", src, "--allow-invalid", "mtp-quant-config").stdout  # accepted, changes nothing
    assert "stored vs declared" in text and "problem" in text and "quantization: ct-nvfp4" in text
    assert "mtp.layers.0.self_attn.k_proj: stored unquantized (BF16) but not excluded" in text  # listed in full
    assert "finding(s) (mtp-quant-config" in text and "other verbs refuse this checkpoint" in text
    assert "block None" not in text


def test_inspect_names_the_quantized_storage(build):
    src = build("deepseek_v3", scheme="ct-nvfp4")
    rep = json.loads(run_ckpt("inspect", src, "--json").stdout)
    mods = {m["module"]: m for m in rep["mtp_quant"]["modules"]}
    eh = mods[DS + "eh_proj"]
    assert eh["stored"]["state"] == "quantized" and eh["stored"]["label"].startswith("NVFP4") and eh["ok"]
    assert mods[DS + "mlp.experts.0.up_proj"]["expert"]
    src = build("qwen3_5_moe", scheme="modelopt-nvfp4", mtp="bf16", mtp_exclude="pattern")
    rep = json.loads(run_ckpt("inspect", src, "--json").stdout)
    assert rep["quantization"]["scheme"] == "modelopt-nvfp4"
    assert {m["stored"]["label"] for m in rep["mtp_quant"]["modules"]} == {"BF16"}
    assert all(m["declared"]["state"] == "excluded" for m in rep["mtp_quant"]["modules"])


def test_a_pattern_list_matches_as_its_patterns_do_one_by_one():
    """match_any combines a list into one regex: the same verdict as match_one over each pattern, for plain
    names, regexes, suffixes, patterns that do not compile, backreferences, inline flags and unbalanced ones."""
    import random

    from ckpt_tools.model.quant.match import match_any, match_one

    pool = ["model.layers.61.self_attn.o_proj", "lm_head", "re:.*mlp\\.gate$", "model\\.embed", "(a)\\1", "(?i)head",
            "x[", "a)|(b", "re:model\\.layers\\.6[0-9]\\..*", "re:(?P<n>x)", "mlp.experts", "re:[", "layers.61"]
    names = ["model.layers.61.self_attn.o_proj", "model.layers.61.self_attn.o_proj_x", "lm_head",
             "model.layers.3.mlp.gate", "model.embed_tokens", "aa", "HEAD", "foo.lm_head", "x[", "a", "b", "x",
             "model.layers.62.mlp.experts.0.up_proj", "model.layers.61.mlp.experts"]
    rng = random.Random(0)
    for _ in range(300):
        patterns = rng.sample(pool, rng.randint(4, len(pool)))
        for matcher in ("transformers", "compressed-tensors", "quark"):
            for n in names:
                assert match_any(matcher, n, patterns) == any(match_one(matcher, n, p) for p in patterns), \
                    (matcher, n, patterns)
