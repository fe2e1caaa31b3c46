"""``ddiloco launch``'s supervisor: a synchronizer and M copies of the user's script, kept running.

The children are :class:`~ddiloco.runtime.launch.processes.Processes` (they die with the
launcher, even on ``kill -9``; Ctrl-C at the terminal reaches only the launcher, which stops
them in order). Whether a copy ever joined the run is what the synchronizer's status says:
one that ended before is a broken script or command line (refused in one line, exit 2:
restarting it cannot help); one that crashed after is started again under its id, and rejoins
the run as itself. No torch here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime import script_env
from ddiloco.runtime.launch.child import EXEC
from ddiloco.runtime.launch.command_lines import SyncLine
from ddiloco.runtime.launch.local_run import (
    LEAVE_TIMEOUT_S,
    POLL_S,
    StartFailed,
    Synchronizers,
    announce,
    fresh_logs,
    learner_names,
    learner_threads,
)
from ddiloco.runtime.launch.placement import Placement
from ddiloco.runtime.launch.processes import Processes, StopSignals

if TYPE_CHECKING:
    from ddiloco.runtime.client import SyncClient

SYNC = "sync"
STATE_DIR = "sync-state"
"""The synchronizer's --state-dir, under the launch's output directory."""
PORT_FILE = "sync.port"
"""The synchronizer's gRPC port while the run goes (``ddiloco status 127.0.0.1:$(cat OUT/sync.port)``),
under the launch's output directory; removed when the launch ends."""
STOPPED = 130
FAILED = 1


