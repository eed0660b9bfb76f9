"""What the docs claim about the code is checked against the code itself.

Names (``ckpt_tools.ops.stitch.compare.DIVERGENCE``, ``model.quant.decode``, ``ops/check/validate.py``) must
resolve by importing them, so a module that moves makes every stale mention fail; the options
docs/verbs.md gives a verb must be on that verb's CLI; every verb has its API function unless
docs/python-api.md names it as one without; module docstrings stay short.
"""

from __future__ import annotations

import ast
import importlib
import io
import pkgutil
import re
import tokenize
from pathlib import Path

import click
import typer.main

import ckpt_tools
import ckpt_tools.api
from ckpt_tools.cli import app

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckpt_tools"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VERBS_MD = ROOT / "docs" / "verbs.md"
API_MD = ROOT / "docs" / "python-api.md"
MAX_MODULE_DOCSTRING_LINES = 15

# subpackages a docstring may name without the ckpt_tools prefix (``model.quant.decode``)
SUBPACKAGES = sorted(m.name for m in pkgutil.iter_modules(ckpt_tools.__path__) if m.ispkg)
# Hugging Face tensor keys and file names that start like our subpackages: `model.layers.{n}`,
# `model.safetensors.index.json` are keys and files of a checkpoint, not our modules
NOT_OURS = {"model": {"layers", "embed_tokens", "norm", "safetensors", "mtp_layers"}}
DOTTED = re.compile(rf"(?<![\w./-])((?:ckpt_tools|{'|'.join(SUBPACKAGES)})(?:\.[A-Za-z_]\w*)+)")
# a path to one of our modules or packages: ops/check/validate.py, ckpt_tools/model/rules.py, ckpt_tools/model/quant/
_ROOTS = "|".join(["ckpt_tools", "benchmarks", "tests", *SUBPACKAGES])
PATH = re.compile(rf"(?<![\w./-])((?:{_ROOTS})/(?:[\w/]+\.py\b|[\w/]*/))")
INSTALLED_ONLY = {"ckpt_tools/mappings/"}  # the tables' place in an installed package (setup.py puts them there)


def _cli() -> click.Group:
    return typer.main.get_command(app)


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}


def _docstrings(path: Path) -> list[str]:
    """Every module, class and function docstring of a Python file."""
    nodes = ast.walk(ast.parse(path.read_text()))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for n in nodes if isinstance(n, kinds) and (d := ast.get_docstring(n, clean=False))]


def _comments(path: Path) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [t.string for t in tokens if t.type == tokenize.COMMENT]


def _prose() -> list[tuple[str, str]]:
    """(where, text) for every page, docstring and benchmark comment that may name our code."""
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in PAGES]
    for path in sorted(PACKAGE.rglob("*.py")):
        texts += [(str(path.relative_to(ROOT)), d) for d in _docstrings(path)]
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        texts += [(str(path.relative_to(ROOT)), d) for d in _docstrings(path) + _comments(path)]
    return texts


