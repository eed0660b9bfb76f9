"""The wheel: it builds without a setuptools warning, holds every module and table, and works installed.

CI's packaging step. The wheel is built from a copy of the project with the test environment's setuptools
(no build isolation: nothing to download) and installed, without dependencies, into a throwaway venv whose
dependencies come from the test environment (a .pth line), so the check takes seconds, not a full install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a build reads: the package, its tables, the metadata files pyproject.toml names.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "ckpt_tools", "mappings")
# A setuptools (or any) warning in the build output: SetuptoolsDeprecationWarning, BuildBackendWarning, ...
WARNING = re.compile(r"\w+Warning\b|[Dd]eprecat")

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    return {**env, **extra}


def _run(*args, cwd: Path) -> str:
    r = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{args} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel path, build output) for a copy of the project."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    out = _run(sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", tmp / "dist",
               ".", cwd=src)
    (wheel,) = (tmp / "dist").glob("ckpt_tools-*.whl")
    return wheel, out


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """The ``ckpt`` script of the wheel installed in a throwaway venv."""
    wheel, _ = built
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel,
         cwd=env_dir)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=env_dir).strip())
    (site / "_test_env_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dependencies
    return env_dir / "bin" / "ckpt"


def test_the_wheel_builds_without_a_warning(built):
    _, out = built
    warnings = [line for line in out.splitlines() if WARNING.search(line)]
    assert not warnings, "\n".join(warnings)


def test_the_wheel_holds_every_module_and_table(built):
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {str(p.relative_to(ROOT)) for p in (ROOT / "ckpt_tools").rglob("*.py")}
    want |= {f"ckpt_tools/{p.relative_to(ROOT)}" for p in (ROOT / "mappings").rglob("*.yaml")}
    assert want - names == set()
    assert (ROOT / "mappings" / "architectures" / "deepseek_v3.yaml").exists()  # the sets above are not empty


def test_the_installed_wheel_lists_every_family_and_format(installed, tmp_path):
    python = installed.parent / "python"
    where = _run(python, "-c", "import ckpt_tools; print(ckpt_tools.__file__)", cwd=tmp_path)
    assert where.startswith(str(installed.parent.parent)), where  # the wheel's copy, not the source tree
    out = subprocess.run([installed, "tables", "--json"], cwd=tmp_path, capture_output=True, text=True,
                         env=_env(CKPT_CACHE_DIR="off"), timeout=120)
    assert out.returncode == 0, out.stderr
    tables = json.loads(out.stdout)
    shipped = {p.stem for d in ("architectures", "templates") for p in (ROOT / "mappings" / d).glob("*.yaml")}
    formats = {p.stem for p in (ROOT / "mappings" / "formats").glob("*.yaml")}
    assert {t["family"] for t in tables} == shipped
    families = [t for t in tables if t["kind"] == "mtp"]
    assert len(families) == len(list((ROOT / "mappings" / "architectures").glob("*.yaml")))
    for t in families:
        assert set(t["formats"]) == formats, t["family"]


def test_the_installed_wheel_extracts(installed, make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    for args in (["inspect", src], ["extract", src, "-o", tmp_path / "draft"], ["validate", tmp_path / "draft"]):
        r = subprocess.run([installed, *map(str, args)], cwd=tmp_path, capture_output=True, text=True,
                           env=_env(CKPT_CACHE_DIR=str(tmp_path / "cache")), timeout=120)
        assert r.returncode == 0, f"{args}: {r.stdout}\n{r.stderr}"
    assert (tmp_path / "draft" / "ckpt_manifest.json").exists()
