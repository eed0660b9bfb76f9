"""The writing verbs' public functions (``ckpt_tools.api.writing``) and the CLI over them.

For every verb: the CLI calls the public function through ``ckpt_tools.api`` with the options it
parsed (the function patched by a recorder), the CLI's ``--json`` equals ``report.to_json()`` of a
direct call on the same inputs (written and dry run), and each failing exit code is the exception
class the function raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ckpt_tools
from ckpt_tools import api
from ckpt_tools.api.report import Report
from ckpt_tools.errors import InputError, OutputError, UsageError

from conftest import run_ckpt

EXCEPTION_OF_EXIT = {2: UsageError, 3: InputError, 4: OutputError}


@pytest.fixture(scope="module")
def inputs(make_fixture, tmp_path_factory) -> dict[str, Path]:
    """A release with MTP (per-expert experts), its trunk without MTP and its native draft."""
    fx = make_fixture("deepseek_v3", expert_layout="per-expert")
    d = tmp_path_factory.mktemp("api-inputs")
    api.extract(fx, d / "trunk", drop_mtp=True)
    api.extract(fx, d / "draft")
    return {"fx": fx, "trunk": d / "trunk", "draft": d / "draft"}


def cases(i: dict[str, Path]) -> dict[str, tuple[list[str], tuple[Path, ...], list[str], dict[str, Any]]]:
    """verb -> (CLI verb and arguments, the function's positional inputs, options on the command line, the
    keywords they must arrive as). Options chosen so each verb writes an output."""
    return {
        "extract": (["extract", i["fx"]], (i["fx"],), ["--layers", "0", "--dtype", "fp32", "--with-embed"],
                    {"layers": [0], "dtype": "fp32", "with_embed": True}),
        "stitch": (["stitch", i["draft"], i["fx"]], (i["draft"], i["fx"]), ["--mode", "replace", "--dtype", "draft"],
                   {"mode": "replace", "dtype": "draft"}),
        "graft": (["graft", i["fx"], i["trunk"]], (i["fx"], i["trunk"]), ["--mtp-dtype", "fp32"],
                  {"mtp_dtype": "fp32"}),
        "fuse_experts": (["fuse-experts", i["fx"]], (i["fx"],), ["--to", "stacked", "--only-mtp"],
                         {"to": "stacked", "only_mtp": True}),
        "unfuse_experts": (["unfuse-experts", i["fx"]], (i["fx"],), ["--to", "stacked-transposed"],
                           {"to": "stacked-transposed"}),
        "init_draft": (["init-draft", i["fx"]], (i["fx"],), ["--seed", "7", "--std", "0.01", "--num-layers", "2"],
                       {"seed": 7, "std": 0.01, "num_layers": 2}),
    }


VERBS = ["extract", "stitch", "graft", "fuse_experts", "unfuse_experts", "init_draft"]


@dataclass
class _Recorded(Report):
    verb: str

    def to_json(self) -> dict[str, Any]:
        return {"recorded": self.verb}


@pytest.mark.parametrize("verb", VERBS)
def test_the_cli_calls_the_public_function(verb, inputs, tmp_path, monkeypatch):
    calls: list[tuple[tuple, dict]] = []

    def recorder(*args: Any, **kwargs: Any) -> _Recorded:
        calls.append((args, kwargs))
        return _Recorded(verb)

    monkeypatch.setattr(ckpt_tools.api, verb, recorder)
    cli, positional, options, expected = cases(inputs)[verb]
    out = tmp_path / "o"
    r = run_ckpt(*cli, "-o", out, *options, "--max-shard-size", "1MB", "--allow-invalid", "index-empty", "--json")
    assert json.loads(r.stdout) == {"recorded": verb}  # the CLI prints what the function returned
    assert not out.exists()  # nothing but the function ran
    [(args, kwargs)] = calls
    assert [str(a) for a in args] == [str(p) for p in (*positional, out)]
    assert {k: kwargs[k] for k in expected} == expected
    assert kwargs["max_shard_size"] == "1MB" and list(kwargs["allow_invalid"]) == ["index-empty"]
    assert kwargs["progress"] is False and kwargs["dry_run"] is False


def _normal(obj: Any, out: Path) -> Any:
    """A report with its output directory named OUT, and without what differs from run to run (time) or
    from caller to caller (the command line the plan records: the CLI's argv, or the Python call)."""
    if isinstance(obj, dict):
        return {k: _normal(v, out) for k, v in obj.items() if k not in ("seconds", "command")}
    if isinstance(obj, list):
        return [_normal(v, out) for v in obj]
    return "OUT" if obj == str(out) else obj


@pytest.mark.parametrize("dry_run", [False, True], ids=["write", "dry-run"])
@pytest.mark.parametrize("verb", VERBS)
def test_json_is_the_reports_to_json(verb, dry_run, inputs, tmp_path):
    cli, positional, options, expected = cases(inputs)[verb]
    dry = ["--dry-run"] if dry_run else []
    by_cli = json.loads(run_ckpt(*cli, "-o", tmp_path / "cli", *options, *dry, "--json").stdout)
    report = getattr(ckpt_tools, verb)(*positional, tmp_path / "api", **expected, dry_run=dry_run)
    assert isinstance(report, Report)
    assert _normal(report.to_json(), tmp_path / "api") == _normal(by_cli, tmp_path / "cli")
    assert (tmp_path / "api").exists() is not dry_run
    if not dry_run:  # a library call records itself as the call that reproduces the output
        manifest = json.loads((tmp_path / "api" / "ckpt_manifest.json").read_text())
        assert manifest["command"].startswith(f"ckpt_tools.{verb}({str(positional[0])!r}")
        cli_manifest = json.loads((tmp_path / "cli" / "ckpt_manifest.json").read_text())
        assert cli_manifest["command"].startswith("ckpt ")


def failures(i: dict[str, Path], tmp: Path) -> list[tuple[str, list[Any], Any]]:
    """(name, CLI arguments, the same call as a function) for refusals of every exit code."""
    full = tmp / "full"
    full.mkdir()
    (full / "x").write_text("not ours")
    return [
        ("extract-layers", ["extract", i["fx"], "-o", tmp / "o", "--layers", "99"],
         lambda: api.extract(i["fx"], tmp / "o", layers=[99])),
        ("extract-missing", ["extract", tmp / "nope", "-o", tmp / "o"],
         lambda: api.extract(tmp / "nope", tmp / "o")),
        ("extract-nonempty-out", ["extract", i["fx"], "-o", full],
         lambda: api.extract(i["fx"], full)),
        ("stitch-format", ["stitch", i["draft"], i["fx"], "-o", tmp / "o", "--format", "bogus"],
         lambda: api.stitch(i["draft"], i["fx"], tmp / "o", format="bogus")),
        ("stitch-mismatch", ["stitch", i["trunk"], i["fx"], "-o", tmp / "o"],
         lambda: api.stitch(i["trunk"], i["fx"], tmp / "o")),
        ("stitch-nonempty-out", ["stitch", i["draft"], i["fx"], "-o", full],
         lambda: api.stitch(i["draft"], i["fx"], full)),
        ("graft-dtype", ["graft", i["fx"], i["trunk"], "-o", tmp / "o", "--mtp-dtype", "int3"],
         lambda: api.graft(i["fx"], i["trunk"], tmp / "o", mtp_dtype="int3")),
        ("graft-nonempty-out", ["graft", i["fx"], i["trunk"], "-o", full],
         lambda: api.graft(i["fx"], i["trunk"], full)),
        ("fuse-wrong-direction", ["fuse-experts", i["fx"], "-o", tmp / "o", "--to", "per-expert"],
         lambda: api.fuse_experts(i["fx"], tmp / "o", to="per-expert")),
        ("fuse-no-out", ["fuse-experts", i["fx"]], lambda: api.fuse_experts(i["fx"], None)),
        ("unfuse-wrong-direction", ["unfuse-experts", i["fx"], "-o", tmp / "o", "--to", "fused"],
         lambda: api.unfuse_experts(i["fx"], tmp / "o", to="fused")),
        ("unfuse-nonempty-out", ["unfuse-experts", i["fx"], "-o", full],
         lambda: api.unfuse_experts(i["fx"], full)),
        ("init-std", ["init-draft", i["fx"], "-o", tmp / "o", "--std", "0"],
         lambda: api.init_draft(i["fx"], tmp / "o", std=0.0)),
        ("init-missing", ["init-draft", tmp / "nope", "-o", tmp / "o"],
         lambda: api.init_draft(tmp / "nope", tmp / "o")),
        ("init-allow-unknown-rule", ["init-draft", i["fx"], "-o", tmp / "o", "--allow-invalid", "no-such-rule"],
         lambda: api.init_draft(i["fx"], tmp / "o", allow_invalid=["no-such-rule"])),
    ]


def test_each_exit_code_is_an_exception_class(inputs, tmp_path):
    seen = set()
    for name, args, call in failures(inputs, tmp_path):
        code = run_ckpt(*args, code=None).exit_code
        assert code in EXCEPTION_OF_EXIT, (name, code)
        with pytest.raises(EXCEPTION_OF_EXIT[code]) as e:
            call()
        assert e.value.exit_code == code, name
        assert not (tmp_path / "o").exists(), name  # a refusal writes nothing
        seen.add(code)
    assert seen == set(EXCEPTION_OF_EXIT)
