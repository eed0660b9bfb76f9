"""``ckpt_tools.push`` (api/publish.py) and ``ckpt push`` over it, against the local Hub (tests/hubserver.py).

The CLI calls the public function with the options it parsed; its ``--json`` equals ``report.to_json()``
of a direct call (dry run and a real push); each refusal's exit code is the exception class the function
raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_push import draft_dir

import ckpt_tools
from ckpt_tools.api.report import Report
from ckpt_tools.errors import InputError, OutputError, UsageError

from conftest import run_ckpt
from hubserver import READ_TOKEN, serve_hub


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


@pytest.fixture
def folder(make_fixture, tmp_path) -> Path:
    return draft_dir(make_fixture("deepseek_v3", fp8=True), tmp_path)


@dataclass
class _Recorded(Report):
    def to_json(self) -> dict[str, Any]:
        return {"recorded": "push"}


def test_the_cli_calls_the_public_function(monkeypatch, tmp_path):
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(ckpt_tools.api, "push", lambda *a, **k: calls.append((a, k)) or _Recorded())
    r = run_ckpt("push", tmp_path, "org/name", "--revision", "dev", "--private", "--create-pr", "-m", "msg",
                 "--base", "org/base@v1", "--dry-run", "--force", "--card", "overwrite",
                 "--allow-invalid", "index-empty", "--json")
    assert json.loads(r.stdout) == {"recorded": "push"}
    [(args, kwargs)] = calls
    assert [str(a) for a in args] == [str(tmp_path), "org/name"]
    assert kwargs == {"revision": "dev", "private": True, "create_pr": True, "message": "msg", "base": "org/base@v1",
                      "dry_run": True, "force": True, "card": "overwrite", "allow_invalid": ["index-empty"],
                      "progress": False, "probe_report": None, "probe_plot": None}


def _without_commit(out: dict[str, Any], repo: str) -> dict[str, Any]:
    """A push's JSON with its repository named REPO and without the commit's id and URL (unique per commit)."""
    text = json.dumps(out).replace(repo, "REPO")
    data: dict[str, Any] = json.loads(text)
    if data["result"] is not None:
        data["result"] = {k: v for k, v in data["result"].items() if k not in ("commit", "commit_url")}
    return data


def test_json_is_the_reports_to_json(hub, folder):
    by_cli = json.loads(run_ckpt("push", folder, "me/cli", "--dry-run", "--json").stdout)
    report = ckpt_tools.push(folder, "me/cli", dry_run=True)
    assert report.dry_run and report.result is None
    assert report.to_json() == by_cli
    assert "me/cli" not in hub.state.repos  # a dry run creates nothing

    by_cli = json.loads(run_ckpt("push", folder, "me/cli", "--json").stdout)
    report = ckpt_tools.push(folder, "me/api")
    assert report.result is not None and report.result.method == "upload_folder"
    assert _without_commit(report.to_json(), "me/api") == _without_commit(by_cli, "me/cli")
    # the same files published (the card names its repository)
    def published(repo: str) -> dict[str, bytes]:
        name = repo.partition("/")[2].encode()
        return {k: v.replace(repo.encode(), b"REPO").replace(b"# " + name, b"# NAME")
                for k, v in hub.state.files(repo).items()}

    assert published("me/api") == published("me/cli")
    # the commit names its caller: the CLI's command line, or the Python call
    described = {c["repo"]: str(line["value"].get("description")) for c in hub.state.stats.commits
                 for line in c["lines"] if line.get("key") == "header"}
    assert described["me/cli"].startswith("Pushed with `ckpt ")  # the CLI's argv (pytest's, in this test)
    assert described["me/api"].startswith(f"Pushed with `ckpt_tools.push({str(folder)!r}, 'me/api')")


def test_each_exit_code_is_an_exception_class(hub, folder, tmp_path, monkeypatch):
    cases: list[tuple[list[Any], Any, type[Exception]]] = [
        (["bad..name"], lambda: ckpt_tools.push(folder, "bad..name"), UsageError),
        (["me/x@dev"], lambda: ckpt_tools.push(folder, "me/x@dev"), UsageError),
        (["me/x", "--card", "drop"], lambda: ckpt_tools.push(folder, "me/x", card="drop"), UsageError),
        (["me/x", "--allow-invalid", "no-such-rule"],
         lambda: ckpt_tools.push(folder, "me/x", allow_invalid=["no-such-rule"]), UsageError),
        (["me/x", "--base", "org/missing"], lambda: ckpt_tools.push(folder, "me/x", base="org/missing"), InputError),
    ]
    for args, call, cls in cases:
        code = run_ckpt("push", folder, *args, code=None).exit_code
        with pytest.raises(cls) as e:
            call()
        assert e.value.exit_code == code, args
    missing = tmp_path / "nope"
    assert run_ckpt("push", missing, "me/x", code=None).exit_code == InputError.exit_code
    with pytest.raises(InputError):
        ckpt_tools.push(missing, "me/x")
    monkeypatch.setenv("HF_TOKEN", READ_TOKEN)  # the Hub refuses the write: an output error
    assert run_ckpt("push", folder, "me/x", code=None).exit_code == OutputError.exit_code
    with pytest.raises(OutputError):
        ckpt_tools.push(folder, "me/x")
    assert "me/x" not in hub.state.repos
