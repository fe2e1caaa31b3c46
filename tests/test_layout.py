"""The source tree keeps the shape docs/design.md describes: one protocol core that imports no
driver, two drivers that do not import each other, analytic models apart from the simulator,
and no import cycle anywhere."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
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
            assert not {d for d in deps if not d.startswith("ddiloco.core.")}, name
        if name.startswith("ddiloco.runtime."):
            assert not {d for d in deps if d.startswith("ddiloco.sim.")}, name
        if name.startswith("ddiloco.sim."):
            assert not {d for d in deps if d.startswith("ddiloco.runtime.")}, name


CORE_PARTS = ("learner_side", "sync_side", "shared")
"""``core/`` in three parts: what the learner decides, what the synchronizer decides, what both share."""


def test_the_core_is_three_parts_and_the_two_sides_do_not_import_each_other():
    """A learner-side rule that reached into the synchronizer's state (or the reverse) would be a
    protocol decision made with knowledge the deciding side does not have on the wire."""
    graph = import_graph()
    core = sorted(n for n in graph if n.startswith("ddiloco.core."))
    assert {n.split(".")[2] for n in core} == set(CORE_PARTS)
    for name in core:
        part = name.split(".")[2]
        others = {"learner_side": ("sync_side",), "sync_side": ("learner_side",),
                  "shared": ("learner_side", "sync_side")}[part]
        assert not {d for d in graph[name] if d.split(".")[2:3] and d.split(".")[2] in others
                    and d.startswith("ddiloco.core.")}, name


def test_the_package_root_holds_the_entry_point_and_packages_only():
    root = SRC / "ddiloco"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "cli.py"]


def design_tables() -> tuple[set[str], set[str]]:
    """The modules docs/design.md's module tables name (``core/shared/messages.py``), and the
    packages its package table names (``sim/``)."""
    text = (SRC.parent / "docs" / "design.md").read_text()
    modules = set(re.findall(r"^\| `((?:[a-z_]+/)+[a-z_]+\.py)` \|", text, flags=re.M))
    packages = set(re.findall(r"^\| `([a-z_]+(?:/[a-z_]+)*/)` \|", text, flags=re.M))
    return modules, packages


def test_docs_design_names_every_core_module_and_every_package():
    """The tables in docs/design.md ("The tree") are the newcomer's map: checked against the tree."""
    modules, packages = design_tables()
    root = SRC / "ddiloco"
    core = {p.relative_to(root).as_posix() for p in (root / "core").rglob("*.py") if p.name != "__init__.py"}
    assert {m for m in modules if m.startswith("core/")} == core
    assert all((root / m).is_file() for m in modules), sorted(m for m in modules if not (root / m).is_file())
    tree = {p.parent.relative_to(root).as_posix() + "/" for p in root.rglob("__init__.py") if p.parent != root}
    assert packages == tree


def test_the_analytic_models_and_the_simulator_do_not_import_each_other():
    """``scale/`` models what no machine runs and ``sim/`` runs the protocol: a model that
    borrowed the simulator's code (or the reverse) could no longer be checked against it."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("ddiloco.sim."):
            assert not {d for d in deps if d.startswith("ddiloco.scale")}, name
        if name.startswith("ddiloco.scale."):
            assert not {d for d in deps if d.startswith("ddiloco.sim")}, name


def shared_file_names() -> dict[str, set[str]]:
    """File name -> the modules under src/ddiloco that have it, where more than one does."""
    root = SRC / "ddiloco"
    paths = defaultdict(set)
    for path in root.rglob("*.py"):
        if path.name != "__init__.py":
            paths[path.name].add(path.relative_to(root).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_modules_share_a_file_name():
    """A name used twice sends a newcomer (and a grep, and a traceback) to the wrong file."""
    assert shared_file_names() == {}


MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400
GENERATED = SRC / "ddiloco" / "runtime" / "proto"
"""protoc's output: regenerated, never read as code, so its sizes are not ours to keep."""


def hand_written() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if GENERATED not in p.parents)


def test_no_function_is_over_80_lines():
    """A function longer than a screen has seams; named helpers say what each part is for."""
    long = []
    for path in hand_written():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_no_module_is_over_400_lines():
    """A module that long does more than one thing, or does one thing too many ways."""
    long = [f"{p.relative_to(SRC)} ({n} lines)" for p in hand_written()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


DEADLINES = SRC / "ddiloco" / "core" / "shared" / "deadlines.py"
"""Every deadline of a call or a stream, for both drivers (issue 28: one upload had three)."""


def module_level_names(tree: ast.Module) -> set[str]:
    """What a module defines at its top level: constants, functions, classes."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def divides_by(tree: ast.AST, attribute: str) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and isinstance(n.right, ast.Attribute)
               and n.right.attr == attribute for n in ast.walk(tree))


def test_every_deadline_is_defined_once():
    """No other module defines a constant or a function of ``core/shared/deadlines.py`` again (the
    drivers import them), and none computes with the run's slowest link, the floor every
    synchronizer-side deadline allows (``bytes / protocol.min_link_bytes_per_s``)."""
    defined = module_level_names(ast.parse(DEADLINES.read_text()))
    assert {"call_deadline_s", "stream_deadline_s", "upload_pace_s", "admission_window_s",
            "CLIENT_ANSWER_S", "CLIENT_UPLOAD_BYTES_PER_S", "STREAM_SLACK_LEASES", "DRAIN_LEASES",
            "drain_after_stop_s"} <= defined
    again, floor = [], []
    for path in hand_written():
        if path == DEADLINES:
            continue
        tree = ast.parse(path.read_text())
        if twice := sorted(module_level_names(tree) & defined):
            again.append(f"{path.relative_to(SRC)}: {', '.join(twice)}")
        if divides_by(tree, "min_link_bytes_per_s"):
            floor.append(str(path.relative_to(SRC)))
    assert again == [] and floor == []
