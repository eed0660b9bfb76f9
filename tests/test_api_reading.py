"""The reading verbs as functions (ckpt_tools.api.reading): the CLI calls them, prints their reports,
and maps their exceptions to its exit codes."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import pytest

import ckpt_tools
from ckpt_tools import CheckFailed, InputError, UsageError, api
from ckpt_tools.api.reading import DiffReport, DiscoverReport, FixQuantConfigReport, InspectReport, ValidateReport
from ckpt_tools.api.report import Report
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

from conftest import run_ckpt


@dataclass
class Stub(Report):
    """What a patched verb returns: a report the CLI can only have printed by calling it."""

    marker: str = "stub"
    allowed_invalid: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"marker": self.marker}


CALLS = {
    "inspect": (["inspect", "P", "--arch", "deepseek_v3", "--allow-invalid", "total-size", "--json"],
                ("P",), dict(arch="deepseek_v3", discover=False, write=None, allow_invalid=["total-size"],
                             progress=False)),
    "inspect-write": (["inspect", "P", "--write", "t.yaml", "--json"],
                      ("P",), dict(arch=None, discover=True, write="t.yaml", allow_invalid=[], progress=False)),
    "validate": (["validate", "P", "--fix-quant-config", "-o", "O", "--link", "hardlink", "--dry-run", "--overwrite",
                  "--json"],
                 ("P",), dict(arch=None, fix_quant_config=True, out="O", link="hardlink", dry_run=True,
                              overwrite=True, progress=False, engine=None)),
    "diff": (["diff", "A", "B", "--keys", "mtp", "--stats", "--all", "--allow-invalid", "total-size", "--json"],
             ("A", "B"), dict(keys="mtp", stats=True, dequant=False, all=True, allow_invalid=["total-size"],
                              progress=False)),
}


@pytest.mark.parametrize("case", sorted(CALLS))
def test_the_cli_calls_the_public_function_with_its_options(case, monkeypatch):
    argv, args, kwargs = CALLS[case]
    seen = []
    monkeypatch.setattr(api, argv[0], lambda *a, **k: seen.append((a, k)) or Stub(case))
    result = run_ckpt(*argv)
    assert seen == [(args, kwargs)]
    assert json.loads(result.stdout) == {"marker": case}


@pytest.mark.parametrize("verb", ["validate", "diff"])
def test_check_failed_is_exit_1_with_the_report_printed(verb, monkeypatch):
    def fails(*a, **k):
        raise CheckFailed("found something", report=Stub(verb))

    monkeypatch.setattr(api, verb, fails)
    argv = [verb, "A", *(["B"] if verb == "diff" else []), "--json"]
    assert json.loads(run_ckpt(*argv, code=1).stdout) == {"marker": verb}


def test_the_top_level_names_are_the_api_functions():
    assert (ckpt_tools.inspect, ckpt_tools.validate, ckpt_tools.diff) == (api.inspect, api.validate, api.diff)


# -- real runs: the CLI's --json is the report's to_json() ------------------------------------------------------


def _json(*argv, code=0) -> dict:
    return json.loads(run_ckpt(*argv, "--json", code=code).stdout)


def test_inspect_and_discover(make_fixture):
    src = make_fixture("deepseek_v3")
    report = api.inspect(src)
    assert isinstance(report, InspectReport) and report.family == "deepseek_v3" and report.complete
    assert report.to_json() == _json("inspect", src)
    found = api.inspect(src, discover=True)
    assert isinstance(found, DiscoverReport) and found.yaml.startswith("# Draft table")
    assert found.to_json() == _json("inspect", src, "--discover")


def test_validate_valid_and_invalid(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    report = api.validate(src)
    assert isinstance(report, ValidateReport) and report.ok
    assert report.to_json() == _json("validate", src)

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckFailed) as e:
        api.validate(broken)
    assert e.value.exit_code == 1 and isinstance(e.value.report, ValidateReport)
    assert "missing-shard" in e.value.report.rules() and "missing-shard" in str(e.value)
    assert e.value.report.to_json() == _json("validate", broken, code=1)


def test_diff_identical_and_different(make_fixture):
    a, b = make_fixture("deepseek_v3"), make_fixture("deepseek_v3", seed=1)
    same = api.diff(a, a, all=True)
    assert isinstance(same, DiffReport) and same.identical and same.to_json()["tensors"]
    assert same.to_json() == _json("diff", a, a, "--all")
    with pytest.raises(CheckFailed) as e:
        api.diff(a, b, stats=True)
    report = e.value.report
    assert isinstance(report, DiffReport) and not report.identical and report.totals()["replaced"]
    assert report.to_json() == _json("diff", a, b, "--stats", code=1)
    assert all(t["status"] != "unchanged" for t in report.to_json()["tensors"])


def test_fix_quant_config_dry_run_and_write(tmp_path):
    src = make_quantized_checkpoint("qwen3_5_moe", tmp_path / "in", QuantOptions(scheme="modelopt-nvfp4", mtp="bf16",
                                                                                 mtp_exclude="blocks"))
    with pytest.raises(CheckFailed):  # the mis-declared config is a problem
        api.validate(src)
    dry = api.validate(src, fix_quant_config=True, dry_run=True)
    assert isinstance(dry, FixQuantConfigReport) and (dry.status, dry.written) == ("fixed", False)
    assert dry.to_json() == _json("validate", "--fix-quant-config", src, "--dry-run")
    out = tmp_path / "out"
    written = api.validate(src, fix_quant_config=True, out=out)
    assert written.written and written.validation["ok"] and api.validate(out).ok
    manifest = json.loads((out / "ckpt_manifest.json").read_text())
    assert manifest["command"] == f"ckpt validate --fix-quant-config {src} -o {out}"  # the call, not pytest's argv


# -- errors: one exception class per exit code ---------------------------------------------------------------------

USAGE = {
    "unknown family": (lambda src: api.validate(src, arch="no_such_family"), ["validate", "{src}", "--arch", "nope"]),
    "-o without the fix": (lambda src: api.validate(src, out="x"), ["validate", "{src}", "-o", "x"]),
    "bad --keys": (lambda src: api.diff(src, src, keys="("), ["diff", "{src}", "{src}", "--keys", "("]),
    "unknown rule": (lambda src: api.inspect(src, allow_invalid=["nope"]), ["inspect", "{src}", "--allow-invalid",
                                                                            "nope"]),
    "--write alone": (lambda src: api.inspect(src, write="t.yaml"), None),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_usage_errors(case, make_fixture):
    src = make_fixture("deepseek_v3")
    call, argv = USAGE[case]
    with pytest.raises(UsageError) as e:
        call(src)
    assert e.value.exit_code == 2
    if argv is not None:
        run_ckpt(*[a.format(src=src) for a in argv], code=2)


def test_not_a_checkpoint_is_an_input_error(tmp_path):
    (tmp_path / "empty").mkdir()
    for call in (api.inspect, api.validate, lambda p: api.diff(p, p)):
        with pytest.raises(InputError) as e:
            call(tmp_path / "empty")
        assert e.value.exit_code == 3
    run_ckpt("validate", tmp_path / "empty", code=3)
