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
from dataclasses import replace
from typing import Any

import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared import deadlines
from ddiloco.core.shared.actions import RoundClosed
from ddiloco.core.shared.deadlines import LinkExpectation, call_deadline_s
from ddiloco.core.shared.fragments import FragmentPlan, flatten, plan_fragments, unflatten_into
from ddiloco.core.shared.staleness import StalenessBound
from ddiloco.core.sync_side.refusals import honest_total
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.measures.useful_work import fragment_shares
from ddiloco.measures.wire_bytes import Direction
from ddiloco.settings.fault_kinds import FaultKind
from ddiloco.sim.adversary import plan_windows
from ddiloco.sim.data_stream import DataStreams
from ddiloco.sim.events import (
    Arrive,
    AtLearner,
    CallTimeout,
    EventQueue,
    LearnerTick,
    PushArrives,
    ReplyArrives,
    RequestArrives,
    StateArrives,
    StepEnd,
    SyncTick,
    UploadCut,
    UploadHeader,
)
from ddiloco.sim.fate import Fate, window_event
from ddiloco.sim.harness import Recorder
from ddiloco.sim.invariants import InvariantChecker
from ddiloco.sim.learner_node import LearnerNode
from ddiloco.sim.network import HEADER_BYTES, NetFaults, Network
from ddiloco.sim.snapshot import ClusterSnapshot, SnapshotFn, take_snapshot
from ddiloco.sim.sync_node import SyncNode
from ddiloco.sim.timeline import Happening, RunEvents, Timeline
from ddiloco.workload.workload import Workload, weights_sha256

SNAPSHOT_EVERY_S = 1.0
"""Virtual seconds between two snapshots for the observer (a terminal redraws a few times a second)."""


