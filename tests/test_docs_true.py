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
import pytest
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


# -- counts and value lists ---------------------------------------------------------------------------------------

BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "benchmarks" / "history"
MAX_BENCHMARKS_OPENING = 15
# `--opt a|b|c` as the docs write a value list (pipes escaped inside a table's cells), or `--opt a` alone
VALUE_LIST = re.compile(r"(?<![\w-])(--[a-z][\w-]*)[ =]((?:[a-z0-9][\w.-]*)(?:\\?\|[a-z0-9][\w.-]*)*)(?![\w.|-])")
# the verb a value belongs to: `ckpt VERB ...`, or a code span opening with it (`stitch --dtype draft`)
VERB = re.compile(r"(?:`(?:ckpt )?|\bckpt )(?P<verb>[a-z][\w-]*)\b")


def _cli_values(command: click.Command, option: str) -> set[str] | None:
    """The values an option's own declaration lists (click choices, else its help's ``a | b | c`` or ``a, b or c``)."""
    param = next((p for p in command.params if option in p.opts), None)
    if param is None:
        return None
    if isinstance(getattr(param, "type", None), click.Choice):
        return set(param.type.choices)
    text = " ".join(re.sub(r"\([^()]*\)", " ", f"{param.metavar or ''} {param.help or ''}").split())
    m = re.search(r"(?<![\w-])[a-z0-9][\w-]*(?: ?\| ?[a-z0-9][\w-]*)+", text)
    if m:
        return {v.strip() for v in m.group(0).split("|")}
    # "cpu, cuda or auto", "How depth k > 1 is chained: sglang or vllm": a list opening the help or its last clause
    m = re.match(r"([a-z0-9][\w-]*(?:, [a-z0-9][\w-]*)*) or ([a-z0-9][\w-]*)\b", text.rsplit(": ", 1)[-1])
    return {*m.group(1).split(", "), m.group(2)} if m else None


def _documented_values() -> dict[tuple[str, str], tuple[set[str], bool, list[str]]]:
    """(verb, option) -> (every value the docs give it, whether one place lists several, where), from every page.

    A value belongs to the `ckpt VERB` written before it on its line; a list also to one earlier in its paragraph
    (a synopsis wrapped over lines); else to the one verb having that option."""
    commands = _cli().commands
    found: dict[tuple[str, str], tuple[set[str], bool, list[str]]] = {}
    for page in PAGES:
        verb = None
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if not line.strip() or line.startswith("|"):
                verb = None  # a paragraph or a table row starts afresh
            on_line = None
            for m in re.finditer(rf"{VERB.pattern}|{VALUE_LIST.pattern}", line):
                if m.group("verb"):
                    if m.group("verb") in commands:
                        verb = on_line = m.group("verb")
                    continue
                option, values = m.group(2), re.split(r"\\?\|", m.group(3))
                said = verb if len(values) > 1 else on_line  # a lone value: only the verb on its own line
                owner = said if said and option in _options(commands[said]) else None
                if owner is None:
                    having = [v for v, c in commands.items() if option in _options(c)]
                    owner = having[0] if len(having) == 1 else None
                if owner is None or _cli_values(commands[owner], option) is None:
                    continue
                known, listed, where = found.setdefault((owner, option), (set(), False, []))
                found[(owner, option)] = (known | set(values), listed or len(values) > 1,
                                          [*where, f"{page.relative_to(ROOT)}:{n}"])
    return found


def test_every_value_list_the_docs_give_an_option_is_the_cli_own():
    """`extract --dtype keep|bf16|fp16|fp32`: where a page lists an option's values, together they are the values
    the option's declaration lists (a single value, `--dequant bf16`, is an example: only checked to be one)."""
    commands = _cli().commands
    assert _cli_values(commands["extract"], "--dtype") == {"keep", "bf16", "fp16", "fp32"}
    assert _cli_values(commands["probe"], "--device") == {"cpu", "cuda", "auto"}
    documented = _documented_values()
    assert ("extract", "--dtype") in documented and ("stitch", "--link") in documented, sorted(documented)
    bad = []
    for (verb, option), (values, listed, where) in sorted(documented.items()):
        cli = _cli_values(commands[verb], option)
        wrong = values - cli if not listed else values ^ cli
        if wrong:
            bad.append(f"ckpt {verb} {option}: the docs give {sorted(values)} ({', '.join(where)}), "
                       f"the CLI {sorted(cli)}")
    assert not bad, "\n".join(bad)
    from ckpt_tools.ops.writing.carry import LINK_MODES  # what the writers accept, not what their help says

    linking = {verb for verb, command in commands.items() if "--link" in _options(command)}
    assert linking and all(_cli_values(commands[v], "--link") == set(LINK_MODES) for v in linking), linking


