"""The command lines the tests and benchmarks start, ``ddiloco sync``'s from the launchers' own
:class:`~ddiloco.runtime.launch.command_lines.SyncLine`."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from ddiloco.runtime.launch.command_lines import SyncLine


def ddiloco_argv(*args: str) -> list[str]:
    """``ddiloco ARGS`` run by this interpreter (the installed entry point need not be on ``PATH``)."""
    return [sys.executable, "-m", "ddiloco.cli", *args]


def sync_argv(*extra: str, preset: str | None = "tiny", listen: str = "127.0.0.1:0", learners: int | None = None,
              tokens: int | None = None, init: Path | None = None, port_file: Path | None = None,
              state_dir: Path | None = None, http_port: int | None = None, sets: Iterable[str] = (),
              log_level: str | None = None) -> list[str]:
    """``ddiloco sync`` (the words after ``ddiloco``): ``preset`` (None: no preset, for ``extra`` to name
    a ``--config``), listening on ``listen`` (port 0: any free port, written to ``port_file``), each of
    ``sets`` a ``--set`` override; ``extra`` last, so that it overrides the rest."""
    return SyncLine(listen=listen, preset=preset, learners=learners, tokens=tokens, init=init, port_file=port_file,
                    state_dir=state_dir, http_port=http_port, sets=tuple(sets), log_level=log_level).words(*extra)


SHORT_LEASES = ("protocol.lease_s=2.0", "protocol.heartbeat_s=0.3")
"""Leases short enough that a test sees a dead learner dropped within seconds."""


def sync_args(port: int, *extra: str, learners: int = 2) -> list[str]:
    """A tiny-preset synchronizer on 127.0.0.1:``port`` with short leases, logging at info, for tests."""
    return sync_argv(*extra, listen=f"127.0.0.1:{port}", learners=learners, sets=SHORT_LEASES, log_level="info")


def learner_args(port: int, name: str, *extra: str) -> list[str]:
    """``ddiloco learner`` of the reference workload named ``name``, one thread, on 127.0.0.1:``port``."""
    return ["learner", "--connect", f"127.0.0.1:{port}", "--id", name, "--threads", "1", *extra]
