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
    assert RANK[_layer("ckpt_tools.cli.common")] > RANK[_layer("ckpt_tools.ops.stitch.plan")]


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


# -- inside ops: verb rooms and shared rooms ---------------------------------------------------------

# One room per verb family; a verb room imports only shared rooms (and itself). What one verb lends to
# another is passed in by the caller (api/, cli/): probe gets stitch's correspondence, tables probe's support.
VERB_ROOMS = {"probe", "stitch", "draft", "convert", "inspect", "diff", "publish"}
# Shared rooms, lowest first: each imports only the rooms before it. check is shared because every writing
# verb validates its output before its index appears, and push validates what it publishes.
SHARED_ROOMS = ("shared", "check", "writing")


def _room(module: str) -> str | None:
    """The room of an ops module (``ckpt_tools.ops.<room>.<module>``); None for anything else."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["ckpt_tools", "ops"] else None


def _room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import from one room into a room it may not use."""
    allowed = {room: {room, *SHARED_ROOMS} for room in VERB_ROOMS}
    allowed |= {room: {room, *SHARED_ROOMS[:i]} for i, room in enumerate(SHARED_ROOMS)}
    bad = []
    for module, deps in sorted(graph.items()):
        here = _room(module)
        if here is None:
            continue
        for dep in sorted(deps):
            there = _room(dep)
            if there is not None and there not in allowed.get(here, set()):
                bad.append(f"{module} -> {dep}")
    return bad


def test_every_ops_module_lives_in_a_room():
    graph = _graph()
    ops = {m for m in graph if m.startswith("ckpt_tools.ops")}
    rooms = {p.name for p in (ROOT / "ops").iterdir() if (p / "__init__.py").exists()}
    assert rooms == VERB_ROOMS | set(SHARED_ROOMS)
    packages = {"ckpt_tools.ops", *(f"ckpt_tools.ops.{r}" for r in rooms)}
    outside = sorted(m for m in ops if m not in packages and (_room(m) not in rooms or m.count(".") != 3))
    assert outside == []  # a module beside the rooms, or a package inside one


def test_rooms_import_only_what_they_may():
    assert _room_violations(_graph()) == []


def test_the_room_checker_sees_a_verb_reaching_another():
    """The edges the flat layout had (tables -> probe's families, probe -> stitch's plan, a shared room
    reaching up) are found."""
    graph = {
        "ckpt_tools.ops.inspect.tables": {"ckpt_tools.ops.probe.families", "ckpt_tools.ops.shared.compare"},
        "ckpt_tools.ops.probe.probe": {"ckpt_tools.ops.stitch.plan", "ckpt_tools.ops.probe.load"},
        "ckpt_tools.ops.check.validate": {"ckpt_tools.ops.writing.carry"},
        "ckpt_tools.ops.writing.execute": {"ckpt_tools.ops.check.validate"},
    }
    assert _room_violations(graph) == ["ckpt_tools.ops.check.validate -> ckpt_tools.ops.writing.carry",
                                       "ckpt_tools.ops.inspect.tables -> ckpt_tools.ops.probe.families",
                                       "ckpt_tools.ops.probe.probe -> ckpt_tools.ops.stitch.plan"]


def test_every_verb_has_a_room():
    """Each CLI command is run by a module of its name in a verb room (or the check room, which verbs share)."""
    from ckpt_tools.cli import app

    run_by = {"unfuse-experts": "fuse_experts", "demo": "extract"}  # demo runs inspect, validate and extract
    commands = {c.name for c in app.registered_commands if c.name}
    modules = {m.rpartition(".")[2] for m in _graph() if _room(m) in VERB_ROOMS | {"check"}}
    homeless = sorted(c for c in commands if run_by.get(c, c.replace("-", "_")) not in modules)
    assert homeless == []
