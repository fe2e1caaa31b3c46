"""Which results files were measured under the protocol decisions that ship, and which predate them.

Every figure in README.md and docs/ comes from a file under docs/results/ that names the
commit it was measured at and, since issue 54, the behaviour fingerprint of that tree
(:mod:`stamp`, ``ddiloco fingerprint``). A file with a fingerprint is *current* when it is the
tree's: the protocol decides alike in the fingerprint's worlds. A file without one (measured
before fingerprints) is current only when no commit after it touched ``src/ddiloco/core/``.
Run it before a release, or after a change to the protocol, to see which figures need
measuring again (``benchmarks/refresh.py``) and which documents cite them:

    python benchmarks/results_age.py            # a table, stale files first
    python benchmarks/results_age.py --stale    # only the stale ones; exit 1 if there are any

A file that keeps the figures of earlier code on purpose, cited as "before" (a bug's
demonstration, an experiment not kept), says so with a top-level ``"history"`` key giving
why; it is listed as history, not stale.

Drivers, benchmarks and the workload change figures too (a benchmark's settings, the
learner's speed); this only answers for the core, which every benchmark shares.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
CORE = "src/ddiloco/core"
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


@dataclass
class Age:
    path: Path
    commits: list[str]      # every commit the file names (its rows may come from several)
    core_changes: int | None  # commits touching the core after the oldest of them; None: unknown
    cited_by: list[str]
    history: str | None     # why the file keeps earlier code's figures on purpose
    fingerprint: str | None = None  # the behaviour fingerprint it was measured at (None: before fingerprints)
    tree: str | None = None  # this tree's fingerprint (None: not computed)

    @property
    def current(self) -> bool:
        if self.fingerprint is not None and self.tree is not None:
            return self.fingerprint == self.tree
        return self.fingerprint is None and self.core_changes == 0

    @property
    def stale(self) -> bool:
        return self.history is None and not self.current


def named_commits(data: Any) -> list[str]:
    """The commits a results file names: its own stamp's, or its rows' (top level or ``runs``)."""
    rows = data.get("runs") if isinstance(data, dict) and isinstance(data.get("runs"), list) else []
    found: list[str] = []
    for item in [data, *rows]:
        if isinstance(item, dict) and isinstance(item.get("commit"), str):
            found += [c for c in COMMIT.findall(item["commit"]) if c not in found]
    return found


def git(*args: str) -> str | None:
    result = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def core_changes_since(commits: list[str]) -> int | None:
    """Commits that touched the core after any of ``commits`` (the most over them)."""
    counts = [git("rev-list", "--count", f"{c}..HEAD", "--", CORE) for c in commits]
    if not counts or None in counts:
        return None
    return max(int(n) for n in counts if n is not None)


def fingerprints(data: Any) -> list[str]:
    """The behaviour fingerprints a results file names: its stamp's, or its rows' (top level or ``runs``)."""
    rows = data.get("runs") if isinstance(data, dict) and isinstance(data.get("runs"), list) else []
    return sorted({item["fingerprint"] for item in [data, *rows]
                   if isinstance(item, dict) and isinstance(item.get("fingerprint"), str)})


def ages(tree: str | None = None) -> list[Age]:
    """Every results file; ``tree``: this tree's fingerprint, to judge the files that carry one."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = {d.relative_to(ROOT).as_posix(): d.read_text() for d in docs}
    out = []
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        commits = named_commits(data)
        cited = [name for name, text in texts.items() if path.name in text]
        history = data.get("history") if isinstance(data, dict) else None
        marks = fingerprints(data)
        mark = marks[0] if len(marks) == 1 else ("several" if marks else None)
        out.append(Age(path, commits, core_changes_since(commits), cited, history, mark, tree))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stale", action="store_true", help="list only the stale files; exit 1 if any")
    args = parser.parse_args(argv)
    from stamp import tree_fingerprint

    tree = tree_fingerprint()
    rows = sorted(ages(tree), key=lambda a: (not a.stale, a.history is not None, a.path.name))
    if args.stale:
        rows = [a for a in rows if a.stale]
    table = Table(title=f"results files against this tree's fingerprint {tree} and the last change to {CORE} "
                        f"({git('log', '-1', '--format=%h', '--', CORE)})")
    for column in ("file", "measured at", "fingerprint", "core changes since", "cited by"):
        table.add_column(column)
    for a in rows:
        since = "unknown" if a.core_changes is None else str(a.core_changes)
        state = "current" if a.current else "stale"
        if a.history is not None:
            state = f"history ({state})"
        table.add_row(a.path.name, ", ".join(a.commits) or "none named", f"{a.fingerprint or 'none'}: {state}", since,
                      ", ".join(a.cited_by) or "-")
    Console(width=160).print(table)
    return 1 if args.stale and rows else 0


if __name__ == "__main__":
    sys.exit(main())
