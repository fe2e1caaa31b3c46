"""Where a results file under docs/results/ comes from: commit, behaviour fingerprint, command,
date, machine, load.

Every benchmark that writes a results file starts it with :func:`stamp`, taken when the
measurement starts (a commit made while a long run was under way is not the code it ran).
The load average is written again at the end by the benchmarks that run for minutes. The
fingerprint (``ddiloco fingerprint``, :mod:`ddiloco.sim.behaviour_fingerprint`) says which protocol decisions
the figures were measured under: a later tree with the same fingerprint decides alike, so its
figures still hold (``benchmarks/results_age.py``, ``tests/test_results_fingerprint.py``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stamp(script: str, argv: list[str] | None = None) -> dict:
    """``script``: the benchmark's ``__file__``; ``argv``: its arguments (default: the command line's)."""
    args = sys.argv[1:] if argv is None else argv
    return {"commit": _commit(),
            "fingerprint": tree_fingerprint(),
            "command": " ".join(["python", f"benchmarks/{Path(script).name}", *args]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": f"{os.cpu_count()} cores, "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
            "load": load_now()}


@functools.cache
def tree_fingerprint() -> str:
    """This tree's behaviour fingerprint (a few seconds, once per process)."""
    from ddiloco.sim.behaviour_fingerprint import fingerprint

    return fingerprint()[0]


def _commit() -> str:
    """The checkout's commit; on a machine given a copy of the tree without git (a device
    machine), say so: the caller's command names the commit it sent."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "src"],
                               capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return "unknown (no git here)"
    return (commit or "unknown (not a git checkout)") + ("+uncommitted changes in src/" if dirty else "")


def load_now() -> list[float]:
    """The 1-, 5- and 15-minute load averages, as every results file writes them."""
    return [round(x, 2) for x in os.getloadavg()]