def test_the_dtype_values_the_docs_list_are_the_ones_the_verbs_accept():
    """Every float dtype a dtype option lists is parsed by the writers' own parser, and nothing else float is."""
    from ckpt_tools.dtypes import FLOAT_DTYPES
    from ckpt_tools.errors import UsageError
    from ckpt_tools.ops.writing.out_dtype import dtype_arg

    def accepted(value: str) -> bool:
        try:
            return dtype_arg(value, "--dtype") is not None
        except UsageError:
            return False

    commands = _cli().commands
    for verb, option in [("extract", "--dtype"), ("extract", "--dequant"), ("dequant", "--dtype"),
                         ("init-draft", "--dtype"), ("graft", "--mtp-dtype"), ("fuse-experts", "--dequant")]:
        floats = _cli_values(commands[verb], option) - {"keep"}
        assert floats and all(accepted(v) for v in floats), (verb, option, floats)
    assert not accepted("fp8") and len({dtype_arg(v, "x") for v in ("bf16", "fp16", "fp32")}) == 3
    assert {"BF16", "F16", "F32"} <= FLOAT_DTYPES


def _tables_of(kind: str) -> dict:
    from ckpt_tools.model.tables.loader import all_tables

    return {name: t for name, t in all_tables().items() if t.kind == kind}


def test_families_md_counts_what_it_names():
    """docs/families.md's count of shipped families and of templates, and the families it says were written from
    vLLM's own loaders, are the tables' own."""
    text = " ".join((ROOT / "docs" / "families.md").read_text().split())
    families = _tables_of("mtp")
    shipped = re.search(r"Shipped tables \(`mappings/architectures/`, (\d+) families\)", text)
    assert shipped and int(shipped.group(1)) == len(families), (shipped and shipped.group(1), len(families))
    templates = re.search(r"Templates \(`mappings/templates/`\) for targets without MTP \(([^)]*)\)", text)
    assert templates and len(templates.group(1).split(", ")) == len(_tables_of("template")), templates
    from_vllm = re.search(r"(\w+) of them \(([^)]*)\) were written from vLLM [\d.]+'s own MTP loaders", text)
    assert from_vllm, "docs/families.md no longer names the tables written from vLLM's loaders"
    named = set(re.findall(r"`(\w+)`", from_vllm.group(2)))
    def header(name: str) -> str:  # the table's opening comment, as one line
        lines = (ROOT / "mappings" / "architectures" / f"{name}.yaml").read_text().split("\n\n")[0].splitlines()
        return " ".join(line.lstrip("#").strip() for line in lines)

    headed = {name for name in families if re.search(r"from vLLM [\d.]+'s own loader", header(name))}
    assert named == headed, f"docs/families.md names {sorted(named)}; the tables' headers say {sorted(headed)}"
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    assert words.index(from_vllm.group(1).lower()) == len(named), from_vllm.group(0)


def test_gguf_md_lists_each_llama_cpp_family_with_its_check_level():
    """docs/gguf.md's family table: every table with a llama_cpp section, its architecture and check level, and
    no other row."""
    page = (ROOT / "docs" / "gguf.md").read_text().partition("| family | llama.cpp architecture | check |")[2]
    rows = re.findall(r"^\| `(\w+)` \| `([\w-]+)` \| (\w+) \|$", page.partition("\n\n")[0], flags=re.M)
    listed = {family: (arch, check) for family, arch, check in rows}
    assert len(listed) == len(rows), rows
    tables = _tables_of("mtp")
    sections = {n: (t.llama_cpp.arch, t.llama_cpp.check) for n, t in tables.items() if t.llama_cpp is not None}
    assert listed == sections


def test_draft_formats_and_schemes_the_docs_list_are_the_tables():
    """drafts.md's format table, README's list of extract's formats, quantization.md's scheme table."""
    formats = set(_tables_of("format")) if _tables_of("format") else {p.stem for p in (ROOT / "mappings" / "formats")
                                                                      .glob("*.yaml")}
    drafts = set(re.findall(r"^\| `([\w-]+)` \|", (ROOT / "docs" / "drafts.md").read_text(), flags=re.M))
    assert drafts == formats, (sorted(drafts), sorted(formats))
    readme = " ".join((ROOT / "README.md").read_text().split())
    listed = re.search(r"a standalone draft \(([^)]*)\)", readme)
    assert listed and set(listed.group(1).split(", ")) == formats, listed and listed.group(1)
    schemes = {p.stem for p in (ROOT / "mappings" / "quantization").glob("*.yaml")}
    quant = (ROOT / "docs" / "quantization.md").read_text().partition("| table | scheme | encoder |")[2]
    rows = set(re.findall(r"^\| `([\w-]+)` \|", quant.partition("\n\n")[0], flags=re.M))
    assert rows == schemes, (sorted(rows), sorted(schemes))


def _exit_codes(page: Path) -> set[int]:
    section = page.read_text().partition("xit codes\n")[2].partition("\n#")[0]
    return {int(c) for row in re.findall(r"^\| ([\d, ]+) \|", section, flags=re.M) for c in row.split(",")}


