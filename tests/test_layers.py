"""The packages' dependency order holds: import-linter's contracts in pyproject.toml (docs/design.md,
"Layers"), function-level imports included, checked on every test run."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports")


def lint(cwd: Path, *env_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(Path(LINT).parent), **({"PYTHONPATH": ":".join(map(str, env_path))} if env_path else {})}
    return subprocess.run([LINT, "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(autouse=True)
def _linter() -> None:
    if LINT is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' installs import-linter")


def test_every_import_contract_is_kept():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in proc.stdout


def test_an_import_inside_a_function_that_climbs_a_layer_breaks_the_contract(tmp_path: Path):
    """The hand-written cycle test this replaced read module-level imports only: a lazy import back
    up (``--mode dp`` reaching from the launcher into the baseline) went unseen."""
    package = tmp_path / "toy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "high.py").write_text("from toy import low\n")
    (package / "low.py").write_text(textwrap.dedent("""
        def lazy():
            from toy import high  # up a layer, only when called
            return high
    """))
    (tmp_path / ".importlinter").write_text(textwrap.dedent("""
        [importlinter]
        root_package = toy

        [importlinter:contract:layers]
        name = toy in layers
        type = layers
        containers = toy
        layers =
            high
            low
    """))
    proc = lint(tmp_path, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "toy.low -> toy.high (l.3)" in proc.stdout
