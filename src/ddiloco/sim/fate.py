"""The virtual cluster's failures: the seeded trace's crashes and restarts, and the adversary's
timed faults (freezes, partitions, stalled uploads, synchronizer crashes, floods of abandoned
joins), as events on the cluster's clock.

What a fault does to a process or a link is here; what the protocol makes of it is the
cores' (a crashed learner's boot ends, a frozen one's events wait for its thaw, a
partitioned one's messages are dropped and what it missed is replayed when it is back).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.messages import Join
from ddiloco.settings.fault_kinds import FaultKind
from ddiloco.sim.adversary import Window
from ddiloco.sim.events import (
    Arrive,
    Crash,
    FloodJoin,
    Freeze,
    Partition,
    PartitionEnd,
    Recover,
    SimEvent,
    Stall,
    SyncCrash,
    SyncRestart,
    Thaw,
)
from ddiloco.sim.faults import FailureTrace
from ddiloco.sim.host import NodeHost
from ddiloco.sim.learner_node import LearnerNode
from ddiloco.sim.network import Network
from ddiloco.sim.sync_node import SyncNode
from ddiloco.sim.timeline import Happening, Timeline


def window_event(w: Window) -> SimEvent:
    """The event that starts an adversary's window."""
    if w.kind is FaultKind.PARTITION:
        return Partition(w.target, w.end_s)
    if w.kind is FaultKind.FREEZE:
        return Freeze(w.target, w.end_s)
    if w.kind is FaultKind.JOIN_FLOOD:
        return FloodJoin(w.target, 0, w.end_s)
    if w.kind is FaultKind.STALL:
        return Stall(w.target, w.end_s)
    return SyncCrash(w.target, w.end_s)


class Fate:
    """Carries out failure events on the cluster's processes and links."""

    def __init__(self, host: NodeHost, *, learners: list[LearnerNode], syncs: list[SyncNode], network: Network,
                 trace: FailureTrace, timeline: Timeline, new_core: Callable[[str, object, int], Learner],
                 attack_until_s: float, flood_per_s: float) -> None:
        self.host = host
        self.learners = learners
        self.syncs = syncs
        self.network = network
        self.trace = trace
        self.timeline = timeline
        self.new_core = new_core
        self.attack_until_s = attack_until_s
        self.flood_per_s = flood_per_s
        self.flood_joins = 0
        """Joins of every flood so far: each under an id never used before."""
        self.injected: Counter[FaultKind] = Counter()

    def befall(self, event: SimEvent) -> None:
        host, now = self.host, self.host.queue.now
        if isinstance(event, Crash):
            outage = self.trace.outage_at(event.m, now)
            assert outage is not None
            self.learners[event.m].crash()
            self.injected[FaultKind.LEARNER_CRASH] += 1
            self.timeline.add(now, Happening.FAILURE, event.m)
            host.queue.at(outage.up_s, Recover(event.m))
        elif isinstance(event, Recover):
            node = self.learners[event.m]
            self.timeline.add(now, Happening.RESTART, event.m)
            node.restart(host, self.new_core(node.name, node.model, node.boot))
            self.schedule_failure(event.m)
            node.advance(host)
        elif isinstance(event, Arrive):
            node = self.learners[event.m]
            node.arrive(host)
            self.schedule_failure(event.m)
            node.advance(host)
        elif isinstance(event, Freeze):
            node = self.learners[event.m]
            if node.up:
                node.frozen_until_s = max(node.frozen_until_s, event.until_s)
                self.injected[FaultKind.FREEZE] += 1
                host.queue.at(event.until_s, Thaw(event.m))
        elif isinstance(event, Thaw):
            node = self.learners[event.m]
            if node.up and now >= node.frozen_until_s:
                node.on_tick(host)
                node.advance(host)
        elif isinstance(event, Partition):
            self.network.partition(self.learners[event.m].name, event.until_s)
            self.injected[FaultKind.PARTITION] += 1
            host.queue.at(event.until_s, PartitionEnd(event.m))
        elif isinstance(event, PartitionEnd):
            node = self.learners[event.m]
            if node.up and not self.network.partitioned(node.name, now):
                for shard, sync in enumerate(self.syncs):
                    if (held := node.core.stream_versions(shard)) is not None:
                        sync.replay_to(host, node.name, held)
        elif isinstance(event, Stall):
            self.network.stall(self.learners[event.m].name, event.until_s)
            self.injected[FaultKind.STALL] += 1
        elif isinstance(event, SyncCrash):
            sync = self.syncs[event.shard]
            if sync.up and not sync.finished:
                sync.crash(host)
                self.injected[FaultKind.SYNC_CRASH] += 1
                host.queue.at(event.until_s, SyncRestart(event.shard))
        elif isinstance(event, SyncRestart):
            self.syncs[event.shard].restart(host)
        elif isinstance(event, FloodJoin):
            self.injected[FaultKind.JOIN_FLOOD] += event.number == 0
            self.flood_joins += 1
            join = Join(f"flood-{event.shard}-{self.flood_joins}", f"flood-boot-{self.flood_joins}")
            self.syncs[event.shard].on_stranger_join(host, join, delivered=event.number % 2 == 1)
            after_s = now + 1.0 / self.flood_per_s
            if after_s < event.until_s:
                host.queue.at(after_s, FloodJoin(event.shard, event.number + 1, event.until_s))

    def schedule_failure(self, m: int) -> None:
        """Learner ``m``'s next crash from the trace, if it falls inside the attack window."""
        now = self.host.queue.now
        down = self.trace.next_down(m, now if now > 0 else -1.0)
        if down < self.attack_until_s:
            self.host.queue.at(down, Crash(m))
