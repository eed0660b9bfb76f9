"""What each verb prints, rendered as a terminal of 80 and of 120 columns: no line wider than the terminal,
no identifier (tensor key, shard, family, architecture, template) split across lines or cut, unchanged /
added / removed tensors counted per block, and the progress bar naming its phase with a real total."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.cells import cell_len
from test_stitch import _perturb
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.cli.summary import MAX_ROWS
from ckpt_tools.cli.validate_cmd import MAX_PER_RULE
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.ops.inspect.tables import tables_info

from conftest import run_ckpt as ckpt

WIDTHS = [80, 120]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SEPARATORS = re.compile(r"[\s│┃┏┓┗┛━─┡┩╇┳┻╋┼┬┴└┘┌┐,;:()\[\]'\"]+")


def terminal(*args, width: int, code: int = 0) -> tuple[str, str]:
    """stdout and stderr of a run on a terminal ``width`` columns wide (rich's TTY_COMPATIBLE), escapes removed."""
    r = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(width), "TTY_COMPATIBLE": "1"})
    out, err = ANSI.sub("", r.stdout), ANSI.sub("", r.stderr)
    assert r.exit_code == code, f"exit {r.exit_code}: {out}{err}"
    assert "Traceback" not in out + err
    return out, err


def assert_reads_well(text: str, width: int, identifiers: set[str]) -> None:
    """Every line fits; every piece of an identifier left once the whole ones are taken out is a flaw (a key
    split over two lines, a shard cut with an ellipsis) - except a block prefix ending in '.' (a summary's)."""
    by_length = sorted(identifiers, key=len, reverse=True)
    for line in text.splitlines():
        assert cell_len(line) <= width, f"wider than {width}: {line!r}"
        for ident in by_length:
            line = line.replace(ident, " ")
        for tok in SEPARATORS.split(line):
            cut = tok.endswith("…")  # an ellipsis: whatever precedes it is a piece, whatever it ends with
            tok = tok.rstrip("…")
            if len(tok) < 3 or not re.search(r"[A-Za-z]", tok) or not re.search(r"[._-]", tok):
                continue
            pieces = [i for i in identifiers if tok in i and (cut or not (i.startswith(tok) and tok.endswith(".")))]
            assert not pieces, f"{tok!r} is a piece of {pieces[0]!r} in:\n{text}"


def shown_whole(ident: str, text: str) -> bool:
    """``ident`` on one line, as a cell or a word of its own."""
    return re.search(rf"(^|[\s│┃]){re.escape(ident)}($|[\s│┃])", text, re.MULTILINE) is not None


def names_of(path: Path) -> set[str]:
    with Checkpoint.open(path) as ck:
        return set(ck.tensors) | {p.name for p in Path(path).iterdir()}


@pytest.fixture(scope="module")
def family_ids() -> set[str]:
    ids = set()
    for r in tables_info():
        ids |= {r["family"], r["mtp_prefix"], *r["architectures"], *r["model_types"], *r["formats"]}
        if r.get("llama_cpp"):  # llama.cpp's architecture names (nemotron_h_moe holds the family nemotron_h)
            ids.add(r["llama_cpp"]["arch"])
    return ids


