"""Every package's docstring is the map of that package: a line for each of its modules and
subpackages, checked against the tree (the core's tables are docs/design.md's, checked by
``tests/test_layout.py``; ``runtime/proto`` is protoc's output)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "src" / "ddiloco"
SKIPPED = ("core", "runtime/proto")
"""The core's module tables are in docs/design.md; ``runtime/proto`` is generated."""

MOD = re.compile(r":mod:`~?(\.?[A-Za-z_][\w.]*)`")


def packages() -> list[Path]:
    """Every package under src/ddiloco (not the root) whose docstring must list its modules."""
    found = []
    for init in sorted(ROOT.rglob("__init__.py")):
        relative = init.parent.relative_to(ROOT).as_posix()
        if init.parent == ROOT or any(relative == s or relative.startswith(s + "/") for s in SKIPPED):
            continue
        found.append(init.parent)
    return found


def dotted(path: Path) -> str:
    return ".".join(("ddiloco", *path.relative_to(ROOT).with_suffix("").parts))


def named(package: Path) -> set[str]:
    """The ddiloco modules a package's docstring names, dotted (``:mod:`.x``` is ``x`` of this package)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    names = {f"{dotted(package)}{name}" if name.startswith(".") else name for name in MOD.findall(doc)}
    return {name for name in names if name == "ddiloco" or name.startswith("ddiloco.")}


def exists(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_package_docstring_names_every_module_and_subpackage(package):
    """A module added without its line fails here, naming it."""
    own = {dotted(p) for p in package.glob("*.py") if p.name != "__init__.py"}
    own |= {dotted(p.parent) for p in package.glob("*/__init__.py")}
    assert sorted(own - named(package)) == []


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_a_package_docstring_names_exists(package):
    """A module moved or deleted leaves its line behind: it fails here, naming it."""
    assert sorted(n for n in named(package) if not exists(n)) == []


def test_the_check_sees_the_packages():
    """A glob gone wrong would check nothing and pass."""
    names = {p.relative_to(ROOT).as_posix() for p in packages()}
    assert {"sim", "chaos", "runtime", "runtime/sync", "runtime/learner", "testing"} <= names
    assert not {n for n in names if n == "core" or n.startswith(("core/", "runtime/proto"))}
