"""A process's own count of its steps, in a small JSON file its launcher reads.

A learner's steps per second cannot be read from the synchronizer: it counts the tokens of
contributions it accepted, and a learner whose contributions are refused (or never arrive
over a starved link) trains on at full speed while its count stands still. So each learner
process (``ddiloco learner --progress-file``) and each data-parallel rank writes what it
did itself, atomically, about twice a second; the launcher's timeline and
``benchmarks/bench_wan.py`` read it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

WRITE_EVERY_S = 0.5


class ProgressFile:
    """Writes ``{"steps", "tokens", "time", "first_step_time", ...}`` to ``path`` (wall-clock times)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._last = 0.0
        self._first: float | None = None

    def due(self, steps: int) -> bool:
        """Whether :meth:`write` should be called now (at most every WRITE_EVERY_S); notes the first step."""
        now = time.time()
        if self._first is None and steps > 0:
            self._first = now
        return self.path is not None and now - self._last >= WRITE_EVERY_S

    def write(self, steps: int, tokens: int, **extra: Any) -> None:
        """Record ``steps`` done so far (and ``extra``), atomically."""
        if self.path is None:
            return
        now = self._last = time.time()
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"steps": steps, "tokens": tokens, "time": now, "first_step_time": self._first,
                                   **extra}))
        os.replace(tmp, self.path)


def read_progress(path: Path) -> dict[str, Any] | None:
    """The last progress written to ``path``, or None before the first write."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
