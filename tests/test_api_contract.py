"""The public API's contract: cheap to import, signatures that change only on purpose, types that check.

Signatures: tests/api_signatures.txt holds ``name + str(inspect.signature(fn))`` for every function in
``ckpt_tools.__all__``. After a deliberate change (see ``CHANGE_HOWTO``) regenerate it with

    CKPT_UPDATE_SIGNATURES=1 pytest tests/test_api_contract.py -k signatures

and commit the file with the change.
"""

from __future__ import annotations

import importlib
import inspect
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIGNATURES = Path(__file__).with_name("api_signatures.txt")
UPDATE_ENV = "CKPT_UPDATE_SIGNATURES"
HEAVY = ("torch", "numpy", "huggingface_hub", "typer", "rich", "pydantic", "yaml")
IMPORT_BUDGET = 0.1  # seconds `import ckpt_tools` may add to a bare interpreter's start
RUNS = 7
CHANGE_HOWTO = f"""\
A public signature differs from {SIGNATURES.name}. Callers' code breaks on a removed or renamed keyword, so:
- a new keyword: keyword-only, with a default that keeps today's behaviour;
- a renamed or removed keyword: keep accepting the old one for a release (take it, warn with
  warnings.warn("OLD is deprecated; use NEW", DeprecationWarning, stacklevel=2), map it to the new one)
  and say so in docs/python-api.md;
then regenerate the snapshot deliberately and commit it with the change:
    {UPDATE_ENV}=1 pytest tests/test_api_contract.py -k signatures"""


# -- import cost -------------------------------------------------------------------------------------------------

TIMED = """
import sys, time
t = time.perf_counter()
{stmt}
dt = time.perf_counter() - t
print(dt, ",".join(m for m in sys.argv[1].split(",") if m in sys.modules))
"""


def _start(stmt: str) -> tuple[float, list[str]]:
    """Wall time of a fresh interpreter running ``stmt`` (start-up included), and the HEAVY modules it loaded."""
    code = TIMED.format(stmt=stmt)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    import time

    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, ",".join(HEAVY)], capture_output=True, text=True, env=env,
                       timeout=60, check=True)
    wall = time.perf_counter() - t
    loaded = r.stdout.split()[1].split(",") if len(r.stdout.split()) > 1 else []
    return wall, loaded


def test_import_ckpt_tools_is_cheap_and_loads_nothing_heavy():
    # interleaved, median of several runs: a busy machine slows both sides alike
    bare, ours, loaded = [], [], set()
    for _ in range(RUNS):
        bare.append(_start("pass")[0])
        wall, mods = _start("import ckpt_tools")
        ours.append(wall)
        loaded.update(mods)
    assert not loaded, f"import ckpt_tools loaded {sorted(loaded)}"
    extra = statistics.median(ours) - statistics.median(bare)
    assert extra < IMPORT_BUDGET, f"import ckpt_tools adds {extra:.3f} s (budget {IMPORT_BUDGET} s)"


def test_exceptions_importable_without_loading_a_verb():
    wall, loaded = _start("from ckpt_tools import CheckFailed, CkptError, InputError, OutputError, UsageError")
    assert not loaded


# -- signature snapshot ------------------------------------------------------------------------------------------


def _missing_module(e: ModuleNotFoundError) -> bool:
    """Whether ``e`` says an api module of a verb does not exist (yet), not that something it imports is absent."""
    return (e.name or "").startswith("ckpt_tools.api.")


def current_signatures() -> tuple[dict[str, str], list[str]]:
    """name -> ``name(params) -> ret`` for every function in ``ckpt_tools.__all__``, and the public names whose
    api module does not exist (yet: verbs land one branch at a time). Any other import error propagates."""
    import ckpt_tools

    found: dict[str, str] = {}
    missing: list[str] = []
    for name in sorted(ckpt_tools.__all__):
        try:
            obj = getattr(ckpt_tools, name)
        except ModuleNotFoundError as e:
            if not _missing_module(e):
                raise
            missing.append(f"{name} ({e.name} does not exist)")
            continue
        if inspect.isfunction(obj):
            found[name] = f"{name}{inspect.signature(obj)}"
    return found, missing