def resolves(name: str) -> bool:
    """True when ``name`` is a module of ours, or an attribute reached from one by getattr."""
    parts = name.split(".")
    if parts[0] != "ckpt_tools":
        parts.insert(0, "ckpt_tools")
    for split in range(len(parts), 1, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and module_name.startswith(e.name):
                continue  # this prefix is not a module: try a shorter one, the rest as attributes
            raise  # the module exists and imports something missing: a bug to see, not a stale name
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _is_ours(name: str) -> bool:
    first, _, rest = name.partition(".")
    return first == "ckpt_tools" or rest.split(".")[0] not in NOT_OURS.get(first, set())


def _path_exists(path: str) -> bool:
    return path in INSTALLED_ONLY or any((base / path).exists() for base in (ROOT, PACKAGE))


def test_every_named_module_and_attribute_resolves():
    # the resolver tells a moved name from a present one
    assert resolves("ckpt_tools.ops.stitch.compare.DIVERGENCE") and resolves("model.quant.decode")
    assert not resolves("ckpt_tools.ops.stitch.DIVERGENCE") and not resolves("ops.stitch.compare.NO_SUCH_NAME")
    assert not resolves("ops.probe.probe.stitch_compare")
    assert not _is_ours("model.layers.61.mlp") and _is_ours("model.quant")
    bad = set()
    for where, text in _prose():
        for match in DOTTED.finditer(text):
            name = match.group(1).rstrip(".")
            if _is_ours(name) and not resolves(name):
                bad.add(f"{where}: {name}")
        for match in PATH.finditer(text):
            if not _path_exists(match.group(1)):
                bad.add(f"{where}: {match.group(1)} (no such file)")
    assert not bad, "names that do not resolve (moved or removed?):\n" + "\n".join(sorted(bad))


def _verb_rows() -> dict[str, list[str]]:
    """docs/verbs.md's command table: verb -> the options each of its rows gives it."""
    rows: dict[str, list[str]] = {}
    for line in VERBS_MD.read_text().splitlines():
        m = re.match(r"^\| `ckpt ([\w-]+)([^`]*)`", line)
        if m:
            rows.setdefault(m.group(1), []).extend(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", m.group(2)))
    return rows


def _shared_options() -> dict[str, set[str]]:
    """docs/verbs.md's table of options several commands share: option -> the commands it names."""
    text = VERBS_MD.read_text()
    section = text.partition("## Options several commands share")[2].partition("\n## ")[0]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = re.match(r"^\| `(--[\w-]+)[^`]*` \| ([^|]+) \|", line)
        if m:
            table[m.group(1)] = set(re.findall(r"`([\w-]+)`", m.group(2)))
    return table


def test_every_option_docs_verbs_md_claims_exists_on_that_verb():
    """The command table's options exist; the shared-options table names exactly the verbs having each."""
    commands = _cli().commands
    rows = _verb_rows()
    assert len(rows) >= 10 and set(rows) <= set(commands), sorted(set(rows) - set(commands))
    bad = [f"ckpt {verb} {o}" for verb, opts in rows.items() for o in opts if o not in _options(commands[verb])]
    assert not bad, "docs/verbs.md gives options the CLI does not have: " + ", ".join(bad)
    table = _shared_options()
    assert {"--resume", "--dry-run", "--allow-invalid", "--threads"} <= set(table), sorted(table)
    for option, documented in table.items():
        having = {verb for verb, command in commands.items() if option in _options(command)}
        assert documented == having, (
            f"docs/verbs.md says {option} is on {sorted(documented)}; the CLI has it on {sorted(having)}"
        )


def test_no_prose_claims_an_option_for_a_class_of_commands():
    """A claim about "every writing command" cannot be checked; the shared-options table can."""
    prose = VERBS_MD.read_text().partition("## Options several commands share")[0]
    claims = re.findall(r"[^.\n]*\b(?:Every|every|All|all)\b[^.|\n]*\bcommands?\b[^.|\n]*\baccepts?\b[^.]*", prose)
    assert not claims, claims


def _without_a_function() -> set[str]:
    """The commands docs/python-api.md names as having no function."""
    m = re.search(r"^Commands without a function: (.+?)(?:\n\n|\Z)", API_MD.read_text(), flags=re.M | re.S)
    return set(re.findall(r"`([\w-]+)`", m.group(1))) if m else set()


def test_every_verb_has_its_api_function_or_the_docs_say_it_has_none():
    verbs = set(_cli().commands)
    functions = set(ckpt_tools.api.__all__)
    none = _without_a_function()
    missing = sorted(v for v in verbs if v.replace("-", "_") not in functions and v not in none)
    assert not missing, f"CLI verbs with no ckpt_tools.api function, not named in docs/python-api.md: {missing}"
    wrong = sorted(v for v in none if v.replace("-", "_") in functions or v not in verbs)
    assert not wrong, f"docs/python-api.md says these have no function, but they do (or are no verb): {wrong}"
    imported = re.search(r"from ckpt_tools import \(([^)]*)\)", API_MD.read_text()).group(1)
    names = {n.strip() for n in imported.split(",")} - {"CheckFailed", "UsageError", "InputError", "OutputError"}
    assert names == functions, f"python-api.md imports {sorted(names)}; the API has {sorted(functions)}"


def test_module_docstrings_are_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines:\n" + "\n".join(long)


def test_readme_counts_the_producers_fixtures_it_names():
    """The README's count of transformers families and its list of llm-compressor schemes match fixtures/producers/."""
    producers = ROOT / "fixtures" / "producers"
    text = " ".join((ROOT / "README.md").read_text().split())
    families = sorted(p.name for p in producers.glob("transformers-*") if p.is_dir())
    claimed = re.search(r"transformers `save_pretrained` of (\d+) families", text)
    assert claimed, "README no longer says how many transformers families the producers fixtures hold"
    assert int(claimed.group(1)) == len(families), f"README says {claimed.group(1)}, fixtures hold {len(families)}"
    schemes = re.search(r"llm-compressor ((?:[\w]+ / )*[\w]+)", text)
    assert schemes, "README no longer lists the llm-compressor schemes"
    listed = {s.strip().lower().replace("_", "-") for s in schemes.group(1).split("/")}
    shipped = {p.name.removeprefix("llmcompressor-") for p in producers.glob("llmcompressor-*") if p.is_dir()}
    assert listed == shipped, f"README lists {sorted(listed)}, fixtures hold {sorted(shipped)}"
