"""Which results files were measured on the protocol core that ships, and which predate it.

Every figure in README.md and docs/ comes from a file under docs/results/ that names the
commit it was measured at (:mod:`stamp`). A file is *current* when no commit after it
touched ``src/ddiloco/core/``: the protocol decisions that shape every figure. Run it
before a release, or after a change to the core, to see which figures need measuring again
and which documents cite them:

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

    @property
    def stale(self) -> bool:
        return self.history is None and self.core_changes != 0


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


def ages() -> list[Age]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = {d.relative_to(ROOT).as_posix(): d.read_text() for d in docs}
    out = []
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        commits = named_commits(data)
        cited = [name for name, text in texts.items() if path.name in text]
        history = data.get("history") if isinstance(data, dict) else None
        out.append(Age(path, commits, core_changes_since(commits), cited, history))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stale", action="store_true", help="list only the stale files; exit 1 if any")
    args = parser.parse_args(argv)
    rows = sorted(ages(), key=lambda a: (not a.stale, a.history is not None, a.path.name))
    if args.stale:
        rows = [a for a in rows if a.stale]
    table = Table(title=f"results files against the last change to {CORE} "
                        f"({git('log', '-1', '--format=%h', '--', CORE)})")
    for column in ("file", "measured at", "core changes since", "cited by"):
        table.add_column(column)
    for a in rows:
        since = "unknown" if a.core_changes is None else ("current" if a.core_changes == 0 else str(a.core_changes))
        if a.history is not None:
            since = f"history ({since})"
        table.add_row(a.path.name, ", ".join(a.commits) or "none named", since, ", ".join(a.cited_by) or "-")
    Console(width=160).print(table)
    return 1 if args.stale and rows else 0


if __name__ == "__main__":
    sys.exit(main())