def _snapshot() -> dict[str, str]:
    lines = [ln for ln in SIGNATURES.read_text().splitlines() if ln and not ln.startswith("#")]
    return {ln.partition("(")[0]: ln for ln in lines}


def test_public_signatures_match_the_snapshot():
    found, missing = current_signatures()
    if os.environ.get(UPDATE_ENV) == "1":  # the only place a missing verb module is let through
        SIGNATURES.write_text(f"# public signatures (tests/test_api_contract.py); regenerate: {UPDATE_ENV}=1 pytest "
                              "tests/test_api_contract.py -k signatures\n" + "\n".join(found.values()) + "\n")
        pytest.skip(f"wrote {len(found)} signature(s) to {SIGNATURES}; left out: {', '.join(missing) or 'none'}")
    assert not missing, f"public names without their module: {', '.join(missing)}"
    snapshot = _snapshot()
    changes = [f"- {snapshot[n]}" for n in sorted(snapshot) if found.get(n) != snapshot[n]]
    changes += [f"+ {found[n]}" for n in sorted(found) if snapshot.get(n) != found[n]]
    assert not changes, "\n".join(changes) + "\n\n" + CHANGE_HOWTO


def test_a_missing_verb_module_is_named_and_a_broken_one_raises(monkeypatch):
    """While generating, a verb whose module does not exist is left out (and named); a verb whose module
    fails on its own imports is an error."""
    import ckpt_tools.api

    monkeypatch.setitem(ckpt_tools.api._WHERE, "diff", "not_written_yet")
    monkeypatch.delitem(vars(ckpt_tools.api), "diff", raising=False)
    found, missing = current_signatures()
    assert "diff" not in found and "inspect" in found
    assert missing[0] == "diff (ckpt_tools.api.not_written_yet does not exist)"

    broken = ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: (_ for _ in ()).throw(broken))
    monkeypatch.delitem(vars(ckpt_tools.api), "inspect", raising=False)
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        current_signatures()


# -- types -------------------------------------------------------------------------------------------------------

MYPY_TARGETS = ("ckpt_tools/__init__.py", "ckpt_tools/api/")
# a caller's script: the verbs' reports are typed (not Any), so a wrong use is an error
CALLER = """
from ckpt_tools import CheckFailed, diff, inspect, validate

report = inspect("ckpt")
layers: int = report.mtp_layers
wrong: str = validate("ckpt").ok
try:
    diff("a", "b", keys="mtp")
except CheckFailed as e:
    print(e.report)
"""


# torch and transformers are not followed (their names are Any): ~4,000 modules of theirs took 38 of the 50 s and
# 1.2 of the 1.5 GB this check cost. The errors reported are those of the targets only (the rest is followed
# silently), and no target uses a torch or transformers type (measure.py holds transformers' logging as Any).
# A public signature that comes to name a torch type must drop torch from this list.
MYPY_CONFIG = "[mypy]\n[mypy-torch.*,transformers.*]\nfollow_imports = skip\n"


def _mypy(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(cache / "mypy.ini"), "--strict",
                           "--follow-imports=silent", "--cache-dir", str(cache), "--no-error-summary", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    pytest.importorskip("mypy", reason="mypy is in the [test] extra (pip install -e '.[test]')")
    cache = tmp_path_factory.mktemp("mypy-cache")
    (cache / "mypy.ini").write_text(MYPY_CONFIG)
    return cache


def test_public_api_passes_mypy_strict(mypy_cache):
    r = _mypy(*MYPY_TARGETS, cache=mypy_cache)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_callers_misuse_is_a_type_error(mypy_cache, tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(CALLER))
    r = _mypy(str(script), cache=mypy_cache)
    errors = [ln for ln in r.stdout.splitlines() if ": error:" in ln]
    # exactly the bool assigned to str: the report's other fields typed as used
    assert len(errors) == 1 and "caller.py:6:" in errors[0] and '"bool"' in errors[0], r.stdout + r.stderr

