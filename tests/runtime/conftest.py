"""Fixtures for runtime tests: child processes and in-process synchronizers, always cleaned up."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from ddiloco.testing import InProcessSync, Procs


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    logs = tmp_path / "logs"
    logs.mkdir()
    p = Procs(logs)
    try:
        yield p
    finally:
        p.kill_all()


@pytest.fixture
def inproc_sync() -> Iterator[Callable[..., InProcessSync]]:
    started: list[InProcessSync] = []

    def start(config: Any, options: Any = None) -> InProcessSync:
        from ddiloco.runtime.sync.service import ServiceOptions

        s = InProcessSync(config, options or ServiceOptions())
        started.append(s)
        return s

    try:
        yield start
    finally:
        for s in started:
            s.close()
