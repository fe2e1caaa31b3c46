"""Run a real cluster on this host and break it on schedule: the engine of ``ddiloco chaos``.

The processes and how faults reach them are :mod:`ddiloco.chaos.cluster`'s: one
``ddiloco sync`` per shard and M ``ddiloco learner`` processes, each learner behind
fault-injecting proxies, on loopback or (``--hosts netns``) each in its own network
namespace on a real capped link. The tool only injects faults and observes: who rejoins,
when and how is the protocol core's business, and the only way the tool learns about it is
the synchronizer's status, polled a few times a second, and its log. SIGINT or SIGTERM
stops the run cleanly: links healed, learners stopped (they flush), the final model
evaluated, every synchronizer stopped with its final checkpoint.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ddiloco.chaos.cluster import BATCH_LOGS, ChaosCluster
from ddiloco.chaos.outcome import ChaosOutcome, FaultRecord, LiveState, Sample, SyncRecovery
from ddiloco.chaos.proxy import ProxyHost
from ddiloco.chaos.schedule import Fault, learner_name
from ddiloco.core.sync_side.run_state import RunPhase
from ddiloco.runtime.batch_log import read_batch_log
from ddiloco.runtime.client import CallRefused, Unreachable
from ddiloco.runtime.launch.local_run import (
    LEAVE_TIMEOUT_S,
    GlobalEvaluator,
    Synchronizers,
    prepare_files,
)
from ddiloco.runtime.launch.netns import SYNC_HOST
from ddiloco.runtime.launch.placement import placed
from ddiloco.runtime.launch.processes import Processes, StopSignals
from ddiloco.runtime.launch.topology import Topology
from ddiloco.runtime.sharded import ShardedClient, merge_statuses
from ddiloco.settings.config import Config
from ddiloco.settings.fault_kinds import FaultKind

POLL_S = 0.25
START_TIMEOUT_S = 180.0
"""From launch to the first join: imports, numba's cache and the corpus on a loaded 2-core box."""
FINISH_SLACK_S = 120.0
"""How long past its budget (plus the synchronizer's downtime) the run may take to finish."""

Action = Callable[[ChaosCluster], None]


@dataclass
class _Shard:
    """What the tool knows of one synchronizer process (``sync`` or ``sync-I``)."""

    client: ShardedClient
    address: str
    status: dict[str, Any] | None = None
    killed: str | None = None
    """The killed incarnation's id, while it is down or restarting."""
    restart: SyncRecovery | None = None
    restart_at: tuple[float, FaultRecord] | None = None
    """Killed: (restart it at, the fault)."""
    awaiting: SyncRecovery | None = None
    """Restarted, no merge seen yet."""

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(f["version"] for f in (self.status or {}).get("fragments", []))


