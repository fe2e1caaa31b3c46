"""Waiting for something with a deadline: never a bare sleep, never a wait that ends silently."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEADLINE_S = 90.0
"""Generous bound for anything a test waits for: on a loaded 2-core machine, never a timing claim."""


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S, poll_s: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy and return that; fail naming ``what`` at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def port_from_file(port_file: Path, proc: subprocess.Popen, log: Path | None = None,
                   timeout_s: float = DEADLINE_S) -> int:
    """The port a child started with ``--port-file port_file`` listens on, once it has written it; fail,
    with the end of ``log``, if the child exits first or the deadline passes."""

    def written() -> str:
        return port_file.exists() and port_file.read_text().strip() or ""

    wait_for(lambda: written() or proc.poll() is not None, f"the port file {port_file.name}", timeout_s)
    if not written():
        said = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
        raise AssertionError(f"the process exited with {proc.returncode} before writing {port_file}\n{said}")
    return int(written())