class VirtualCluster:
    """Runs Decoupled DiLoCo (or synchronous DiLoCo) on M virtual learners.

    It is the nodes' :class:`~ddiloco.sim.host.NodeHost`: their clock, links and bookkeeping.
    """

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
        self.link = LinkExpectation(answer_s=cluster.rpc_timeout_s, bytes_per_s=cluster.bandwidth_bps / 8.0)
        """Every learner's virtual link, as its calls' deadlines see it (``core/shared/deadlines.py``)."""
        limits = config.run_limits(checkpoint_every_rounds=cluster.checkpoint_every_rounds,
                                   checkpoint_every_s=cluster.checkpoint_every_s)
        self.syncs = [
            SyncNode(lambda incarnation, shard=shard: Synchronizer(protocol, initial, embeds, limits=limits,
                                                                   incarnation=incarnation, shard=shard,
                                                                   session_salt=incarnation),
                     seed=run.seed, shard=shard, max_learners=limits.max_learners)
            for shard in range(protocol.shards)
        ]
        self.tokens_per_step = workload.tokens_per_step
        self._share = fragment_shares(f.numel for f in self.plan.fragments)
        self.eval_model = reference  # receives the synchronizer's values before each evaluation
        self.checker = (InvariantChecker(seed=run.seed, quorum=protocol.quorum,
                                         staleness_max=StalenessBound.of(protocol).versions,
                                         staleness_s=StalenessBound.of(protocol).seconds,
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
        self.streams = DataStreams(run.learners)
        self._by_name = {node.name: node for node in self.learners}
        self.windows = plan_windows(f, learners=run.learners, until_s=self.attack_until_s, seed=run.seed,
                                    shards=protocol.shards)
        self.coherence: list[tuple[int, float]] = []
        """(contributions, coherence) of every round that merged two or more (``RoundClosed.coherence``)."""
        self.timeline = Timeline()
        self.observer = observer
        self._next_snapshot_s = 0.0
        self.limit_s = 2 * recorder.horizon_s() + 100.0
        """Virtual time after which a run that has not finished is given up (a liveness failure)."""
        self.tokens = 0
        self._call_ids = itertools.count()
        self.fate = Fate(self, learners=self.learners, syncs=self.syncs, network=self.network,
                         trace=recorder.trace, timeline=self.timeline, new_core=self.new_core,
                         attack_until_s=self.attack_until_s, flood_per_s=f.join_flood_per_s)

    def _new_node(self, m: int) -> LearnerNode:
        model = self.workload.new_model()
        name = f"learner-{m}"
        return LearnerNode(m, name, model, self.workload.new_trainer(model), self.workload.sampler(m),
                           self.new_core(name, model, boot=0))

    def new_core(self, name: str, model: torch.nn.Module, boot: int) -> Learner:
        return Learner(name, self.protocol, self.plan, dict(model.named_parameters()), boot=f"{name}#{boot}",
                       tokens_per_step=self.tokens_per_step)

    def new_call_id(self) -> int:
        return next(self._call_ids)

    def process_up(self, m: int, boot: int) -> bool:
        """Is learner ``m``'s process ``boot`` still running (a message for it can still arrive)?"""
        node = self.learners[m]
        return node.up and node.boot == boot

    def call_deadline_s(self, nbytes: int) -> float:
        """How long a caller waits for a call that carries ``nbytes`` both ways (gRPC's deadline):
        the rule of ``core/shared/deadlines.py`` on the virtual link, which the simulator knows exactly."""
        return call_deadline_s(nbytes, self.link)

    # ---- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.start()
        while self.running():
            self.step_event()
            if self.observer and self.queue.now >= self._next_snapshot_s:
                self.observer(self.snapshot())
                self._next_snapshot_s = self.queue.now + SNAPSHOT_EVERY_S
        result = self.finish()
        if self.observer:
            self.observer(self.snapshot())
        return result

    def snapshot(self) -> ClusterSnapshot:
        return take_snapshot(self.queue.now, self.tokens, self.versions(), self.learners, self.recorder, self.timeline)

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
        arrivals = self.config.cluster.arrivals_s(len(self.learners))
        for node in self.learners:
            if arrivals[node.index] > 0:  # capacity that frees up mid-run: it joins then
                node.up, node.arrives_s = False, arrivals[node.index]
                self.queue.at(node.arrives_s, Arrive(node.index))
                continue
            node.execute(self, node.core.start(0.0))
            self.fate.schedule_failure(node.index)
        for w in self.windows:
            self.queue.at(w.start_s, window_event(w))
        self.evaluate()

    def step_event(self) -> None:
        """Take the next event off the queue and carry it out."""
        event = self.queue.pop().what
        now = self.queue.now
        if isinstance(event, AtLearner):
            node = self.learners[event.m]
            if event.boot != node.boot or not node.up:
                return  # it died with the process it was meant for
            if now < node.frozen_until_s:
                self.queue.at(node.frozen_until_s, event)  # nothing runs in a stopped process
                return
            if isinstance(event, (ReplyArrives, PushArrives)) and self.network.partitioned(node.name, now):
                return
            if isinstance(event, StepEnd):
                node.on_step_end(self, event.started_s)
            elif isinstance(event, ReplyArrives):
                node.on_reply(self, event.call_id, event.reply, event.shard)
            elif isinstance(event, PushArrives):
                node.on_push(self, event.message)
            elif isinstance(event, CallTimeout):
                node.on_timeout(self, event.call_id)
            else:
                assert isinstance(event, LearnerTick)
                node.on_tick(self)
            node.advance(self)
        elif isinstance(event, UploadHeader):
            self.syncs[event.shard].on_upload_header(self, event.m, event.boot, event.call_id, event.request)
        elif isinstance(event, RequestArrives):
            if not self.network.partitioned(self.learners[event.m].name, now):
                self.syncs[event.shard].on_request(self, event.m, event.boot, event.call_id, event.request)
        elif isinstance(event, UploadCut):
            self.syncs[event.shard].on_upload_cut(self, event.incarnation, event.upload)
        elif isinstance(event, SyncTick):
            self.syncs[event.shard].on_tick(self, event.incarnation)
        elif isinstance(event, StateArrives):
            self.syncs[event.shard].on_delivered(self, event.incarnation, event.m, event.boot, event.admitted,
                                                 event.arrived)
        else:
            self.fate.befall(event)

    # ---- what the nodes call ---------------------------------------------------------------

    def send_up(self, learner: str, fragment: int, payload_bytes: int) -> list[float]:
        return self.network.deliveries(learner, Direction.UP, fragment, payload_bytes, self.queue.now)

    def uploads_stall(self, learner: str) -> bool:
        return self.network.stalled(learner, self.queue.now)

    def send_header(self, learner: str, fragment: int) -> float | None:
        return self.network.header(learner, fragment, self.queue.now)

    def push(self, event: AtLearner, fragment: int, payload_bytes: int) -> float | None:
        name = self.learners[event.m].name
        arrivals = self.network.deliveries(name, Direction.DOWN, fragment, payload_bytes, self.queue.now)
        for arrival in arrivals:
            self.queue.at(arrival, event)
        return arrivals[0] if arrivals else None

    def push_to(self, learner: str, fragment: int, payload_bytes: int, message: Any) -> float | None:
        node = self._by_name.get(learner)
        if node is None:  # a registration of the adversary's flood: nobody reads its stream
            return None
        size = payload_bytes + HEADER_BYTES  # the real synchronizer cuts a stream whose message
        if size / self.link.bytes_per_s > deadlines.stream_deadline_s(size, self.protocol):  # cannot leave in time
            return None
        return self.push(PushArrives(node.index, node.boot, message), fragment, payload_bytes)

    def left_at(self, learner: str) -> float:
        return self.network.left_at(learner, Direction.DOWN)

    def step_time_s(self, m: int) -> float:
        return self.recorder.timer.draw(m)

    def run_progress(self) -> float:
        return self.recorder.run_progress(self.tokens, self.queue.now)

    def on_step(self, m: int, tokens: int, step: int, started_s: float, batch: int) -> None:
        self.tokens += tokens
        self.recorder.accounting.add_step(m, step, started_s, self.queue.now)
        self.streams.trained(m, batch)

    def on_resume(self, m: int, batch: int) -> None:
        self.streams.resumed(m, batch)

    def after_step(self) -> None:
        if self.recorder.eval_due(self.tokens, self.queue.now):
            self.evaluate()

    def on_ready(self, m: int, rejoined: bool) -> None:
        self.timeline.add(self.queue.now, Happening.REJOINED if rejoined else Happening.JOINED, m)

    def reset_links(self, learner: str) -> None:
        self.network.reset(learner, self.queue.now)

    @property
    def injected(self) -> Counter[FaultKind]:
        """Faults injected so far: by the failure trace and the adversary, on processes and links."""
        return self.fate.injected + self.network.injected

    def on_round(self, record: RoundClosed, value: torch.Tensor) -> None:
        if self.checker:
            self.checker.on_round(record, value)
        if len(record.merged) >= 2:
            self.coherence.append((len(record.merged), record.coherence))
        self.timeline.add(self.queue.now, Happening.MERGE)
        share = self._share[record.fragment]
        for mc in record.merged:
            node = self._by_name[mc.learner_id]
            self.streams.merged(node.index, record.fragment, mc.first_step, mc.first_step + mc.steps - 1)
            base = node.step_bases.get(node.session_boots.get((record.incarnation, mc.session), -1))
            if base is not None:
                first = base + mc.first_step
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
        return replace(self.timeline.summarize(self.queue.now, self.recorder.timer.slow_learners()),
                       **self.streams.figures())

    def so_far(self) -> dict[str, Any]:
        """An interrupted run's summary figures (:meth:`ddiloco.sim.harness.Recorder.so_far`)."""
        return {**self.recorder.so_far(self.queue.now, self.tokens), "fragment_versions": self.versions(),
                "events": self.events().to_dict()}

    def finish(self) -> dict[str, Any]:
        rounds: Counter[str] = Counter()
        rejections: Counter[str] = Counter()
        refused: Counter[str] = Counter()
        clipped = 0
        for sync in self.syncs:
            if self.checker and sync.up:
                self.checker.at_end(sync.incarnation, sync.core.pending_tokens())
            status = sync.core.status()
            rounds.update(status.rounds_closed)
            rejections.update(status.rejections)
            rejections.update(sync.wire_rejections)
            refused.update(status.refused_steps)
            clipped += status.norms_clipped
        final = self.evaluate()
        return {
            "final": final,
            "weights_sha256": weights_sha256(self.eval_model),
            "fragment_versions": self.versions(),
            "rounds_closed": dict(rounds),
            "rejections": dict(rejections),
            "refused_steps": dict(refused),
            "honest_refused_steps": honest_total(refused),  # no virtual learner is hostile
            "norms_clipped": clipped,  # let in scaled down to the norm bound rather than refused
            "steps_per_learner": [self.recorder.accounting.steps(m) for m in range(len(self.learners))],
            "finished": self.finished,
            "faults": {str(k): v for k, v in self.injected.items()},
            "merge_coherence": _mean(c for _, c in self.coherence),
            "merge_width": _mean(n for n, _ in self.coherence),
            "events": self.events().to_dict(),
        }


def _mean(values: Iterable[float]) -> float | None:
    """Mean rounded for a summary; None for nothing (no round merged two contributions)."""
    values = list(values)
    return round(sum(values) / len(values), 4) if values else None