@pytest.mark.parametrize("width", WIDTHS)
def test_tables(width, family_ids):
    out, _ = terminal("tables", width=width)
    assert_reads_well(out, width, family_ids)
    families = [r["family"] for r in tables_info()]
    assert all(shown_whole(f, out) for f in families)
    assert "ckpt tables FAMILY" in out
    one, _ = terminal("tables", "deepseek_v3", width=width)
    assert_reads_well(one, width, family_ids)
    row = next(r for r in tables_info() if r["family"] == "deepseek_v3")
    assert row["mtp_prefix"] in one and all(f in one for f in row["formats"])  # the template, whole


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect(width, make_fixture):
    src = make_fixture("deepseek_v3")
    out, _ = terminal("inspect", src, width=width)
    report = json.loads(ckpt("inspect", src, "--json").stdout)
    assert_reads_well(out, width, names_of(src) | {g["prefix"] for g in report["experts"]})
    shards = [s["name"] for s in report["shards"]]
    assert shards and report["experts"] and all(shown_whole(s, out) for s in shards + [report["experts"][0]["prefix"]])


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect_deep_quantized_model(width, make_fixture):
    """DeepSeek-V3's real depth (61 decoder layers: MTP at model.layers.61) in block FP8: the per-module
    quantization table holds the longest keys inspect prints (``model.layers.61.shared_head.head``), which a
    3-layer unquantized fixture never shows; at 80 columns they used to be folded mid-name."""
    src = make_fixture("deepseek_v3", fp8=True, config_overrides={"num_hidden_layers": 61})
    out, _ = terminal("inspect", src, width=width)
    report = json.loads(ckpt("inspect", src, "--json").stdout)
    modules = [m["module"] for m in report["mtp_quant"]["modules"]]
    assert "model.layers.61.shared_head.head" in modules
    patterns = {re.sub(r"\.experts\.\d+\.", ".experts.*.", m) for m in modules}
    ids = names_of(src) | set(modules) | patterns | {g["prefix"] for g in report["experts"]}
    assert_reads_well(out, width, ids | {report["fp8"]["scale_suffix"]})
    assert all(shown_whole(m, out) for m in modules if ".experts." not in m)
    assert all(shown_whole(p, out) for p in patterns)
    for size in (report["totals"]["checkpoint"]["bytes"], report["totals"]["mtp"]["bytes"]):
        assert f"{size:,}" in out  # each byte count on one line


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect_release_sized_numbers(width, make_fixture, monkeypatch, capsys):
    """Byte counts as large as a real release's (DeepSeek-V3: 688 GB in 163 shards) never wrap."""
    from ckpt_tools.cli.inspect_cmd import render
    from ckpt_tools.ops.inspect.inspect import inspect_checkpoint

    report = inspect_checkpoint(make_fixture("deepseek_v3", fp8=True, config_overrides={"num_hidden_layers": 61}))
    scale = 10**6 + 7  # every count a release's size, none of them round
    report.totals = {name: {k: v * scale for k, v in t.items()} for name, t in report.totals.items()}
    for part in (report.roles, *report.dtypes.values()):
        for r in part.values():
            r.update(tensors=r["tensors"] * scale, params=r["params"] * scale, bytes=r["bytes"] * scale)
    for s in report.shards:
        s.update(mtp_bytes=s["mtp_bytes"] * scale, bytes=s["bytes"] * scale, tensors=s["tensors"] * scale)
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    render(report)
    out = ANSI.sub("", capsys.readouterr().out)
    numbers = [report.totals["checkpoint"]["bytes"], report.totals["mtp"]["params"]]
    numbers += [r["bytes"] for r in report.roles.values()] + [s["bytes"] for s in report.shards]
    numbers += [r["bytes"] for r in report.dtypes["checkpoint"].values()]
    ids = {report.fp8["scale_suffix"], *(t["key"] for t in report.tensors), *(g["prefix"] for g in report.experts)}
    assert_reads_well(out, width, ids | {m["module"] for m in report.mtp_quant["modules"]})
    for n in numbers:
        assert f"{n:,}" in out, f"{n:,} split or missing:\n{out}"
    whole = report.totals["checkpoint"]["bytes"]
    assert re.search(rf"{whole:,} \([\d.]+ [kMGT]?B\)", out), out  # with its human size, on the same line


