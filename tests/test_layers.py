"""The package layers import one way: cli -> api -> ops -> model -> numeric -> stream -> io -> foundation.

Every import counts, at module level or inside a function (a lazy import is still a dependency),
and the module graph has no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckpt_tools

ROOT = Path(ckpt_tools.__file__).parent
# lower rank = lower layer; top-level modules are the shared foundation
# the package root re-exports the public API and python -m ckpt_tools runs the CLI: both sit on top
ENTRY_POINTS = {"ckpt_tools", "ckpt_tools.__main__"}
RANK = {"": 0, "io": 1, "stream": 2, "numeric": 3, "model": 4, "ops": 5, "api": 6, "testing": 6, "cli": 7}


def _module(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imports(path: Path) -> set[str]:
    """ckpt_tools modules (or names inside them) that a file imports, as absolute dotted names."""
    name, is_package = _module(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ckpt_tools"))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.startswith("ckpt_tools"):
                    found.update(f"{node.module}.{a.name}" for a in node.names)
                continue
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{prefix}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> modules it imports (a name imported from a module counts as that module)."""
    files = {(_module(p)[0]): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps = set()
        for dotted in _imports(path):
            while dotted and dotted not in files:  # strip imported names down to the module
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != module and dotted != "ckpt_tools":
                deps.add(dotted)
        graph[module] = deps
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else ""


def test_no_module_imports_a_layer_above_it():
    upward = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        if m not in ENTRY_POINTS
        for d in deps
        if RANK[_layer(d)] > RANK[_layer(m)]
    ]
    assert upward == []


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages <= set(RANK), packages - set(RANK)


def test_the_module_graph_has_no_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [module, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert [" -> ".join(c) for c in cycles] == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk resolves relative imports: a known upward edge of a fake tree is found."""
    assert _layer("ckpt_tools.stream.writer") == "stream"
    assert _layer("ckpt_tools.errors") == ""
    assert RANK[_layer("ckpt_tools.cli.common")] > RANK[_layer("ckpt_tools.ops.stitch_plan")]


def test_every_internal_import_names_a_module_that_exists():
    """A lazy import of a module that moved fails only when its function runs: catch it here."""
    modules = {_module(p)[0] for p in ROOT.rglob("*.py")}
    stale = []
    for path in ROOT.rglob("*.py"):
        for dotted in _imports(path):
            head, rest = dotted, []
            while head not in modules:
                head, _, last = head.rpartition(".")
                rest.insert(0, last)
            if len(rest) > 1:  # a module name (then the imported name) that no file provides
                stale.append(f"{_module(path)[0]}: {dotted}")
    assert stale == []


# -- inside ops: a verb's module does not import another verb's ------------------------------------

# validate is the check the other verbs run as a check, not as a verb: every writer on its output
# (execute.validate_output), push before it uploads, validate --fix-quant-config (fix_quant) before it writes
SHARED_CHECK = {"ckpt_tools.ops.validate"}


def _verb_names() -> set[str]:
    """Every verb, as the package names it: the API's public functions and the CLI's commands."""
    import ckpt_tools.api
    from ckpt_tools.cli import app

    names = set(ckpt_tools.api.__all__) | {c.name for c in app.registered_commands if c.name}
    return {n.replace("-", "_") for n in names}


def _api_module_imports() -> set[str]:
    """ops modules the API imports whole at run time (``from ..ops import validate as _validate``)."""
    found = set()
    for path in (ROOT / "api").glob("*.py"):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module == "ops" \
                    and id(node) not in typing_only:
                found.update(f"ckpt_tools.ops.{a.name}" for a in node.names)
    return found


def _verb_modules(graph: dict[str, set[str]]) -> set[str]:
    """The ops modules that are verbs: named for one (``experts`` for fuse-experts, ``verify`` for
    verify-manifest), or imported whole by the API as one (``fix_quant``: validate --fix-quant-config)."""
    verbs = _verb_names()
    ops = {m for m in graph if m.startswith("ckpt_tools.ops.")}

    def named(module: str) -> bool:
        name = module.rpartition(".")[2]
        return name in verbs or any(v.endswith("_" + name) or v.startswith(name + "_") for v in verbs)

    return {m for m in ops if named(m)} | (_api_module_imports() & ops)


def test_the_verbs_are_found():
    """The derivation finds every verb module (a verb that lost its module here would go unchecked)."""
    found = {m.rpartition(".")[2] for m in _verb_modules(_graph())}
    assert {"extract", "graft", "experts", "fix_quant", "init_draft", "dequant", "probe", "diff", "inspect",
            "validate", "push", "verify"} <= found, found
    assert not found & {"execute", "compare", "carry", "output_config", "probe_load", "stitch_compare"}


def test_no_verb_module_reaches_another():
    """What one verb lends to others lives in a shared ops module (carry, output_config, ...): a verb's
    module reaches no other verb's, directly or through the shared modules it imports."""
    graph = _graph()
    verbs = _verb_modules(graph) - SHARED_CHECK
    reached = []
    for verb in sorted(verbs):
        seen, todo = set(), [(verb, [verb])]
        while todo:
            module, path = todo.pop()
            for dep in sorted(graph.get(module, ())):
                if dep in seen or not dep.startswith("ckpt_tools.ops."):
                    continue
                seen.add(dep)
                if dep in verbs and dep != verb:
                    reached.append(" -> ".join(path + [dep]))
                elif dep not in verbs:
                    todo.append((dep, path + [dep]))
    assert reached == []
