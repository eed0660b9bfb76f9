"""Shared fixtures: tiny checkpoints built once per test session."""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ckpt_tools.testing import FixtureOptions, make_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
if "CKPT_CACHE_DIR" not in os.environ:  # never the user's cache, and not left behind in /tmp either
    os.environ["CKPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="ckpt-cache-")
    atexit.register(shutil.rmtree, os.environ["CKPT_CACHE_DIR"], ignore_errors=True)


def pytest_configure(config):
    # CI runs two pytest workers on two cores: one torch thread each avoids oversubscription
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent (and not called) without it
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` without ``--dist``: work stealing, not xdist's default ``load``.

    ``load`` deals the first quarter of the tests out one at a time, round robin, so most modules there run
    on both workers and build their module fixtures twice (a speculators venv subprocess, a trained model's
    load: 15-20 s each). Work stealing gives each worker one contiguous half of the collection and moves
    tests only when a worker runs dry: a module is split at most where a steal cuts it.
    """
    if config.getoption("dist") == "load" and not _dist_given(config):
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None


def _dist_given(config) -> bool:
    """Whether ``--dist`` was asked for (``-n`` alone sets it to ``load``): then xdist's scheduler is kept."""
    import shlex

    args = [*config.invocation_params.args, *config.getini("addopts"),
            *shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))]
    return any(a == "--dist" or a.startswith("--dist=") for a in args)


@pytest.fixture(autouse=True)
def _kernel_copy_as_in_a_fresh_process():
    """Each test starts with copy_file_range allowed, as a new process does. copy_segment stops asking for it in
    a process once the kernel refused it (a module global): a test that met a refusal would otherwise change
    how every later test in its worker copies (test_integrity_output's early-ending copy then saw none)."""
    from ckpt_tools.io import safetensors_io

    safetensors_io._CFR_OK = hasattr(os, "copy_file_range")


@pytest.fixture(scope="session")
def make_fixture(tmp_path_factory):
    """``make_fixture(family, **FixtureOptions)`` -> path of a cached, read-only fixture checkpoint."""
    cache: dict[tuple, Path] = {}

    def build(family: str, **kw) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"fx-{family}")
            cache[key] = make_checkpoint(family, d, FixtureOptions(**kw))
        return cache[key]

    return build


def run_ckpt(*args, code: int | None = 0):
    """Run the CLI in-process: never a traceback, and (unless ``code`` is None) exactly that exit code."""
    from typer.testing import CliRunner

    from ckpt_tools.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    out = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "Traceback" not in out, out
    if code is not None:
        assert result.exit_code == code, f"exit {result.exit_code}: {out}"
    return result


def tree_hash(path: Path) -> str:
    """A hash of every file's name and bytes under ``path`` (to prove inputs stay untouched)."""
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()