class ChaosRun:
    """One run of the cluster in ``out`` with ``faults`` injected; :meth:`run` returns what was observed."""

    def __init__(self, config: Config, out: Path, faults: list[Fault], *, window_s: float, device: str,
                 min_step_s: float = 0.0, topology: Topology | None = None,
                 on_sample: Callable[[LiveState], None] | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.out = out
        self.window_s = window_s
        self.device = device
        self.min_step_s = min_step_s
        self.topology = topology
        self.on_sample = on_sample
        self.on_event = on_event or (lambda text: None)
        self.records = [FaultRecord(f) for f in faults]
        self.m = config.run.learners
        self.samples: list[Sample] = []
        self.sync_restarts: list[SyncRecovery] = []
        self._t0: float | None = None
        self._shards: dict[str, _Shard] = {}
        self.cluster: ChaosCluster | None = None
        """The running processes and proxies while :meth:`run` runs (a soak reads their pids, ``chaos/soak.py``)."""

    def now_s(self) -> float:
        """Wall seconds since the first join."""
        return time.monotonic() - self._t0 if self._t0 is not None else 0.0

    def clock_s(self) -> float:
        """The schedule's clock: seconds since the first join while every synchronizer process was up.

        The synchronizer's time budget does not run while it is down either, so a schedule
        keeps its place in the run however long a restart takes on a loaded machine, and no
        fault is spent on a cluster that is already down.
        """
        down, covered_to = 0.0, float("-inf")
        for start, end in sorted((r.killed_at_s, r.answering_at_s if r.answering_at_s is not None else self.now_s())
                                 for r in self.sync_restarts):
            down += max(0.0, end - max(start, covered_to))
            covered_to = max(covered_to, end)
        return self.now_s() - down

    def _any_down(self) -> bool:
        return any(s.killed is not None for s in self._shards.values())

    def _finished(self) -> bool:
        """The run is over once one synchronizer process says so: the learners leave then (a shard
        whose time budget stood still while it was down would finish later, with nobody left)."""
        return any(s.status is not None and s.status["finished"] for s in self._shards.values())

    def run(self) -> ChaosOutcome:
        files = prepare_files(self.config, self.out)
        (self.out / BATCH_LOGS).mkdir(exist_ok=True)
        for old in (self.out / BATCH_LOGS).glob("*.log"):  # a learner's processes append to its log
            old.unlink()
        learners = [learner_name(i) for i in range(self.m)]
        with StopSignals() as stop, placed(self.topology, [SYNC_HOST, *learners], self.out) as place:
            procs = Processes(files.logs)
            cluster = ChaosCluster(procs, ProxyHost(), files, Synchronizers.of_run(files, place, procs))
            self.cluster = cluster
            try:
                return self._run(cluster, stop)
            finally:
                for shard in self._shards.values():
                    shard.client.close()
                cluster.procs.close()
                cluster.proxies.close()

    def _run(self, cluster: ChaosCluster, stop: StopSignals) -> ChaosOutcome:
        procs, files, place = cluster.procs, cluster.files, cluster.place
        launched = time.monotonic()
        for name, address in zip(cluster.syncs, cluster.synchronizers.start_all(stop)):
            self._shards[name] = _Shard(ShardedClient([address], token=place.token), address)
        for i in range(self.m):
            cluster.add_learner(learner_name(i), self.device, self.min_step_s)
            cluster.start_learner(learner_name(i))
        first_links = place.counters()
        actions = self._actions()
        failure, status = "", {}
        while True:
            if stop.requested is not None:
                failure = f"stopped by {stop.requested.name}"
                break
            status = self._poll(place.token) or status
            if self._t0 is None and time.monotonic() - launched > START_TIMEOUT_S:
                failure = f"no learner joined within {START_TIMEOUT_S:.0f}s (logs in {files.logs})"
                break
            if self._t0 is not None:
                while actions and actions[0][0] <= self.clock_s() and not self._any_down():
                    _, act = actions.pop(0)
                    act(cluster)
                for shard in self._shards.values():
                    if shard.restart_at is not None and shard.restart_at[0] <= self.now_s():
                        record, shard.restart_at = shard.restart_at[1], None
                        self._end(record, cluster)
            if self._finished() and not self._any_down():
                break
            failure = self._check_processes(procs, cluster.syncs)
            if failure:
                break
            if self._t0 is not None and self.clock_s() > self.config.run.time_s + FINISH_SLACK_S:
                failure = f"the run did not finish within {FINISH_SLACK_S:.0f}s of its budget"
                break
            if self.on_sample is not None:
                self.on_sample(self._live(status, cluster.synchronizers.status_url()))
            time.sleep(POLL_S)
        eval_loss = None
        if stop.requested is not None:
            self._leave(cluster)
        clean = not failure or stop.requested is not None
        if clean and not self._any_down():
            with ShardedClient([s.address for s in self._shards.values()], token=place.token) as client:
                # Every shard is up: under a capped link's load (``--hosts netns``) a handshake can be
                # dropped for longer than one connection attempt, which must not end the run in a traceback.
                eval_loss, _ = GlobalEvaluator(self.config, client).evaluate(wait_for_ready=True)
                status = client.status_dict() if stop.requested is not None else status
            if stop.requested is None:
                self._wait_for_learners(procs)
        if clean:
            procs.stop_all(cluster.syncs, LEAVE_TIMEOUT_S)  # SIGTERM: each writes its final checkpoint
        last_links = place.counters()
        return ChaosOutcome(
            completed=not failure and self._finished(),
            failure=failure,
            records=self.records,
            samples=self.samples,
            sync_restarts=self.sync_restarts,
            final_status=status,
            eval_loss=eval_loss,
            wall_s=time.monotonic() - launched,
            status_url=cluster.synchronizers.status_url(),
            sync_names=tuple(cluster.syncs),
            proxy_bytes=cluster.proxies.call(lambda: {n: dict(p.bytes) for n, p in cluster.proxies.proxies.items()}),
            link_bytes={name: {d: last_links[name][d] - first_links[name][d] for d in ("up", "down")}
                        for name in last_links},
            connections_reset=cluster.proxies.call(lambda: sum(p.connections_reset
                                                               for p in cluster.proxies.proxies.values())),
            stopped=stop.requested.name if stop.requested is not None else None,
            batches={name: read_batch_log(cluster.batch_log(name)) for name in map(learner_name, range(self.m))},
        )

    def _wait_for_learners(self, procs: Processes) -> None:
        for i in range(self.m):
            name = learner_name(i)
            if procs.running(name):
                try:
                    procs.children[name].wait(LEAVE_TIMEOUT_S)
                except subprocess.TimeoutExpired:  # a learner slow to leave is stopped
                    procs.stop(name)

    def _leave(self, cluster: ChaosCluster) -> None:
        """Stopped by a signal: heal every link fault in force, then stop the learners (they flush)."""
        for record in self.records:
            if record.started_s is not None and record.ended_s is None and record.fault.kind.on_link \
                    and not record.skipped:
                cluster.heal_link(record.fault)
        self.on_event(f"t={self.now_s():6.1f}s  stopping: learners, then the synchronizer (final checkpoint)")
        cluster.procs.stop_all([learner_name(i) for i in range(self.m)], LEAVE_TIMEOUT_S)

    # ---- observing ------------------------------------------------------------------------

    def _poll(self, token: str | None) -> dict[str, Any] | None:
        """Every synchronizer process's status, merged; None while any of them does not answer."""
        for name, shard in self._shards.items():
            try:
                if shard.killed is None:
                    status = shard.client.status_dict(timeout_s=5.0)
                else:  # a fresh channel: the old one's reconnect backoff would see the restart seconds late
                    with ShardedClient([shard.address], token=token) as fresh:
                        status = fresh.status_dict(timeout_s=5.0)
            except (Unreachable, CallRefused):
                return None
            if shard.killed is not None:
                if status["instance_id"] == shard.killed:
                    return None  # the old incarnation's last answer, racing its kill
                self._answering(name, shard, status)
            shard.status = status
        statuses = [s.status for s in self._shards.values() if s.status is not None]
        status = statuses[0] if len(statuses) == 1 else merge_statuses(statuses)
        if self._t0 is None and status["phase"] != RunPhase.WAITING:
            self._t0 = time.monotonic()
        for shard in self._shards.values():
            awaiting = shard.awaiting
            if awaiting is not None and sum(shard.versions) > sum(awaiting.versions_resumed):
                awaiting.first_merge_after_s = self.now_s() - (awaiting.answering_at_s or 0.0)
                self.on_event(f"t={self.now_s():6.1f}s  first merge after the restart of {awaiting.target}, "
                              f"{awaiting.first_merge_after_s:.1f}s after it answered")
                shard.awaiting = None
        self.samples.append(Sample.from_status(self.now_s() if self._t0 is not None else -1.0, status))
        return status

    def _answering(self, name: str, shard: _Shard, status: dict[str, Any]) -> None:
        """The restarted process ``name`` answers: record what it resumed from."""
        restart = shard.restart
        assert restart is not None
        restart.answering_at_s = self.now_s()
        restart.versions_resumed = tuple(f["version"] for f in status["fragments"])
        restart.tokens_resumed = status["tokens"]
        shard.killed, shard.awaiting = None, restart
        self.on_event(f"t={restart.answering_at_s:6.1f}s  synchronizer {name} {status['instance_id']} answering "
                      f"(resumed at versions {list(restart.versions_resumed)}, "
                      f"down {restart.answering_at_s - restart.killed_at_s:.1f}s)")

    def _check_processes(self, procs: Processes, syncs: list[str]) -> str:
        """A failure that no fault explains: a synchronizer gone by itself, or every learner gone."""
        for name in syncs:
            shard = self._shards[name]
            restarted = shard.killed is not None and shard.restart_at is None
            if (shard.killed is None or restarted) and not procs.running(name):
                return (f"the synchronizer {name} exited by itself with code {procs.children[name].returncode}"
                        + (" after its restart" if restarted else "") + ":\n" + procs.tail(name))
        learners = [learner_name(i) for i in range(self.m)]
        left_down = {r.fault.target for r in self.records if not r.fault.restart and r.started_s is not None}
        restarting = any(r.fault.kind is FaultKind.LEARNER_CRASH and r.fault.restart and r.started_s is not None
                         and r.ended_s is None for r in self.records)
        if not restarting and not any(procs.running(n) for n in learners):
            crashed = next((n for n in learners if n not in left_down and procs.children[n].returncode), None)
            ending = any(sh.status is not None and sh.status["phase"] in (RunPhase.STOPPING, RunPhase.FINISHED)
                         for sh in self._shards.values())
            if crashed is not None or not ending:
                return "every learner exited before the run finished" + (
                    f"; {crashed}:\n{procs.tail(crashed)}" if crashed else "")
        return ""

    def _live(self, status: dict[str, Any], status_url: str) -> LiveState:
        done = collections.Counter(str(r.fault.kind) for r in self.records if r.started_s is not None and not r.skipped)
        down = [name for name, s in self._shards.items() if s.killed is not None]
        return LiveState(
            clock_s=self.clock_s(),
            window_s=self.window_s,
            run_s=self.config.run.time_s,
            phase=status.get("phase", "starting") if not down else f"synchronizer down ({', '.join(down)})",
            faults_so_far=done,
            active=[r.fault.describe() for r in self.records if r.started_s is not None and r.ended_s is None
                    and not r.skipped],
            max_version=max((f["version"] for f in status.get("fragments", [])), default=0),
            alive=sum(1 for lr in status.get("learners", []) if lr["alive"]),
            learners=self.m,
            sync_up=not down,
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
            if record.fault.restart and record.fault.kind is not FaultKind.SYNC_CRASH:  # restarted on wall time
                timed.append((record.fault.end_s, 0, lambda cluster, r=record: self._end(r, cluster)))
        timed.sort(key=lambda a: (a[0], a[1]))
        return [(t, act) for t, _, act in timed]

    def _start(self, record: FaultRecord, cluster: ChaosCluster) -> None:
        f, procs = record.fault, cluster.procs
        record.started_s = self.now_s()
        self.on_event(f"t={record.started_s:6.1f}s  {f.describe()}")
        if f.kind is FaultKind.SYNC_CRASH:
            shard = self._shards[f.target]
            if shard.killed is not None or not procs.running(f.target):
                record.skipped = f"the synchronizer {f.target} was already down"
                return
            assert shard.status is not None
            shard.killed = shard.status["instance_id"]
            shard.restart = SyncRecovery(f.target, self.now_s(), shard.versions, shard.status["tokens"])
            self.sync_restarts.append(shard.restart)
            shard.awaiting = None
            shard.restart_at = (self.now_s() + f.duration_s, record)
            procs.signal(f.target, signal.SIGKILL)
        elif f.kind in (FaultKind.LEARNER_CRASH, FaultKind.FREEZE):
            if not procs.signal(f.target, signal.SIGKILL if f.kind is FaultKind.LEARNER_CRASH else signal.SIGSTOP):
                record.skipped = f"{f.target} was not running"
        else:
            cluster.break_link(f)

    def _end(self, record: FaultRecord, cluster: ChaosCluster) -> None:
        f = record.fault
        record.ended_s = self.now_s()
        if record.skipped:
            self.on_event(f"t={record.ended_s:6.1f}s  skipped {f.kind} {f.target}: {record.skipped}")
            return
        self.on_event(f"t={record.ended_s:6.1f}s  end of {f.kind} {f.target}"
                      + {FaultKind.SYNC_CRASH: ": restarting it with --resume",
                         FaultKind.LEARNER_CRASH: ": restarting it", FaultKind.FREEZE: ": SIGCONT"}.get(f.kind, ""))
        if f.kind is FaultKind.SYNC_CRASH:
            cluster.synchronizers.start(cluster.syncs.index(f.target), resume=True)
        elif f.kind is FaultKind.LEARNER_CRASH:
            cluster.start_learner(f.target)
        elif f.kind is FaultKind.FREEZE:
            cluster.procs.signal(f.target, signal.SIGCONT)
        else:
            cluster.heal_link(f)
