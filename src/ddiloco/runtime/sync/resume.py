"""``--resume``'s choices, apart from the state directory's code (torch), so that ``ddiloco sync``
checks its command line, and refuses a bad one in one line, without importing torch."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESUMED_KEYS = (("run", "learners", "--learners"), ("run", "tokens", "--tokens"), ("run", "time_s", "--time"))
"""What a resumed run may change of the run it continues, each with the option that changes it: said, not
refused (a run continues with more or fewer learners, or a longer budget, by design)."""


class Resume(enum.Enum):
    """What a synchronizer does with the run's state in its state directory.

    A restart after a crash must resume, and a first start must not overwrite another run; a
    ``--resume`` that found nothing used to start a new run quietly, so a wrong path (a typo, a
    volume not mounted) began training from scratch beside the real state. Deploy scripts that
    run one command line for both the first start and every restart say so:
    :attr:`IF_PRESENT`."""

    NEW_RUN = "new run"
    """Start a run: a directory that holds one is refused (``ddiloco sync`` without ``--resume``)."""
    REQUIRED = "required"
    """Continue the run in the directory; none there is an error (``--resume``)."""
    IF_PRESENT = "if present"
    """Continue the run in the directory if it holds one, else start one (``--resume-if-present``)."""


def changed_on_resume(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What the command line changes of the run it resumes (``saved``, ``now``: configurations as dicts),
    one phrase each: ``--resume --learners 3`` on a run of 2 learners was accepted silently (issue 57)."""
    return [f"{option} {now[section][key]} (the run had {saved[section][key]})"
            for section, key, option in RESUMED_KEYS
            if key in saved.get(section, {}) and key in now.get(section, {})
            and saved[section][key] != now[section][key]]


def holds_no_run(path: Path) -> str:
    """The one line for a state directory that holds no run's state, wherever it is found out (``ddiloco
    export`` before it imports torch for an empty one: 1.4 s of CPU for this line, issue 57)."""
    return (f"{str(path)!r} holds no run (no checkpoint, no round log): give the --state-dir of `ddiloco sync`, "
            "or runs/<mode>/sync-state of a --runtime processes run")


def surely_empty(path: Path) -> bool:
    """``path`` is no directory, or one with nothing in it but a synchronizer's lock: no run for sure,
    found out without the state directory's code (torch)."""
    return not path.is_dir() or all(entry.name == "lock" for entry in path.iterdir())
