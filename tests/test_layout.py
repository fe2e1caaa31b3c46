"""The source tree keeps the shape docs/design.md describes: a core in three parts, packages
only at the root, the tables that map the tree, modules and functions of a readable size, every
deadline defined once. The arrows between packages are import-linter's (tests/test_layers.py)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


CORE_PARTS = ("learner_side", "sync_side", "shared")
"""``core/`` in three parts: what the learner decides, what the synchronizer decides, what both share
(that the two sides import neither each other nor any driver is import-linter's: tests/test_layers.py)."""


def test_the_core_is_three_parts():
    core = SRC / "ddiloco" / "core"
    assert {p.parent.name for p in core.glob("*/__init__.py")} == set(CORE_PARTS)
    assert sorted(p.name for p in core.glob("*.py")) == ["__init__.py"]


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


def test_no_two_classes_share_a_name():
    """The same reason: ``Link`` of the capped topology and ``Link`` of the virtual network read as one."""
    found = defaultdict(set)
    for path in hand_written():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found[node.name].add(path.relative_to(SRC).as_posix())
    assert {name: where for name, where in found.items() if len(where) > 1} == {}


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


def test_tests_and_benchmarks_import_helpers_never_a_test_file_nor_edit_sys_path():
    """What tests share lives in helper modules (``protocol_helpers.py``, ``ddiloco.testing``): a test file
    that imports another runs that file's module code and ties the two together; ``sys.path`` edits
    hide where an import comes from (pytest's ``pythonpath`` in pyproject.toml names the folders)."""
    root = SRC.parent
    found = []
    for path in sorted([*(root / "tests").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(root)} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                found.append(f"{path.relative_to(root)} uses sys.path")
    assert not found, found
