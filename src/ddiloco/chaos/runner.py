"""Run a real cluster on this host and break it on schedule: the engine of ``ddiloco chaos``.

The processes are the launcher's (:mod:`ddiloco.runtime.launcher`): one ``ddiloco sync``
and M ``ddiloco learner`` processes, except that every learner reaches the synchronizer
through its own fault-injecting proxy (:mod:`ddiloco.chaos.proxy`). The tool only injects
faults and observes: who rejoins, when and how is the protocol core's business, and the
only way the tool learns about it is the synchronizer's status, polled a few times a
second, and its log.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ddiloco.chaos.proxy import ProxyHost
from ddiloco.chaos.schedule import SYNC_TARGET, Fault, FaultKind, learner_name
from ddiloco.config import Config
from ddiloco.errors import DdilocoError
from ddiloco.runtime.client import Refused, Unreachable
from ddiloco.runtime.processes import Processes
from ddiloco.runtime.launcher import (GlobalEvaluator, RunFiles, free_port, learner_command,
                                      learner_threads, prepare_files, sync_command, wait_for_port)
from ddiloco.runtime.sharded import ShardedClient

POLL_S = 0.25
START_TIMEOUT_S = 180.0
"""From launch to the first join: imports, numba's cache and the corpus on a loaded 2-core box."""
FINISH_SLACK_S = 120.0
"""How long past its budget (plus the synchronizer's downtime) the run may take to finish."""


@dataclass
class FaultRecord:
    """A scheduled fault and what became of it (times in seconds after the first join)."""

    fault: Fault
    started_s: float | None = None
    ended_s: float | None = None
    skipped: str = ""
    """Why nothing was injected (the target was not running), else empty."""


@dataclass(frozen=True)
class Sample:
    """One poll of the synchronizer's status."""

    t_s: float
    """Seconds after the first join (negative before it)."""
    instance_id: str
    phase: str
    versions: tuple[int, ...]
    alive: dict[str, bool]
    tokens: int
    grace_window_s: float
    longest_pause_s: float
    rejections: dict[str, int]


@dataclass
class LiveState:
    """What the live view shows after each poll."""

    clock_s: float
    """The schedule's clock (seconds since the first join while the synchronizer was up)."""
    window_s: float
    run_s: float
    phase: str
    faults_so_far: collections.Counter
    active: list[str]
    max_version: int
    alive: int
    learners: int
    sync_up: bool
    longest_pause_s: float
    status_url: str


@dataclass
class SyncRestart:
    """One kill -9 of the synchronizer, and what the restarted one resumed from (times after the first join)."""

    killed_at_s: float
    versions_at_kill: tuple[int, ...]
    """Fragment versions at the last poll before the kill."""
    tokens_at_kill: int
    answering_at_s: float | None = None
    versions_resumed: tuple[int, ...] = ()
    """The checkpoint's versions, as the restarted synchronizer first reported them."""
    tokens_resumed: int = 0
    first_merge_after_s: float | None = None
    """From answering again to its first merge: the restart's own pause."""

    @property
    def rounds_lost(self) -> int:
        """Rounds merged after the last checkpoint: what docs/runtime.md says a crash loses."""
        return sum(max(0, a - b) for a, b in zip(self.versions_at_kill, self.versions_resumed))

    def to_dict(self) -> dict[str, Any]:
        return {"killed_at_s": round(self.killed_at_s, 2),
                "answering_at_s": None if self.answering_at_s is None else round(self.answering_at_s, 2),
                "first_merge_after_s": None if self.first_merge_after_s is None else round(self.first_merge_after_s, 2),
                "versions_at_kill": list(self.versions_at_kill), "versions_resumed": list(self.versions_resumed),
                "rounds_lost": self.rounds_lost, "tokens_at_kill": self.tokens_at_kill,
                "tokens_resumed": self.tokens_resumed}


@dataclass
class ChaosOutcome:
    """Everything a report needs; times in seconds after the first join."""

    completed: bool
    failure: str
    records: list[FaultRecord]
    samples: list[Sample]
    sync_restarts: list[SyncRestart]
    final_status: dict[str, Any]
    eval_loss: float | None
    wall_s: float
    sync_log: Path
    status_url: str
    proxy_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    connections_reset: int = 0

    @property
    def sync_down(self) -> list[tuple[float, float]]:
        """(killed, answering again) of every synchronizer kill; one still down at the end lasts to the end."""
        end_s = max([s.t_s for s in self.samples] + [0.0])
        return [(r.killed_at_s, r.answering_at_s if r.answering_at_s is not None else end_s)
                for r in self.sync_restarts]

    @property
    def restart_pauses_s(self) -> list[float]:
        return [r.first_merge_after_s for r in self.sync_restarts if r.first_merge_after_s is not None]


