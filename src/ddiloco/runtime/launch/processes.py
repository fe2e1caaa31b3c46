"""The children of one local run, and how they end with it.

Every child of ``ddiloco run --runtime processes``, ``ddiloco chaos`` and the benchmarks
that launch real runs is started here, so all of them share two guarantees:

- **They die with their parent.** Each child starts through :mod:`ddiloco.runtime.launch.child`,
  which asks the kernel (``prctl(PR_SET_PDEATHSIG)``) for SIGKILL when the thread that
  started it ends, so ``kill -9`` of the launcher cannot orphan a learner or a
  synchronizer, nor leave a frozen (SIGSTOP) one behind (SIGKILL ends a stopped process;
  SIGTERM would wait for a SIGCONT that never comes). Children are started from the
  launcher's main thread, which lives as long as the launcher does.
- **They are stopped in order.** Each child leads its own process group, so Ctrl-C at a
  terminal (SIGINT to the foreground group) reaches only the launcher, which then stops
  learners first, reads the final model, and stops the synchronizer last (SIGTERM: its
  final checkpoint). :class:`StopSignals` turns SIGINT and SIGTERM into that request; a
  second signal stops at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ddiloco.core.shared.errors import DdilocoError


class Processes:
    """The children of one run; every one of them is killed on close, whatever happens.

    A name may be started again once its process has exited (a restart after a crash):
    its log file is appended to, so one file tells a learner's or synchronizer's whole story.
    ``ddiloco chaos`` kills, stops and restarts children through this table. ``prefix``
    goes before a child's command line (``ip netns exec NAME`` puts it in its network
    namespace: :mod:`ddiloco.runtime.launch.netns`).
    """

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children: dict[str, subprocess.Popen] = {}
        self._files: list[Any] = []
        self._signalled: set[str] = set()
        """Children this table sent a signal since their start: their exit is not a failure."""

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None, *,
              prefix: list[str] | None = None, module: str = "ddiloco.cli") -> subprocess.Popen:
        """Start ``python -m module *args`` as ``name`` (logging to ``logs/name.log``); ``module``
        :data:`~ddiloco.runtime.launch.child.EXEC` runs the command ``args`` itself."""
        previous = self.children.get(name)
        if previous is not None and previous.poll() is None:
            raise DdilocoError(f"{name} is still running (pid {previous.pid}): cannot start it again")
        log = open(self.logs / f"{name}.log", "ab")
        self._files.append(log)
        proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "ddiloco.runtime.launch.child", str(os.getpid()),
                                 module, *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, process_group=0)
        self.children[name] = proc
        self._signalled.discard(name)
        return proc

    def running(self, name: str) -> bool:
        proc = self.children.get(name)
        return proc is not None and proc.poll() is None

    def died(self, name: str) -> bool:
        """Whether ``name`` exited with an error that no signal of this table caused (a crash)."""
        proc = self.children.get(name)
        return proc is not None and proc.poll() not in (None, 0) and name not in self._signalled

    def signal(self, name: str, sig: signal.Signals) -> bool:
        """Send ``sig`` to ``name`` if it is running; SIGKILL also reaps it. Returns whether it was sent."""
        proc = self.children.get(name)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(sig)
        self._signalled.add(name)
        if sig is signal.SIGKILL:
            proc.wait()
        return True

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        """SIGTERM (after SIGCONT, in case it is frozen), then SIGKILL if it is still there after ``timeout_s``."""
        self.stop_all([name], timeout_s)

    def stop_all(self, names: list[str], timeout_s: float = 10.0) -> None:
        """Stop ``names`` together: SIGCONT and SIGTERM to each, then wait up to ``timeout_s`` for all."""
        procs = [self.children[n] for n in names if n in self.children and self.children[n].poll() is None]
        self._signalled.update(n for n in names if n in self.children)
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
                proc.wait()
        for f in self._files:
            f.close()


class StopSignals:
    """SIGINT and SIGTERM, while inside, ask the run to stop cleanly; a second one stops it at once.

    ``requested`` names the first signal (None until one came). Outside the main thread
    (where Python cannot install handlers) it does nothing and Ctrl-C raises as usual.
    """

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum)


def interruption(stop: StopSignals, done: float) -> dict[str, Any]:
    """What a summary says of a run a signal stopped: ``"interrupted": true`` and ``done`` (the share of
    the budget), as the virtual cluster's summary says it, and which ``signal`` it was (a run that
    finished: nothing). A run of real processes wrote ``"stopped": "SIGINT"`` instead: two names for
    one fact (issue 57)."""
    if stop.requested is None:
        return {}
    return {"interrupted": True, "done": round(done, 4), "signal": stop.requested.name}