@pytest.mark.parametrize("width", WIDTHS)
def test_validate_problems(width, make_fixture, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(make_fixture("deepseek_v3"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2  # a second MTP layer nobody shipped: every key of it is missing
    (bad / "config.json").write_text(json.dumps(config))
    out, _ = terminal("validate", bad, width=width, code=1)
    missing = [p["key"] for p in json.loads(ckpt("validate", bad, "--json", code=1).stdout)["problems"]
               if p["rule"] == "mtp-missing"]
    assert missing and all(shown_whole(k, out) for k in missing[:MAX_PER_RULE])
    assert_reads_well(out, width, names_of(bad) | set(missing))


@pytest.mark.parametrize("width", WIDTHS)
def test_diff(width, make_fixture, tmp_path):
    a, b = make_fixture("deepseek_v3"), make_fixture("deepseek_v3", seed=1)
    out, _ = terminal("diff", a, b, "--stats", width=width, code=1)
    assert_reads_well(out, width, names_of(a))
    changed = [t["key"] for t in json.loads(ckpt("diff", a, b, "--json", code=1).stdout)["tensors"]]
    assert all(shown_whole(k, out) for k in changed[:MAX_ROWS]) and f"... and {len(changed) - MAX_ROWS} more" in out

    trunk = tmp_path / "trunk"
    ckpt("extract", a, "-o", trunk, "--drop-mtp")
    out, _ = terminal("diff", a, trunk, width=width, code=1)
    assert_reads_well(out, width, names_of(a))
    removed = [t["key"] for t in json.loads(ckpt("diff", a, trunk, "--json", code=1).stdout)["tensors"]]
    prefix = _block(removed)
    assert f"removed {len(removed)} tensors under {prefix}" in out
    assert not any(k in out for k in removed)  # counted, not listed
    full, _ = terminal("diff", a, trunk, "--all", width=width, code=1)
    assert all(k in full for k in removed)


def _block(keys: list[str]) -> str:
    """The numbered block every key lies in ("model.layers.3.")."""
    blocks = {re.match(r"(.*?\.\d+\.)", k).group(1) for k in keys}
    assert len(blocks) == 1, blocks
    return blocks.pop()


@pytest.mark.parametrize("width", WIDTHS)
def test_stitch_summary_and_progress(width, make_fixture, tmp_path):
    verifier = make_fixture("deepseek_v3")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    _perturb(draft, ["model.layers.3.hnorm.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"],
             np.random.default_rng(7))
    out, err = terminal("stitch", draft, verifier, "-o", tmp_path / "out", width=width)
    report = json.loads((tmp_path / "out" / "stitch-report.json").read_text())
    ids = names_of(verifier)
    assert_reads_well(out, width, ids)
    for t in report["tensors"]:
        if t["status"] == "replaced":
            assert shown_whole(t["key"], out)
    unchanged = [t["key"] for t in report["tensors"] if t["status"] == "unchanged"]
    assert f"unchanged {len(unchanged)} tensors under {_block(unchanged)}" in out

    # the bar: the phase by name, bytes done of a total that is not 0, the last frame complete
    frames = [f.strip() for f in re.split(r"[\r\n]", err) if f.strip()]
    assert all(cell_len(f) <= width for f in frames)
    assert {"reading headers", "planning", "writing", "hashing", "validating"} <= {f.split(" ━")[0] for f in frames}
    writing = [re.search(r"([\d.]+)/([\d.]+) ([kMG]?B)", f) for f in frames if f.startswith("writing")]
    totals = {m.group(2) for m in writing if m}
    assert len(totals) == 1 and float(totals.pop()) > 0
    assert writing[-1] and writing[-1].group(1) == writing[-1].group(2)

    trunk, added = tmp_path / "trunk", tmp_path / "added"
    ckpt("extract", verifier, "-o", trunk, "--drop-mtp")
    out, _ = terminal("stitch", draft, trunk, "-o", added, width=width)
    assert_reads_well(out, width, ids)
    keys = [t["key"] for t in json.loads((added / "stitch-report.json").read_text())["tensors"]]
    assert f"added {len(keys)} tensors under {_block(keys)}" in out and not any(k in out for k in keys)


def test_no_bar_with_json_or_without_a_terminal(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    r = CliRunner().invoke(app, ["extract", str(src), "-o", str(tmp_path / "a"), "--json"],
                           env={"TTY_COMPATIBLE": "1"})
    assert r.exit_code == 0 and "writing" not in r.stderr and json.loads(r.stdout)
    r = CliRunner().invoke(app, ["extract", str(src), "-o", str(tmp_path / "b")], env={"TTY_COMPATIBLE": None})
    assert r.exit_code == 0 and r.stderr == ""


@pytest.mark.parametrize("width", WIDTHS)
def test_init_draft_plan(width, make_fixture):
    src = make_fixture("deepseek_v3")
    out, _ = terminal("init-draft", src, "-o", "unused", "--dry-run", width=width)
    plan = json.loads(ckpt("init-draft", src, "-o", "unused", "--dry-run", "--json").stdout)
    keys = [t["key"] for t in plan["tensors"]]
    assert all(shown_whole(k, out) for k in keys)
    assert_reads_well(out, width, set(keys) | set(plan["shards"]) | names_of(src))


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from hubserver import serve_hub

    yield from serve_hub(monkeypatch, tmp_path)


@pytest.mark.parametrize("width", WIDTHS)
def test_push_dry_run(width, hub, make_fixture):
    src = make_fixture("deepseek_v3")
    hub.state.add_repo("org/verifier", src)
    out, _ = terminal("push", src, "me/a-rather-long-repository-name", "--base", "org/verifier", "--dry-run",
                      width=width)
    names = {p.name for p in src.iterdir()}
    assert all(shown_whole(n, out) for n in names)
    assert_reads_well(out, width, names | {f"org/verifier@main:{n}" for n in names})
