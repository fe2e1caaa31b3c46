"""The virtual cluster: a deterministic discrete-event driver of the protocol core.

One process, one virtual clock. Each learner is a real PyTorch model trained by real AdamW
steps on its own shard; only *time* is simulated: a step lasts what the learner's speed
profile draws, a message lasts latency + bits / bandwidth, failures come from the seeded
trace, and the adversary (``faults.*``: loss, duplication, reordering, partitions, freezes,
synchronizer crashes) attacks the protocol. Events are ordered by (time, sequence number)
and every random draw comes from a seeded per-component stream, so the same seed gives
the same run bit for bit.

The driver only moves messages between the learners' and the synchronizer's state
machines and carries out their actions (:mod:`ddiloco.sim.learner_node`,
:mod:`ddiloco.sim.sync_node`); every protocol decision is theirs. Invariants are checked
all along (:mod:`ddiloco.sim.invariants`). What happened is kept in a timeline
(:mod:`ddiloco.sim.timeline`), and an observer may look at the run through read-only
snapshots (:mod:`ddiloco.sim.snapshot`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from ddiloco.core.actions import RoundClosed
from ddiloco.core.fragments import FragmentPlan, flatten, plan_fragments, unflatten_into
from ddiloco.core.learner import Learner
from ddiloco.core.synchronizer import Synchronizer
from ddiloco.sim.adversary import TimedFault, plan_windows
from ddiloco.sim.events import Ev, EventQueue
from ddiloco.sim.harness import Recorder
from ddiloco.sim.invariants import InvariantChecker
from ddiloco.sim.learner_node import LearnerNode
from ddiloco.measures import Direction, fragment_shares
from ddiloco.sim.network import NetFaults, Network
from ddiloco.sim.snapshot import SnapshotFn, take_snapshot
from ddiloco.sim.sync_node import SyncNode
from ddiloco.sim.timeline import Happening, RunEvents, Timeline
from ddiloco.workload.workload import Workload, weights_sha256

_AT_LEARNER = {Ev.STEP_END, Ev.REPLY, Ev.PUSH, Ev.CALL_TIMEOUT, Ev.LEARNER_TICK}
SNAPSHOT_EVERY_S = 1.0
"""Virtual seconds between two snapshots for the observer (a terminal redraws a few times a second)."""


class VirtualCluster:
    """Runs Decoupled DiLoCo (or synchronous DiLoCo) on M virtual learners."""

    def __init__(self, workload: Workload, recorder: Recorder, *, check_invariants: bool = True,
                 attack_until_s: float | None = None, observer: SnapshotFn | None = None) -> None:
        self.config = config = workload.config
        self.workload = workload
        self.recorder = recorder
        self.protocol = protocol = config.protocol.for_mode(config.run.mode, config.run.learners)
        reference = workload.new_model()
        self.plan: FragmentPlan = plan_fragments(
            [(n, tuple(p.shape)) for n, p in reference.named_parameters()],
            num_fragments=protocol.fragments,
            period=protocol.period,
            strategy=protocol.fragmentation,
            embedding_names=reference.embedding_param_names(),
        )
        params = dict(reference.named_parameters())
        initial = [flatten([params[n] for n in f.param_names]).cpu() for f in self.plan.fragments]  # the synchronizer's
        embeds = [f.index for f in self.plan.fragments if f.is_embedding]
        run, cluster = config.run, config.cluster
        limits = config.run_limits(checkpoint_every_rounds=cluster.checkpoint_every_rounds,
                                   checkpoint_every_s=cluster.checkpoint_every_s)
        self.syncs = [
            SyncNode(lambda incarnation, shard=shard: Synchronizer(protocol, initial, embeds, limits=limits,
                                                                   incarnation=incarnation, shard=shard,
                                                                   session_salt=incarnation),
                     seed=run.seed, shard=shard)
            for shard in range(protocol.shards)
        ]
        self.tokens_per_step = workload.tokens_per_step
        self._share = fragment_shares(f.numel for f in self.plan.fragments)
        self.eval_model = reference  # receives the synchronizer's values before each evaluation
        self.checker = (InvariantChecker(seed=run.seed, staleness_max=protocol.staleness_max, quorum=protocol.quorum,
                                         strict_quorum=protocol.strict_quorum, initial_values=initial)
                        if check_invariants else None)
        self.queue = EventQueue()
        f = config.faults
        self.attack_until_s = recorder.horizon_s() if attack_until_s is None else attack_until_s
        self.network = Network(
            [f"learner-{m}" for m in range(run.learners)], bandwidth_bps=cluster.bandwidth_bps,
            latency_s=cluster.latency_s, seed=run.seed, bytes_counter=recorder.bytes,
            faults=NetFaults(loss=f.loss, duplicate=f.duplicate, reorder=f.reorder, reorder_delay_s=f.reorder_delay_s,
                             until_s=self.attack_until_s),
        )
        self.learners = [self._new_node(m) for m in range(run.learners)]
        self._by_name = {node.name: node for node in self.learners}
        self.windows = plan_windows(f, learners=run.learners, until_s=self.attack_until_s, seed=run.seed,
                                    shards=protocol.shards)
        self.injected: Counter[str] = Counter()
        self.coherence: list[tuple[int, float]] = []
        """(contributions, coherence) of every round that merged two or more (``RoundClosed.coherence``)."""
        self.timeline = Timeline()
        self.observer = observer
        self._next_snapshot_s = 0.0
        self.limit_s = 2 * recorder.horizon_s() + 100.0
        """Virtual time after which a run that has not finished is given up (a liveness failure)."""
        self.tokens = 0
        self._call_ids = itertools.count()

    def _new_node(self, m: int) -> LearnerNode:
        model = self.workload.new_model()
        name = f"learner-{m}"
        return LearnerNode(m, name, model, self.workload.new_trainer(model), self.workload.sampler(m),
                           self._new_core(name, model, boot=0))

    def _new_core(self, name: str, model: torch.nn.Module, boot: int) -> Learner:
        return Learner(name, self.protocol, self.plan, dict(model.named_parameters()), boot=f"{name}#{boot}",
                       tokens_per_step=self.tokens_per_step)

    def new_call_id(self) -> int:
        return next(self._call_ids)

    def process_up(self, m: int, boot: int) -> bool:
        """Is learner ``m``'s process ``boot`` still running (a message for it can still arrive)?"""
        node = self.learners[m]
        return node.up and node.boot == boot

    def rpc_deadline_s(self, payload_bytes: int) -> float:
        """How long a caller waits for an answer carrying ``payload_bytes`` (gRPC's deadline)."""
        return self.config.cluster.rpc_timeout_s + 8.0 * payload_bytes / self.config.cluster.bandwidth_bps

    # ---- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.start()
        while self.running():
            self.step_event()
            if self.observer and self.queue.now >= self._next_snapshot_s:
                self.observer(take_snapshot(self))
                self._next_snapshot_s = self.queue.now + SNAPSHOT_EVERY_S
        result = self.finish()
        if self.observer:
            self.observer(take_snapshot(self))
        return result

    def running(self) -> bool:
        return bool(len(self.queue)) and not self.finished and self.queue.now <= self.limit_s

    @property
    def finished(self) -> bool:
        return all(sync.finished for sync in self.syncs)

    def sync_of(self, fragment: int) -> SyncNode:
        return self.syncs[self.protocol.shard_of(fragment)]

    def start(self) -> None:
        for sync in self.syncs:
            sync.start(self)
        for node in self.learners:
            node.execute(self, node.core.start(0.0))
            self._schedule_failure(node.index)
        for w in self.windows:
            kind = {TimedFault.PARTITION: Ev.PARTITION, TimedFault.FREEZE: Ev.FREEZE,
                    TimedFault.SYNC_CRASH: Ev.SYNC_CRASH}[w.kind]
            self.queue.at(w.start_s, kind, w.target, w.end_s)
        self.evaluate()

    def step_event(self) -> None:
        """Take the next event off the queue and carry it out."""
        event = self.queue.pop()
        kind, args = event.kind, event.args
        if kind in _AT_LEARNER:
            node = self.learners[args[0]]
            if args[1] != node.boot or not node.up:
                return  # it died with the process it was meant for
            if self.queue.now < node.frozen_until_s:
                self.queue.at(node.frozen_until_s, kind, *args)  # nothing runs in a stopped process
                return
            if kind in (Ev.REPLY, Ev.PUSH) and self.network.partitioned(node.name, self.queue.now):
                return
            self._at_learner(node, kind, args[2:])
            node.advance(self)
        elif kind is Ev.REQUEST:
            if not self.network.partitioned(self.learners[args[0]].name, self.queue.now):
                m, boot, call_id, request, shard = args
                self.syncs[shard].on_request(self, m, boot, call_id, request)
        elif kind is Ev.SYNC_TICK:
            shard, incarnation = args
            self.syncs[shard].on_tick(self, incarnation)
        elif kind is Ev.DELIVERED:
            self.syncs[args[0]].on_delivered(self, *args[1:])
        else:
            self._fate(kind, args)

    def _at_learner(self, node: LearnerNode, kind: Ev, args: tuple[Any, ...]) -> None:
        if kind is Ev.STEP_END:
            node.on_step_end(self, *args)
        elif kind is Ev.REPLY:
            node.on_reply(self, *args)
        elif kind is Ev.PUSH:
            node.on_push(self, *args)
        elif kind is Ev.CALL_TIMEOUT:
            node.on_timeout(self, *args)
        else:
            node.on_tick(self)

    def _fate(self, kind: Ev, args: tuple[Any, ...]) -> None:
        """Failures from the trace and the adversary's timed faults."""
        if kind is Ev.CRASH:
            (m,) = args
            outage = self.recorder.trace.outage_at(m, self.queue.now)
            assert outage is not None
            self.learners[m].crash()
            self.injected["learner_crash"] += 1
            self.timeline.add(self.queue.now, Happening.FAILURE, m)
            self.queue.at(outage.up_s, Ev.RECOVER, m)
        elif kind is Ev.RECOVER:
            (m,) = args
            node = self.learners[m]
            self.timeline.add(self.queue.now, Happening.RESTART, m)
            node.restart(self, self._new_core(node.name, node.model, node.boot))
            self._schedule_failure(m)
            node.advance(self)
        elif kind is Ev.FREEZE:
            m, until = args
            node = self.learners[m]
            if node.up:
                node.frozen_until_s = max(node.frozen_until_s, until)
                self.injected["freeze"] += 1
                self.queue.at(until, Ev.THAW, m)
        elif kind is Ev.THAW:
            node = self.learners[args[0]]
            if node.up and self.queue.now >= node.frozen_until_s:
                node.on_tick(self)
                node.advance(self)
        elif kind is Ev.PARTITION:
            m, until = args
            self.network.partition(self.learners[m].name, until)
            self.injected["partition"] += 1
            self.queue.at(until, Ev.PARTITION_END, m)
        elif kind is Ev.PARTITION_END:
            node = self.learners[args[0]]
            if node.up and not self.network.partitioned(node.name, self.queue.now):
                for sync in self.syncs:
                    sync.replay_to(self, node.name, list(node.core.versions))
        elif kind is Ev.SYNC_CRASH:
            shard, until = args
            sync = self.syncs[shard]
            if sync.up and not sync.finished:
                sync.crash(self)
                self.injected["sync_crash"] += 1
                self.queue.at(until, Ev.SYNC_RESTART, shard)
        elif kind is Ev.SYNC_RESTART:
            self.syncs[args[0]].restart(self)

    def _schedule_failure(self, m: int) -> None:
        down = self.recorder.trace.next_down(m, self.queue.now if self.queue.now > 0 else -1.0)
        if down < self.attack_until_s:
            self.queue.at(down, Ev.CRASH, m)

    # ---- what the nodes call ---------------------------------------------------------------

    def push(self, m: int, boot: int, fragment: int, payload_bytes: int, kind: Ev, *args: Any) -> float | None:
        """Send a message down to learner ``m`` (its process ``boot``); returns its first arrival."""
        name = self.learners[m].name
        arrivals = self.network.deliveries(name, Direction.DOWN, fragment, payload_bytes, self.queue.now)
        for arrival in arrivals:
            self.queue.at(arrival, kind, m, boot, *args)
        return arrivals[0] if arrivals else None

    def push_to(self, name: str, fragment: int, payload_bytes: int, message: Any) -> float | None:
        node = self._by_name[name]
        return self.push(node.index, node.boot, fragment, payload_bytes, Ev.PUSH, message)

    def on_round(self, record: RoundClosed, value: torch.Tensor) -> None:
        if self.checker:
            self.checker.on_round(record, value)
        if len(record.merged) >= 2:
            self.coherence.append((len(record.merged), record.coherence))
        self.timeline.add(self.queue.now, Happening.MERGE)
        share = self._share[record.fragment]
        for mc in record.merged:
            node = self._by_name[mc.learner_id]
            offset = node.offsets.get((record.incarnation, mc.session))
            if offset is not None:
                first = offset + mc.first_step
                self.recorder.accounting.credit(node.index, first, first + mc.steps - 1, share)

    def versions(self) -> list[int]:
        """Every fragment's global version, from the shard that owns it."""
        return [self.sync_of(f.index).core.versions()[self.sync_of(f.index).core.owned.index(f.index)]
                for f in self.plan.fragments]

    def evaluate(self) -> dict[str, Any]:
        params = dict(self.eval_model.named_parameters())
        with torch.no_grad():
            for f in self.plan.fragments:
                unflatten_into(self.sync_of(f.index).core.value(f.index), [params[n] for n in f.param_names])
        alive = set.intersection(*(set(sync.core.alive()) for sync in self.syncs))
        return self.recorder.record(
            now=self.queue.now,
            tokens=self.tokens,
            model=self.eval_model,
            extra={"fragment_versions": self.versions(), "alive": len(alive), **self.events().counters()},
        )

    def events(self) -> RunEvents:
        """What happened up to now (``summary.json``'s ``events``)."""
        return self.timeline.summarize(self.queue.now, self.recorder.timer.slow_learners())

    def so_far(self) -> dict[str, Any]:
        """An interrupted run's summary figures (:meth:`ddiloco.sim.harness.Recorder.so_far`)."""
        return {**self.recorder.so_far(self.queue.now, self.tokens), "fragment_versions": self.versions(),
                "events": self.events().to_dict()}

    def finish(self) -> dict[str, Any]:
        rounds: Counter[str] = Counter()
        rejections: Counter[str] = Counter()
        for sync in self.syncs:
            if self.checker and sync.up:
                self.checker.at_end(sync.incarnation, sync.core.pending_tokens())
            status = sync.core.status()
            rounds.update(status.rounds_closed)
            rejections.update(status.rejections)
        final = self.evaluate()
        return {
            "final": final,
            "weights_sha256": weights_sha256(self.eval_model),
            "fragment_versions": self.versions(),
            "rounds_closed": dict(rounds),
            "rejections": dict(rejections),
            "steps_per_learner": [self.recorder.accounting.steps(m) for m in range(len(self.learners))],
            "finished": self.finished,
            "faults": {**{str(k): v for k, v in self.network.injected.items()}, **self.injected},
            "merge_coherence": _mean(c for _, c in self.coherence),
            "merge_width": _mean(n for n, _ in self.coherence),
            "events": self.events().to_dict(),
        }


def _mean(values: Iterable[float]) -> float | None:
    """Mean rounded for a summary; None for nothing (no round merged two contributions)."""
    values = list(values)
    return round(sum(values) / len(values), 4) if values else None
