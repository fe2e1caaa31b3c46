"""Test-suite-wide settings, and the fixtures of child processes and in-process synchronizers
(always cleaned up) that tests in every folder use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.testing import InProcessSync, Procs


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread: tests share 2 cores with each other's learner processes, and a
    2-thread torch slows down many times over when another process takes a core."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


UNMARKED_SLOW_S = 5.0
"""A test that takes longer than this without ``@pytest.mark.slow`` keeps the quick check
(``-m "not slow"``, README) from being quick: the suite names it at its end."""


def pytest_terminal_summary(terminalreporter) -> None:
    """Name the unmarked tests that took longer than :data:`UNMARKED_SLOW_S` (setup, call and
    teardown together), slowest first: they belong under ``@pytest.mark.slow``. Only said, never
    a failure: a duration depends on the machine and its load."""
    took: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) and "slow" not in getattr(report, "keywords", {}):
                took[report.nodeid] = took.get(report.nodeid, 0.0) + getattr(report, "duration", 0.0)
    unmarked = sorted(((s, nodeid) for nodeid, s in took.items() if s > UNMARKED_SLOW_S), reverse=True)
    if unmarked:
        terminalreporter.section(f"unmarked tests over {UNMARKED_SLOW_S:g} s (mark them slow)")
        for seconds, nodeid in unmarked:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")


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