@dataclass
class _Cluster:
    """The running pieces that faults act on."""

    procs: Processes
    proxies: ProxyHost
    files: RunFiles
    port: int
    http_port: int
    threads: int
    learner_cmds: dict[str, list[str]]

    def start_learner(self, name: str) -> None:
        self.procs.start(name, self.learner_cmds[name], env={"OMP_NUM_THREADS": str(self.threads)})

    def start_sync(self, *, resume: bool) -> None:
        self.files.port_files[0].unlink(missing_ok=True)
        self.procs.start(SYNC_TARGET, sync_command(self.files, 0, port=self.port if resume else 0,
                                                   http_port=self.http_port, resume=resume),
                         env={"OMP_NUM_THREADS": "1"})


Action = Callable[[_Cluster], None]


class ChaosRun:
    """One run of the cluster in ``out`` with ``faults`` injected; :meth:`run` returns what was observed."""

    def __init__(self, config: Config, out: Path, faults: list[Fault], *, window_s: float, device: str,
                 min_step_s: float = 0.0,
                 on_sample: Callable[[LiveState], None] | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        if config.protocol.shards != 1:
            raise DdilocoError(f"ddiloco chaos runs one synchronizer; protocol.shards={config.protocol.shards} "
                               "is not supported yet")
        self.config = config
        self.out = out
        self.window_s = window_s
        self.device = device
        self.min_step_s = min_step_s
        self.on_sample = on_sample
        self.on_event = on_event or (lambda text: None)
        self.records = [FaultRecord(f) for f in faults]
        self.m = config.run.learners
        self.samples: list[Sample] = []
        self.sync_restarts: list[SyncRestart] = []
        self._t0: float | None = None
        self._address = ""
        self._killed_instance: str | None = None  # set while the synchronizer is down or restarting
        self._awaiting_merge: SyncRestart | None = None  # restarted, no merge seen yet
        self._sync_restart: tuple[float, FaultRecord] | None = None  # killed: (restart at, its fault)

    def now_s(self) -> float:
        """Wall seconds since the first join."""
        return time.monotonic() - self._t0 if self._t0 is not None else 0.0

    def clock_s(self) -> float:
        """The schedule's clock: seconds since the first join while the synchronizer was up.

        The synchronizer's time budget does not run while it is down either, so a schedule
        keeps its place in the run however long a restart takes on a loaded machine, and no
        fault is spent on a cluster that is already down.
        """
        down = sum((r.answering_at_s if r.answering_at_s is not None else self.now_s()) - r.killed_at_s
                   for r in self.sync_restarts)
        return self.now_s() - down

    def run(self) -> ChaosOutcome:
        files = prepare_files(self.config, self.out)
        sync = files.sync_names[0]
        procs = Processes(files.logs)
        proxies = ProxyHost()
        client: ShardedClient | None = None
        launched = time.monotonic()
        cluster = _Cluster(procs, proxies, files, 0, free_port(), learner_threads(self.m), {})
        status_url = f"http://127.0.0.1:{cluster.http_port}/"
        try:
            cluster.start_sync(resume=False)
            cluster.port = port = wait_for_port(files.port_files[0], procs, sync)
            for i in range(self.m):
                name = learner_name(i)
                link = proxies.add(name, port)
                cluster.learner_cmds[name] = learner_command([f"127.0.0.1:{link}"], name, cluster.threads,
                                                             self.device, self.min_step_s)
                cluster.start_learner(name)
            self._address = f"127.0.0.1:{port}"
            client = ShardedClient([self._address])
            actions = self._actions()
            failure, status = "", {}
            while True:
                status = self._poll(client) or status
                if self._t0 is None and time.monotonic() - launched > START_TIMEOUT_S:
                    failure = f"no learner joined within {START_TIMEOUT_S:.0f}s (logs in {files.logs})"
                    break
                if self._t0 is not None:
                    while actions and actions[0][0] <= self.clock_s() and self._killed_instance is None:
                        _, act = actions.pop(0)
                        act(cluster)
                    if self._sync_restart is not None and self._sync_restart[0] <= self.now_s():
                        self._end(self._sync_restart[1], cluster)
                        self._sync_restart = None
                if status.get("finished") and self._killed_instance is None:
                    break
                failure = self._check_processes(procs, sync)
                if failure:
                    break
                if self._t0 is not None and self.clock_s() > self.config.run.time_s + FINISH_SLACK_S:
                    failure = f"the run did not finish within {FINISH_SLACK_S:.0f}s of its budget"
                    break
                if self.on_sample is not None:
                    self.on_sample(self._live(status, status_url))
                time.sleep(POLL_S)
            eval_loss = None
            if not failure:
                eval_loss, _ = GlobalEvaluator(self.config, client).evaluate()
                for i in range(self.m):
                    name = learner_name(i)
                    if procs.running(name):
                        try:
                            procs.children[name].wait(30)
                        except subprocess.TimeoutExpired:  # a learner slow to leave is stopped
                            procs.stop(name)
                procs.stop(sync)
            return ChaosOutcome(
                completed=not failure and bool(status.get("finished")),
                failure=failure,
                records=self.records,
                samples=self.samples,
                sync_restarts=self.sync_restarts,
                final_status=status,
                eval_loss=eval_loss,
                wall_s=time.monotonic() - launched,
                sync_log=files.logs / f"{sync}.log",
                status_url=status_url,
                proxy_bytes=proxies.call(lambda: {n: dict(p.bytes) for n, p in proxies.proxies.items()}),
                connections_reset=proxies.call(lambda: sum(p.connections_reset for p in proxies.proxies.values())),
            )
        finally:
            if client is not None:
                client.close()
            procs.close()
            proxies.close()

    # ---- observing ------------------------------------------------------------------------

    def _poll(self, client: ShardedClient) -> dict[str, Any] | None:
        try:
            if self._killed_instance is None:
                status = client.status_dict(timeout_s=5.0)
            else:  # a fresh channel: the old one's reconnect backoff would see the restart seconds late
                with ShardedClient([self._address]) as fresh:
                    status = fresh.status_dict(timeout_s=5.0)
        except (Unreachable, Refused):
            return None
        if self._killed_instance is not None:
            if status["instance_id"] == self._killed_instance:
                return None  # the old incarnation's last answer, racing its kill
            restart = self.sync_restarts[-1]
            restart.answering_at_s = self.now_s()
            restart.versions_resumed = tuple(f["version"] for f in status["fragments"])
            restart.tokens_resumed = status["tokens"]
            self._killed_instance = None
            self._awaiting_merge = restart
            self.on_event(f"t={restart.answering_at_s:6.1f}s  synchronizer {status['instance_id']} answering "
                          f"(resumed at versions {list(restart.versions_resumed)}, "
                          f"down {restart.answering_at_s - restart.killed_at_s:.1f}s)")
        if self._t0 is None and status["phase"] != "waiting":
            self._t0 = time.monotonic()
        versions = tuple(f["version"] for f in status["fragments"])
        awaiting = self._awaiting_merge
        if awaiting is not None and sum(versions) > sum(awaiting.versions_resumed):
            awaiting.first_merge_after_s = self.now_s() - (awaiting.answering_at_s or 0.0)
            self.on_event(f"t={self.now_s():6.1f}s  first merge after the restart, "
                          f"{awaiting.first_merge_after_s:.1f}s after it answered")
            self._awaiting_merge = None
        self.samples.append(Sample(
            t_s=self.now_s() if self._t0 is not None else -1.0,
            instance_id=status["instance_id"],
            phase=status["phase"],
            versions=versions,
            alive={lr["id"]: lr["alive"] for lr in status["learners"]},
            tokens=status["tokens"],
            grace_window_s=status["grace"]["window_s"],
            longest_pause_s=status["longest_pause_s"],
            rejections=dict(status["rejections"]),
        ))
        return status

    def _check_processes(self, procs: Processes, sync: str) -> str:
        """A failure that no fault explains: the synchronizer gone by itself, or every learner gone."""
        restarted = self._killed_instance is not None and self._sync_restart is None
        if (self._killed_instance is None or restarted) and not procs.running(sync):
            return (f"the synchronizer exited by itself with code {procs.children[sync].returncode}"
                    + (" after its restart" if restarted else "") + ":\n" + procs.tail(sync))
        learners = [learner_name(i) for i in range(self.m)]
        left_down = {r.fault.target for r in self.records if not r.fault.restart and r.started_s is not None}
        restarting = any(r.fault.kind is FaultKind.KILL and r.fault.restart and r.started_s is not None
                         and r.ended_s is None for r in self.records)
        if not restarting and not any(procs.running(n) for n in learners):
            crashed = next((n for n in learners if n not in left_down and procs.children[n].returncode), None)
            if crashed is not None or not self.samples or self.samples[-1].phase not in ("stopping", "finished"):
                return "every learner exited before the run finished" + (
                    f"; {crashed}:\n{procs.tail(crashed)}" if crashed else "")
        return ""

    def _live(self, status: dict[str, Any], status_url: str) -> LiveState:
        done = collections.Counter(str(r.fault.kind) for r in self.records if r.started_s is not None and not r.skipped)
        return LiveState(
            clock_s=self.clock_s(),
            window_s=self.window_s,
            run_s=self.config.run.time_s,
            phase=status.get("phase", "starting") if self._killed_instance is None else "synchronizer down",
            faults_so_far=done,
            active=[r.fault.describe() for r in self.records if r.started_s is not None and r.ended_s is None
                    and not r.skipped],
            max_version=max((f["version"] for f in status.get("fragments", [])), default=0),
            alive=sum(1 for lr in status.get("learners", []) if lr["alive"]),
            learners=self.m,
            sync_up=self._killed_instance is None,
            longest_pause_s=max([s.longest_pause_s for s in self.samples]
                                + [r.first_merge_after_s or 0.0 for r in self.sync_restarts], default=0.0),
            status_url=status_url,
        )

    # ---- injecting ------------------------------------------------------------------------

    def _actions(self) -> list[tuple[float, Action]]:
        """Every fault's start and end on the schedule's clock, in time order (ends first at one instant)."""
        timed: list[tuple[float, int, Action]] = []
        for record in self.records:
            timed.append((record.fault.at_s, 1, lambda cluster, r=record: self._start(r, cluster)))
            if record.fault.restart and record.fault.kind is not FaultKind.SYNC_KILL:  # restarted on wall time
                timed.append((record.fault.end_s, 0, lambda cluster, r=record: self._end(r, cluster)))
        timed.sort(key=lambda a: (a[0], a[1]))
        return [(t, act) for t, _, act in timed]

    def _start(self, record: FaultRecord, cluster: _Cluster) -> None:
        f, procs = record.fault, cluster.procs
        record.started_s = self.now_s()
        self.on_event(f"t={record.started_s:6.1f}s  {f.describe()}")
        if f.kind is FaultKind.SYNC_KILL:
            if self._killed_instance is not None or not procs.running(f.target):
                record.skipped = "the synchronizer was already down"
                return
            last = self.samples[-1]
            self._killed_instance = last.instance_id
            self.sync_restarts.append(SyncRestart(self.now_s(), last.versions, last.tokens))
            self._awaiting_merge = None
            self._sync_restart = (self.now_s() + f.duration_s, record)
            procs.signal(f.target, signal.SIGKILL)
        elif f.kind in (FaultKind.KILL, FaultKind.FREEZE):
            if not procs.signal(f.target, signal.SIGKILL if f.kind is FaultKind.KILL else signal.SIGSTOP):
                record.skipped = f"{f.target} was not running"
        else:
            proxy = cluster.proxies.proxies[f.target]
            cluster.proxies.call({
                FaultKind.LATENCY: lambda: proxy.set_latency(f.delay_s),
                FaultKind.BANDWIDTH: lambda: proxy.set_bandwidth(f.rate_bytes_per_s),
                FaultKind.RESET: lambda: proxy.reset(f.duration_s),
                FaultKind.PARTITION: lambda: proxy.set_partitioned(True),
            }[f.kind])

    def _end(self, record: FaultRecord, cluster: _Cluster) -> None:
        f = record.fault
        record.ended_s = self.now_s()
        if record.skipped:
            self.on_event(f"t={record.ended_s:6.1f}s  skipped {f.kind} {f.target}: {record.skipped}")
            return
        self.on_event(f"t={record.ended_s:6.1f}s  end of {f.kind} {f.target}"
                      + {FaultKind.SYNC_KILL: ": restarting it with --resume", FaultKind.KILL: ": restarting it",
                         FaultKind.FREEZE: ": SIGCONT"}.get(f.kind, ""))
        if f.kind is FaultKind.SYNC_KILL:
            cluster.start_sync(resume=True)
        elif f.kind is FaultKind.KILL:
            cluster.start_learner(f.target)
        elif f.kind is FaultKind.FREEZE:
            cluster.procs.signal(f.target, signal.SIGCONT)
        elif f.kind is not FaultKind.RESET:  # a reset's hold runs out by itself
            proxy = cluster.proxies.proxies[f.target]
            cluster.proxies.call({
                FaultKind.LATENCY: lambda: proxy.set_latency(0.0),
                FaultKind.BANDWIDTH: lambda: proxy.set_bandwidth(0.0),
                FaultKind.PARTITION: lambda: proxy.set_partitioned(False),
            }[f.kind])