def test_the_exit_code_tables_list_the_codes_the_cli_exits_with():
    import signal

    from ckpt_tools import errors
    from ckpt_tools.cli import common

    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")} | {common.INTERNAL_ERROR,
                                                                             common.EXIT_BROKEN_PIPE}
    codes |= {128 + getattr(signal, s) for s in common.STOP_SIGNALS}
    for page in (ROOT / "README.md", VERBS_MD):
        assert _exit_codes(page) == codes, f"{page.name} lists {sorted(_exit_codes(page))}; the CLI: {sorted(codes)}"


def _benchmarks_opening() -> list[str]:
    lines = BENCHMARKS_MD.read_text().splitlines()
    methods = next((i for i, line in enumerate(lines) if line.startswith("## ")), None)
    assert methods is not None and lines[methods] == "## Methods", "BENCHMARKS.md: the opening, then ## Methods"
    return lines[:methods]


def test_benchmarks_md_opens_with_the_answer():
    """At most 15 lines before the methods; a table row naming every verb the harness knows; no issue numbers a
    user cannot look up; every figure of the opening traceable to the history's derivation table."""
    from benchmarks.verbs import VERBS

    opening = _benchmarks_opening()
    assert len(opening) <= MAX_BENCHMARKS_OPENING, f"BENCHMARKS.md opens with {len(opening)} lines"
    named = {n for line in opening if line.startswith("| `") for n in re.findall(r"`([\w-]+)`", line)}
    assert not set(VERBS) - named, f"verbs without a row in BENCHMARKS.md's opening: {sorted(set(VERBS) - named)}"
    refs = re.findall(r"(?i)\bissues? #?\d+|(?<![\w&/])#\d+\b", BENCHMARKS_MD.read_text())
    assert not refs, f"BENCHMARKS.md refers to issue numbers: {refs}"
    history = " ".join(p.read_text() for p in sorted(HISTORY.glob("*.md")))
    figures = {f for line in opening for f in re.findall(r"(?<![\w.:-])\d+\.\d+(?![\w.:-])", line)}
    assert figures, "no figures in BENCHMARKS.md's opening"
    untraced = sorted(f for f in figures if not re.search(rf"(?<![\w.]){re.escape(f)}(?![\d])", history))
    assert not untraced, f"figures of BENCHMARKS.md's opening found nowhere in benchmarks/history/: {untraced}"
    days = {d for line in opening for d in re.findall(r"\b20\d\d-\d\d-\d\d\b", line)}
    assert days and days <= {p.stem for p in HISTORY.glob("*.md")}, f"dates without a history file: {sorted(days)}"


def test_benchmarks_md_describes_the_replica_the_harness_builds():
    from benchmarks import release

    text = " ".join(BENCHMARKS_MD.read_text().split())
    tensors = sum(len(shard) for shard in release.shard_entries())
    for claim in re.findall(r"(\d+) shards and ([\d,]+) tensors|(\d+) shards, ([\d,]+) tensors", text):
        shards, count = (claim[0], claim[1]) if claim[0] else (claim[2], claim[3])
        assert (int(shards), int(count.replace(",", ""))) == (release.SHARDS, tensors), claim
    assert f"{tensors:,}-tensor" in text or f"{tensors:,} tensors" in text


def test_benchmarks_md_names_and_links_resolve():
    """The methods name our code and link the history: both must exist (the history itself is kept verbatim)."""
    text = BENCHMARKS_MD.read_text()
    bad = [n for n in (m.group(1).rstrip(".") for m in DOTTED.finditer(text)) if _is_ours(n) and not resolves(n)]
    bad += [p for p in (m.group(1) for m in PATH.finditer(text)) if not _path_exists(p)]
    for page in (BENCHMARKS_MD, *sorted(HISTORY.glob("*.md"))):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)} if dest.exists() else set()
            if not dest.exists() or (anchor and anchor not in slugs):
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, bad


def test_the_option_bounds_verbs_md_gives_are_the_checks_own():
    """`--seed` from 0 to 2**63-1, `--num-layers` from 1 to 64, `--layers` from 0 to 63: what the parsers refuse."""
    from ckpt_tools.errors import UsageError
    from ckpt_tools.model.tables.resolve import MAX_MTP_LAYERS
    from ckpt_tools.options import MAX_SEED, index_list

    text = " ".join(VERBS_MD.read_text().split())
    seed = re.search(r"`--seed` from 0 to 2\*\*(\d+)-1", text)
    layers = re.search(r"`--num-layers` from 1 to (\d+)", text)
    indices = re.search(r"`--layers` distinct indices from 0 to (\d+)", text)
    assert seed and layers and indices, "docs/verbs.md no longer states the bounds of --seed, --num-layers, --layers"
    assert 2 ** int(seed.group(1)) - 1 == MAX_SEED and int(layers.group(1)) == MAX_MTP_LAYERS
    top = int(indices.group(1))
    assert index_list("--layers", str(top), MAX_MTP_LAYERS - 1) is not None
    with pytest.raises(UsageError):
        index_list("--layers", str(top + 1), MAX_MTP_LAYERS - 1)