class Launch:
    """One launched run: start with ``with``, then :meth:`run` until it ends; every child is
    killed when the block is left, whatever happened."""

    def __init__(self, out: Path, command: list[str], learners: int, sync: SyncLine, *,
                 token: str | None = None, max_restarts: int = 3) -> None:
        self.out = out
        self.new_out = not out.exists()
        self.state_dir = out / STATE_DIR
        self.new_state = not self.state_dir.exists()
        self.port_file = out / PORT_FILE
        self.procs = Processes(fresh_logs(out))
        self.command = command
        self.names = learner_names(learners)
        self.syncs = Synchronizers([replace(sync, port_file=self.port_file)], Placement(None, None), self.procs,
                                   pages=False)
        """The synchronizer (on loopback; its status page only where ``sync`` names one)."""
        self.token = token if token is not None else os.environ.get(script_env.TOKEN) or None
        self.max_restarts = max_restarts
        self.restarts = {name: 0 for name in self.names}
        self.joined: set[str] = set()
        self.exited: dict[str, int] = {}
        """Copies that ended for good (the run finished, or they did), with their exit codes."""
        self.late: set[str] = set()
        """Copies still starting when the run's budget was spent, stopped by the launcher: not failures
        (a copy slow to start on a busy machine finds the run over; the others spent the budget)."""
        self._stop = StopSignals()
        self._echoed = {name: 0 for name in self.names}
        """How much of each learner's log is already on the launcher's stdout."""
        self._refusals_told: dict[str, tuple[int, float]] = {}
        """Per learner id: how many refusals that threw work away were announced, and when."""

    def __enter__(self) -> "Launch":
        self._stop.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            self.procs.close()
            self.port_file.unlink(missing_ok=True)  # the port of a synchronizer that is gone
            if kind is not None and issubclass(kind, ConfigError):
                self._forget()
        finally:
            self._stop.__exit__(kind, *exc)

    def _forget(self) -> None:
        """A launch refused leaves nothing behind that it made (docs/operations.md): no run (the
        state directory), no logs, and no output directory where there was none."""
        if self.new_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        if self.new_out:
            shutil.rmtree(self.out, ignore_errors=True)

    def run(self) -> int:
        """Start everything, supervise until the run ends; the run's exit code."""
        from ddiloco.runtime.client import SyncClient

        address = self._start_sync()
        announce(f"launch: synchronizer at {address}, {len(self.names)} x `{shlex.join(self.command)}`; "
                 f"logs in {self.procs.logs}/"
                 + ("" if self.syncs.http_ports[0] is None else f"; status page at {self.syncs.status_url()}"))
        threads = learner_threads(len(self.names))
        for i, name in enumerate(self.names):
            self._start_learner(name, i, address, threads)
        with SyncClient(address, token=self.token) as client:
            return self._supervise(client, address, threads)

    def _start_sync(self) -> str:
        try:
            (address,) = self.syncs.start_all(self._stop)
        except StartFailed:
            raise ConfigError(f"the synchronizer did not start: {self._last_line(SYNC)}") from None
        return address

    def _start_learner(self, name: str, index: int, address: str, threads: int) -> None:
        variables = {script_env.CONNECT: address, script_env.LEARNER_ID: name, script_env.DATA_SHARD: str(index),
                     script_env.DATA_SHARDS: str(len(self.names)), "OMP_NUM_THREADS": str(threads),
                     **({script_env.TOKEN: self.token} if self.token else {})}
        self.procs.start(name, self.command, env=variables, module=EXEC)

    def _supervise(self, client: SyncClient, address: str, threads: int) -> int:
        try:
            return self._watch(client, address, threads)
        finally:
            self._echo()

    def _echo(self) -> None:
        """What the copies wrote since last time, on stdout, each line after its learner's name (as
        ``torchrun`` shows its workers'); the whole of it stays in their logs."""
        for name in self.names:
            try:
                with open(self.procs.logs / f"{name}.log", "rb") as log:
                    log.seek(self._echoed[name])
                    data = log.read()
            except OSError:
                continue
            whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for its end
            self._echoed[name] += len(whole)
            for line in whole.decode(errors="replace").splitlines():
                print(f"{name}: {line}", flush=True)

    def _watch(self, client: SyncClient, address: str, threads: int) -> int:
        finished = False
        ended_at: float | None = None
        while True:
            self._echo()
            if self._stop.requested is not None:
                announce(f"launch: {self._stop.requested.name}: stopping the learners, then the synchronizer")
                self.procs.stop_all(self.names, LEAVE_TIMEOUT_S)
                self.procs.stop_all([SYNC], LEAVE_TIMEOUT_S)
                return STOPPED
            sync_code = self.procs.children[SYNC].poll()
            finished = finished or self._finished(client)
            if finished and ended_at is None:
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > LEAVE_TIMEOUT_S:
                self.late |= {n for n in self.names if n not in self.joined and self.procs.running(n)}
                self.procs.stop_all(self.names, LEAVE_TIMEOUT_S)  # told to leave, still there
            for i, name in enumerate(self.names):
                if name in self.exited or self.procs.running(name):
                    continue
                code = self.procs.children[name].returncode
                if name not in self.joined and not finished:
                    finished = self._finished(client)  # it may have joined and left since, or the run just ended
                if name not in self.joined and not finished and self.restarts[name] == 0:
                    raise ConfigError(f"{name}: `{shlex.join(self.command)}` exited with code {code} before it "
                                      f"joined the run (LearnerRuntime.from_env?): {self._last_line(name)}")
                if code == 0 or finished or sync_code is not None:
                    self.exited[name] = code
                elif self.restarts[name] >= self.max_restarts:
                    announce(f"launch: {name} exited with code {code} {self.restarts[name] + 1} times: giving up "
                             f"on it: {self._last_line(name)}")
                    self.exited[name] = code
                else:
                    self.restarts[name] += 1
                    announce(f"launch: {name} exited with code {code}: starting it again "
                             f"({self.restarts[name]} of {self.max_restarts} restarts)")
                    self._start_learner(name, i, address, threads)
            if len(self.exited) == len(self.names):
                return self._end(finished)
            if sync_code is not None and not finished:
                announce(f"launch: the synchronizer exited with code {sync_code}: {self._last_line(SYNC)}")
                self.procs.stop_all(self.names, LEAVE_TIMEOUT_S)
                return FAILED
            time.sleep(POLL_S)

    def _finished(self, client: SyncClient) -> bool:
        """Is the run over? ``--exit-when-finished``: the synchronizer exits 0 once the budget is spent and merged."""
        return self.procs.children[SYNC].poll() == 0 or self._read_status(client)

    def _read_status(self, client: SyncClient) -> bool:
        """Note which learners the synchronizer has seen; whether the run is finished."""
        from ddiloco.runtime.client import CallRefused, Unreachable

        try:
            status = client.status_dict()
        except (Unreachable, CallRefused):
            return False
        self.joined |= {lr["id"] for lr in status["learners"]}
        self._tell_refusals(status["learners"])
        return bool(status["finished"])

    def _tell_refusals(self, learners: list[dict]) -> None:
        """Say on the launcher's output when the synchronizer threw away a copy's work (issue 57: an honest
        learner's contributions were refused and only the synchronizer's log said so): at the first
        refusal, then at most every ``REPEAT_EVERY_S`` while more come, with the totals by reason."""
        from ddiloco.core.sync_side.refusals import lost_total
        from ddiloco.runtime.learner.repeats import REPEAT_EVERY_S

        now = time.monotonic()
        for lr in learners:
            name, refused, steps = lr["id"], lr.get("refused", {}), lr.get("refused_steps", {})
            count, (told, told_at) = lost_total(refused), self._refusals_told.get(lr["id"], (0, -REPEAT_EVERY_S))
            if count > told and now - told_at >= REPEAT_EVERY_S:
                self._refusals_told[name] = (count, now)
                reasons = ", ".join(f"{reason} {n} ({steps.get(reason, 0):,} steps)" for reason, n in refused.items()
                                    if lost_total({reason: n}))
                announce(f"launch: the synchronizer refused {count} of {name}'s contributions, its work thrown away: "
                         f"{reasons}; why: its log ({self.procs.logs}/{name}.log) and the synchronizer's "
                         f"({self.procs.logs}/{SYNC}.log)")

    def _end(self, finished: bool) -> int:
        """Every copy ended: the synchronizer exits by itself once the run is finished (else it is stopped)."""
        sync = self.procs.children[SYNC]
        if finished:
            try:
                sync.wait(LEAVE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass  # stopped below
        self.procs.stop_all([SYNC], LEAVE_TIMEOUT_S)
        failed = {name: code for name, code in self.exited.items() if code != 0 and name not in self.late}
        if self.late:
            announce(f"launch: {', '.join(sorted(self.late))} never joined: the run's budget was spent before "
                     "it reached the synchronizer (stopped)")
        if failed:
            announce(f"launch: {', '.join(f'{n} exited with code {c}' for n, c in failed.items())}")
        if not finished:
            announce("launch: every learner ended before the run's budget was spent")
        return 0 if finished and not failed and sync.returncode == 0 else FAILED

    def _last_line(self, name: str) -> str:
        """The last line its log holds, for a one-line error (without a ``ddiloco: error:`` of its own)."""
        lines = [line for line in self.procs.tail(name, 5).splitlines() if line.strip()]
        return lines[-1].strip().removeprefix("ddiloco: error: ") if lines else \
            f"(nothing in {self.procs.logs}/{name}.log)"
