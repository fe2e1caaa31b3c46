"""The source tree keeps the shape docs/design.md describes: one protocol core that imports no
driver, two drivers that do not import each other, analytic models apart from the simulator,
and no import cycle anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def import_graph() -> dict[str, set[str]]:
    """Module -> the ddiloco modules it imports (TYPE_CHECKING imports included: a cycle is a cycle)."""
    modules = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddiloco"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("ddiloco")}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_core_imports_no_driver_and_the_drivers_not_each_other():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("ddiloco.core."):
            assert not {d for d in deps if not d.startswith(("ddiloco.core.", "ddiloco.errors"))}, name
        if name.startswith("ddiloco.runtime."):
            assert not {d for d in deps if d.startswith("ddiloco.sim.")}, name
        if name.startswith("ddiloco.sim."):
            assert not {d for d in deps if d.startswith("ddiloco.runtime.")}, name


def test_the_analytic_models_and_the_simulator_do_not_import_each_other():
    """``scale/`` models what no machine runs and ``sim/`` runs the protocol: a model that
    borrowed the simulator's code (or the reverse) could no longer be checked against it."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("ddiloco.sim."):
            assert not {d for d in deps if d.startswith("ddiloco.scale")}, name
        if name.startswith("ddiloco.scale."):
            assert not {d for d in deps if d.startswith("ddiloco.sim")}, name


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
