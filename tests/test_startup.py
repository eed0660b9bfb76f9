"""The fixed cost of a run: what `ckpt` imports, what it compiles, what it converts.

A verb pays for the libraries it imports. numpy, torch and huggingface_hub cost 0.1-1 s each and
reading, checking or copying a bf16 checkpoint needs none of them, so those verbs must not import them
(diff of differing values, stitch, init-draft, probe and the numeric conversions do, lazily). With the checked
tables cached, yaml and pydantic are not needed either.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ckpt_tools.cli import app, app_for
from ckpt_tools.io.config import ConfigView
from ckpt_tools.model import expr
from ckpt_tools.model.tables import cache, loader
from ckpt_tools.model.tables.resolve import resolve

HEAVY = ("numpy", "torch", "huggingface_hub")
# Run the CLI (or just an import) in a fresh interpreter; on exit, write which watched packages it imported.
PROBE = """
import atexit, json, sys
out, watched, args = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(m for m in watched if m in sys.modules))))
if args[0] == "--import":
    __import__(args[1])
else:
    sys.argv = ["ckpt", *args]
    from ckpt_tools.cli import main
    main()
"""


def imported(tmp_path, watched, *args, cache_dir=None) -> list[str]:
    """The packages of ``watched`` that ``ckpt ARGS`` (or ``--import MODULE``) imported, in a new process."""
    out = tmp_path / "imported.json"
    env_cache = str(cache_dir or tmp_path / "cache")
    r = subprocess.run([sys.executable, "-c", PROBE, out, ",".join(watched), *map(str, args)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CKPT_CACHE_DIR": env_cache})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("module", ["ckpt_tools", "ckpt_tools.cli"])
def test_importing_is_light(module, tmp_path):
    # ckpt_tools alone (the library's entry) not even the CLI's libraries; the CLI not pydantic before it parses
    watched = (*HEAVY, "yaml", "pydantic") + (("typer", "rich") if module == "ckpt_tools" else ())
    assert imported(tmp_path, watched, "--import", module) == []


def test_help_imports_nothing_heavy(tmp_path):
    assert imported(tmp_path, (*HEAVY, "yaml", "pydantic"), "--help") == []


def test_reading_and_copying_a_bf16_checkpoint_import_no_numeric_library(make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    warm = tmp_path / "cache"
    imported(tmp_path, HEAVY, "inspect", src, cache_dir=warm)  # fills the parsed-table cache
    for args in (["inspect", src], ["validate", src], ["tables"]):
        assert imported(tmp_path, (*HEAVY, "yaml"), *args, cache_dir=warm) == [], args
    out = tmp_path / "draft"
    assert imported(tmp_path, (*HEAVY, *CHECKERS), "extract", src, "-o", out, cache_dir=warm) == []
    assert imported(tmp_path, (*HEAVY, *CHECKERS), "verify-manifest", out, cache_dir=warm) == []


# With the checked tables cached (model/tables/plain.py) no run parses YAML or checks a table with pydantic, and
# the command line converts its values without typer's pydantic adapters (cli/coerce.py).
CHECKERS = ("yaml", "pydantic", "typer._adapters")


def test_dry_runs_of_a_bf16_checkpoint_import_no_numeric_library_and_no_checker(make_fixture, tmp_path):
    src, target = make_fixture("deepseek_v3"), make_fixture("deepseek_v3", drop_mtp=True)
    warm = tmp_path / "cache"
    imported(tmp_path, HEAVY, "inspect", src, cache_dir=warm)  # fills the table caches
    out = tmp_path / "out"
    # graft splits its new MTP shards with huggingface_hub's splitter
    assert imported(tmp_path, (*HEAVY, *CHECKERS), "extract", src, "-o", out, "--dry-run", cache_dir=warm) == []
    assert set(imported(tmp_path, (*HEAVY, *CHECKERS), "graft", src, target, "-o", out, "--dry-run",
                        cache_dir=warm)) <= {"huggingface_hub"}


def test_a_dry_run_imports_neither_the_writer_nor_the_expert_converters(make_fixture, tmp_path):
    """A dry run plans and prints: the executor, the output validator and the expert converters stay unloaded."""
    src = make_fixture("deepseek_v3", fp8=True)
    writer = ("ckpt_tools.stream.writer", "ckpt_tools.stream.execute", "ckpt_tools.ops.check.validate",
              "ckpt_tools.model.experts")
    for verb in ("extract", "dequant"):
        assert imported(tmp_path, writer, verb, src, "-o", tmp_path / "out", "--dry-run") == [], verb


# What each read-only verb must not import: libraries it does not need (diff compares values with numpy only where
# the bytes differ: the test diffs a checkpoint with itself; the others read headers and bytes only), and the
# operations of the other verbs (a verb's module imports its own).
WRITERS = (
    "ckpt_tools.ops.draft.extract",
    "ckpt_tools.ops.stitch.plan",
    "ckpt_tools.ops.stitch.graft",
    "ckpt_tools.ops.convert.dequant",
    "ckpt_tools.ops.convert.fuse_experts",
    "ckpt_tools.ops.draft.init_draft",
    "ckpt_tools.ops.publish.push",
    "ckpt_tools.ops.probe.probe",
    "ckpt_tools.ops.convert.fix_quant_config",
    "ckpt_tools.stream.writer",
    "ckpt_tools.stream.execute",
)
READERS = {
    "inspect": "ckpt_tools.ops.inspect.inspect",
    "validate": "ckpt_tools.ops.check.validate",
    "diff": "ckpt_tools.ops.diff.diff",
    "verify-manifest": "ckpt_tools.ops.check.verify_manifest",
}
NOT_IMPORTED = {
    verb: (*HEAVY, "transformers", *CHECKERS, *WRITERS, *(m for v, m in READERS.items() if v != verb))
    for verb in READERS
}


@pytest.mark.parametrize("verb", sorted(NOT_IMPORTED))
def test_a_read_only_verb_imports_neither_heavy_libraries_nor_other_verbs(verb, make_fixture, tmp_path):
    src = make_fixture("deepseek_v3")
    out = tmp_path / "extracted"
    warm = tmp_path / "cache"
    if verb == "verify-manifest":  # needs an output of ours (its manifest)
        from ckpt_tools.cli import app

        assert CliRunner().invoke(app, ["extract", str(src), "-o", str(out)]).exit_code == 0
    args = {"inspect": [src], "validate": [src], "diff": [src, src], "verify-manifest": [out]}[verb]
    imported(tmp_path, HEAVY, verb, *args, cache_dir=warm)  # fills the parsed-table cache
    watched = NOT_IMPORTED[verb]
    assert READERS[verb] in imported(tmp_path, (READERS[verb],), verb, *args, cache_dir=warm)  # the probe works
    assert imported(tmp_path, watched, verb, *args, cache_dir=warm) == [], verb


@pytest.fixture
def fresh_expressions(monkeypatch):
    """Every expression vetted and compiled anew; the list of compiled expression texts."""
    compiled: list[str] = []

    def spy(source, filename, mode, *a, **k):
        if filename == "<table>":
            compiled.append(ast.unparse(source))
        return builtins.compile(source, filename, mode, *a, **k)

    monkeypatch.setattr(expr, "compile", spy, raising=False)  # expr's lookup of the builtin finds this first
    for fn in (expr.vet, expr._code, loader._load_dirs):
        fn.cache_clear()
    yield compiled
    for fn in (expr.vet, expr._code, loader._load_dirs):
        fn.cache_clear()


def test_loading_the_tables_compiles_no_expression_and_a_run_only_its_own(fresh_expressions):
    tables = loader.all_tables()  # vets every expression of every table (a bad one still fails loudly)
    assert fresh_expressions == []
    table = tables["deepseek_v3"]
    resolve(table, ConfigView(table.fixture))
    assert fresh_expressions, "resolving evaluates expressions"
    own = (loader.mappings_dir() / "architectures" / "deepseek_v3.yaml").read_text()
    normalised = {ast.unparse(ast.parse(t, mode="eval")) for t in _expressions(own)}
    assert set(fresh_expressions) <= normalised  # nothing of the 24 other tables
    assert len(fresh_expressions) == len(set(fresh_expressions))  # each compiled once


def _expressions(yaml_text: str) -> list[str]:
    """Every string of a table that parses as an expression (its fields and its templates' {fields})."""
    import yaml

    out: list[str] = []

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            for text in [v, *expr._FIELD.findall(v)]:
                try:
                    ast.parse(text.strip(), mode="eval")
                    out.append(text.strip())
                except SyntaxError:
                    pass

    walk(yaml.safe_load(yaml_text))
    return out


def test_a_bare_variable_is_not_parsed_yet_checked_like_any_expression(fresh_expressions):
    assert expr.evaluate("hidden", {"hidden": 7}) == 7
    assert expr.names_in("hidden") == {"hidden"}
    assert fresh_expressions == []
    with pytest.raises(expr.ExprError, match="needs hidden"):
        expr.evaluate("hidden", {})
    assert expr.evaluate("hidden * 2", {"hidden": 7}) == 14 and fresh_expressions == ["hidden * 2"]
    for not_a_variable in ("True", "len"):  # a keyword and a function go through the parser
        assert expr.vet(not_a_variable)[0] is not None


@pytest.mark.parametrize("command", sorted({c.name for c in app.registered_commands}))
def test_each_verb_runs_from_an_app_holding_only_it(command):
    one = app_for([command, "--help"])
    assert [c.name for c in one.registered_commands] == [command]
    r = CliRunner().invoke(one, [command, "--help"])
    assert r.exit_code == 0 and f" {command} " in r.output.splitlines()[0], r.output


def test_the_global_option_typos_and_no_verb_keep_the_whole_app():
    assert app_for(["--debug", "inspect", "x"]).registered_commands[0].name == "inspect"
    assert app_for(["inspekt", "x"]) is app
    assert app_for([]) is app
    r = CliRunner().invoke(app_for(["inspekt"]), ["inspekt"])
    assert r.exit_code == 2 and "inspect" in r.output


def test_table_caches_of_two_directory_sets_do_not_evict_each_other(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
        (d / "deepseek_v3.yaml").write_text((loader.mappings_dir() / "architectures" / "deepseek_v3.yaml").read_text())
    (two / "deepseek_v3.yaml").write_text((two / "deepseek_v3.yaml").read_text() + "\n# another install\n")
    parsed = []
    real = loader._parse
    monkeypatch.setattr(loader, "_parse", lambda p: parsed.append(p) or real(p))
    for d in (one, two, one, two):
        loader._load_dirs.cache_clear()
        loader._load_dirs((d,))
    loader._load_dirs.cache_clear()
    assert parsed == [one / "deepseek_v3.yaml", two / "deepseek_v3.yaml"]  # the last two runs hit
    assert len(list((tmp_path / "cache").glob(f"{cache.PREFIX}*.json"))) == 2


def test_a_safetensors_checkpoint_loads_no_draft_reader(make_fixture, tmp_path):
    """The torch and DCP draft readers are imported only when a draft in their format is read."""
    src = make_fixture("deepseek_v3")
    drafts = ("ckpt_tools.io.readers.torch_state", "ckpt_tools.io.readers.dcp")
    for args in (["inspect", src], ["validate", src]):
        assert imported(tmp_path, drafts, *args) == [], args


# A paused block's objects (a release's 92,000 references) in a fresh interpreter: frozen when the block ends in a
# process that runs one command (the CLI), so no young collection scans them; in the Python API nothing is frozen.
GC_PROBE = """
import gc, sys
from ckpt_tools import gcpause
if sys.argv[1] == "cli":
    gcpause.one_command()
before = gc.get_freeze_count()
with gcpause.gc_paused():
    kept = [[] for _ in range(10000)]
print(gc.get_freeze_count() - before >= 10000, gc.isenabled())
"""


@pytest.mark.parametrize(("mode", "frozen"), [("cli", "True"), ("api", "False")])
def test_a_paused_block_leaves_its_objects_frozen_in_the_cli_only(mode, frozen):
    r = subprocess.run([sys.executable, "-c", GC_PROBE, mode], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == [frozen, "True"], r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2, reason="counts /proc tasks")
def test_the_cli_loads_numpy_without_blas_threads(tmp_path):
    """numpy's OpenBLAS starts a thread per core that spins ~0.1 s of CPU after import, beside the decoding threads;
    the CLI asks for one (nothing it runs multiplies matrices): after a command, importing numpy adds no thread."""
    code = ("import os, sys\nsys.argv = ['ckpt', '--help']\nfrom ckpt_tools.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nimport numpy\nprint(len(os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert r.stdout.split()[-1] == "1"
