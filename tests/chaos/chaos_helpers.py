"""Helpers for chaos tests: every process of a session, to prove none is left behind."""

from __future__ import annotations

import os
from pathlib import Path


def session_pids(session: int) -> set[int]:
    """Live processes whose session id is ``session`` (a child started with start_new_session leads one)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        state, sid = fields[0], int(fields[3])
        if sid == session and state != "Z":
            pids.add(int(stat.parent.name))
    return pids - {os.getpid()}


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` (R, S, T for stopped, ...), or "" once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rindex(")") + 2]
