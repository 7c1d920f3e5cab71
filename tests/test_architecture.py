"""The package's imports run one way, from the Lightning layer down to the pure core, with no circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"

#: Layers from the bottom up: a module may import its own layer or any below it, never above.
LAYERS = ("schedules", "core", "runtime", "planning", "lightning")
#: Entry points above every layer: the public API, the CLI's ``-m`` name, the deprecated paths.
ENTRY_POINTS = {"lightning_pipe", "lightning_pipe.plan", "lightning_pipe._deprecated"}


def module_name(path: Path) -> str:
    """``lightning_pipe/runtime/engine.py`` -> ``lightning_pipe.runtime.engine`` (a package by its ``__init__``)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere in it (lazy imports included): a name taken
    from a package is an edge to that package's submodule when one has that name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or {node.module}
            if len(subs) < len(node.names):
                found.add(node.module)
    return found - {module_name(path)}


def package_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def layer(module: str) -> int:
    """The layer's index in :data:`LAYERS` (entry points above all of them)."""
    if module in ENTRY_POINTS:
        return len(LAYERS)
    top = module.split(".")[1]
    if top not in LAYERS:
        raise AssertionError(f"{module} is in no layer: put it under one of {LAYERS}")
    return LAYERS.index(top)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every ``(importer, imported)`` where the imported module sits in a higher layer."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer(b) > layer(a))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each is a circle.

    A package's ``__init__`` re-exporting its submodules is not a circle by itself; it is one only
    when a submodule takes a name from that ``__init__`` while it imports them.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports(package_graph()) == []


def test_no_import_circle() -> None:
    assert circles(package_graph()) == []


def test_every_module_sits_in_a_layer() -> None:
    for module in package_graph():
        layer(module)


def test_the_checks_find_a_circle_and_an_upward_import() -> None:
    graph = {
        "lightning_pipe.planning.a": {"lightning_pipe.planning.b"},
        "lightning_pipe.planning.b": {"lightning_pipe.planning.c"},
        "lightning_pipe.planning.c": {"lightning_pipe.planning.a", "lightning_pipe.lightning.strategy"},
        "lightning_pipe.lightning.strategy": {"lightning_pipe.core.topology"},
        "lightning_pipe.core.topology": set(),
    }
    assert circles(graph) == [["lightning_pipe.planning.a", "lightning_pipe.planning.b", "lightning_pipe.planning.c"]]
    assert upward_imports(graph) == [("lightning_pipe.planning.c", "lightning_pipe.lightning.strategy")]


def test_imports_are_read_from_lazy_imports_and_submodules() -> None:
    graph = package_graph()
    # a function-level import counts: the profiler times the executor's handlers
    assert "lightning_pipe.runtime.executor" in graph["lightning_pipe.planning.profiler"]
    # "from lightning_pipe.runtime.comm import p2p" is an edge to the submodule, not the package
    assert "lightning_pipe.runtime.comm.p2p" in graph["lightning_pipe.runtime.engine"]
