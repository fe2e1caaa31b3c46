"""The virtual cluster: a deterministic discrete-event driver of the protocol core.

One process, one virtual clock. Each learner is a real PyTorch model trained by real AdamW
steps on its own shard; only *time* is simulated: a step lasts what the learner's speed
profile draws, a message lasts latency + bits / bandwidth on a FIFO link, and failures come
from the seeded trace. Events are ordered by (time, sequence number), every random draw
comes from a seeded per-component generator, so the same seed gives the same run bit for
bit. The driver only moves messages between :class:`~ddiloco.core.learner.Learner` and
:class:`~ddiloco.core.synchronizer.Synchronizer`; the protocol decisions are theirs.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddiloco.core.fragments import FragmentPlan, flatten, plan_fragments, unflatten_into
from ddiloco.core.learner import Learner, UpdateResult
from ddiloco.core.messages import Broadcast, Contribution, FragmentUpdate, GlobalState, Rejected, RoundClosed
from ddiloco.core.synchronizer import Synchronizer
from ddiloco.sim.harness import Recorder
from ddiloco.workload.workload import Workload, weights_sha256
from ddiloco.sim.invariants import InvariantChecker
from ddiloco.sim.network import HEADER_BYTES, Link
from ddiloco.workload.corpus import BatchSampler
from ddiloco.workload.model import ByteTransformer
from ddiloco.workload.trainer import InnerTrainer


@dataclass(slots=True)
class _SimLearner:
    index: int
    name: str
    model: ByteTransformer
    trainer: InnerTrainer
    sampler: BatchSampler
    core: Learner
    up_link: Link
    down_link: Link
    up: bool = True
    incarnation: int = 0
    stepping: bool = False
    registering: bool = False
    beating: int = -1
    """Incarnation whose heartbeat chain is running (one chain per incarnation)."""


@dataclass(order=True, slots=True)
class _Event:
    time: float
    seq: int
    kind: str = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)


class VirtualCluster:
    """Runs Decoupled DiLoCo (or synchronous DiLoCo) on M virtual learners."""

    def __init__(self, workload: Workload, recorder: Recorder, *, check_invariants: bool = True) -> None:
        self.config = config = workload.config
        self.workload = workload
        self.recorder = recorder
        self.protocol = config.protocol.for_mode(config.run.mode, config.run.learners)
        reference = workload.new_model()
        self.plan: FragmentPlan = plan_fragments(
            [(n, tuple(p.shape)) for n, p in reference.named_parameters()],
            num_fragments=self.protocol.fragments,
            period=self.protocol.period,
            strategy=self.protocol.fragmentation,
            embedding_names=reference.embedding_param_names(),
        )
        params = dict(reference.named_parameters())
        self.sync = Synchronizer(
            self.protocol,
            [flatten([params[n] for n in f.param_names]) for f in self.plan.fragments],
            embedding_fragments=[f.index for f in self.plan.fragments if f.is_embedding],
        )
        total = sum(f.numel for f in self.plan.fragments)
        self._share = [f.numel / total for f in self.plan.fragments]
        self.eval_model = reference  # receives the synchronizer's values before each evaluation
        self.checker = InvariantChecker(seed=config.run.seed) if check_invariants else None
        self.learners = [self._new_learner(m) for m in range(config.run.learners)]
        self._by_name = {lr.name: lr for lr in self.learners}
        self._queue: list[_Event] = []
        self._seq = itertools.count()
        self._tick_at: float | None = None
        self.now = 0.0
        self.tokens = 0

    def _new_learner(self, m: int) -> _SimLearner:
        model = self.workload.new_model()
        name = f"learner-{m}"
        c = self.config.cluster
        return _SimLearner(
            index=m,
            name=name,
            model=model,
            trainer=self.workload.new_trainer(model),
            sampler=self.workload.sampler(m),
            core=Learner(name, self.protocol, self.plan, dict(model.named_parameters())),
            up_link=Link(c.bandwidth_bps, c.latency_s),
            down_link=Link(c.bandwidth_bps, c.latency_s),
        )

    # ---- event plumbing ------------------------------------------------------------------

    def _at(self, time: float, kind: str, *args: Any) -> None:
        heapq.heappush(self._queue, _Event(time, next(self._seq), kind, args))

    def _send_up(self, lr: _SimLearner, fragment: int, payload_bytes: int, kind: str, *args: Any) -> None:
        size = payload_bytes + HEADER_BYTES
        self.recorder.bytes.add(lr.name, fragment, "up", size)
        self._at(lr.up_link.send(self.now, size), kind, *args)

    def _send_down(self, lr: _SimLearner, fragment: int, payload_bytes: int, kind: str, *args: Any) -> float:
        size = payload_bytes + HEADER_BYTES
        self.recorder.bytes.add(lr.name, fragment, "down", size)
        arrival = lr.down_link.send(self.now, size)
        self._at(arrival, kind, lr.index, lr.incarnation, *args)
        return arrival

    def _schedule_tick(self) -> None:
        deadline = self.sync.next_deadline()
        if deadline is not None and (self._tick_at is None or deadline < self._tick_at):
            self._tick_at = deadline
            self._at(deadline, "sync_tick")

    # ---- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        for lr in self.learners:
            self._register(lr)
            self._schedule_failure(lr.index)
        self._evaluate()
        handlers: dict[str, Callable[..., None]] = {
            "step_end": self._on_step_end,
            "contribution": self._on_contribution,
            "update": self._on_update,
            "heartbeat": self._on_heartbeat,
            "send_heartbeat": self._on_send_heartbeat,
            "register": self._on_register,
            "state": self._on_state,
            "fail": self._on_fail,
            "recover": self._on_recover,
            "sync_tick": self._on_tick,
        }
        while self._queue and not self._budget_spent():
            event = heapq.heappop(self._queue)
            if self.config.run.time_s and event.time > self.config.run.time_s:
                self.now = self.config.run.time_s
                break
            self.now = event.time
            handlers[event.kind](*event.args)
        return self._finish()

    def _budget_spent(self) -> bool:
        run = self.config.run
        return bool(run.tokens) and not run.time_s and self.tokens >= run.tokens

    def _finish(self) -> dict[str, Any]:
        """End of training: deliver what is on the wire, flush every live learner, drain."""
        for event in sorted(self._queue):
            if event.kind == "contribution":
                self._on_contribution(*event.args)
        self._queue.clear()
        for lr in self.learners:
            if lr.up and lr.core.joined and not lr.registering:
                for c in lr.core.flush():
                    self.recorder.bytes.add(lr.name, c.fragment, "up", len(c.payload) + HEADER_BYTES)
                    self._on_contribution(c)
        self._handle(self.sync.drain(self.now))
        if self.checker:
            self.checker.at_end(self.sync)
        final = self._evaluate()
        return {
            "final": final,
            "weights_sha256": weights_sha256(self.eval_model),
            "fragment_versions": list(self.sync.versions()),
            "rounds_closed": dict(self.sync.rounds_closed),
            "rejections": dict(self.sync.rejections),
            "steps_per_learner": [self.recorder.accounting.steps(m) for m in range(len(self.learners))],
        }

    def _evaluate(self) -> dict[str, Any]:
        params = dict(self.eval_model.named_parameters())
        with torch.no_grad():
            for f in self.plan.fragments:
                unflatten_into(self.sync.value(f.index), [params[n] for n in f.param_names])
        return self.recorder.record(
            now=self.now,
            tokens=self.tokens,
            model=self.eval_model,
            extra={"fragment_versions": list(self.sync.versions()), "alive": len(self.sync.alive())},
        )

    # ---- learner side --------------------------------------------------------------------

    def _register(self, lr: _SimLearner) -> None:
        lr.registering = True
        self._send_up(lr, -1, 0, "register", lr.index, lr.incarnation)

    def _start_step(self, lr: _SimLearner) -> None:
        if lr.up and not lr.stepping and not lr.registering and lr.core.can_step() and not self._budget_spent():
            lr.stepping = True
            duration = self.recorder.timer.draw(lr.index)
            self._at(self.now + duration, "step_end", lr.index, lr.incarnation, self.now)

    def _on_step_end(self, m: int, incarnation: int, started: float) -> None:
        lr = self.learners[m]
        if not lr.up or incarnation != lr.incarnation:
            return  # the step died with its learner
        lr.stepping = False
        x, y = lr.sampler.next_batch()
        lr.trainer.step(x, y)
        tokens = x.numel()
        self.tokens += tokens
        contributions = lr.core.record_step(tokens, self.now - started)
        self.recorder.accounting.add_step(m, lr.core.step, started, self.now)
        for c in contributions:
            self._send_up(lr, c.fragment, len(c.payload), "contribution", c)
        if self.recorder.eval_due(self.tokens, self.now):
            self._evaluate()
        self._start_step(lr)

    def _on_update(self, m: int, incarnation: int, update: FragmentUpdate) -> None:
        lr = self.learners[m]
        if not lr.up or incarnation != lr.incarnation or not lr.core.joined:
            return
        result = lr.core.apply_update(update)
        if result is UpdateResult.GAP:
            self._register(lr)  # missed a version: fetch the full state
            return
        if result is UpdateResult.APPLIED and self.checker:
            self.checker.on_anchor(lr.name, update.fragment, update.version, lr.core.anchor(update.fragment))
        self._start_step(lr)

    def _on_state(self, m: int, incarnation: int, state: GlobalState) -> None:
        lr = self.learners[m]
        if not lr.up or incarnation != lr.incarnation:
            return
        lr.core.adopt(state)
        lr.registering = False
        if self.checker:
            for f in state.fragments:
                self.checker.on_anchor(lr.name, f.fragment, f.version, lr.core.anchor(f.fragment))
        self._start_step(lr)

    def _on_send_heartbeat(self, m: int, incarnation: int) -> None:
        lr = self.learners[m]
        if lr.up and incarnation == lr.incarnation:
            self._send_up(lr, -1, 0, "heartbeat", m, incarnation)
            self._at(self.now + self.protocol.heartbeat_interval_s, "send_heartbeat", m, incarnation)

    def _on_fail(self, m: int) -> None:
        lr = self.learners[m]
        outage = self.recorder.trace.outage_at(m, self.now)
        assert outage is not None
        lr.up = False
        lr.stepping = False
        lr.incarnation += 1
        self._at(outage.up_s, "recover", m)

    def _on_recover(self, m: int) -> None:
        """A fresh process: global state from the synchronizer, new inner optimizer state."""
        lr = self.learners[m]
        lr.up = True
        lr.incarnation += 1
        lr.trainer.reset_optimizer()
        lr.up_link.busy_until_s = lr.down_link.busy_until_s = self.now
        self._register(lr)
        self._schedule_failure(m)

    def _schedule_failure(self, m: int) -> None:
        down = self.recorder.trace.next_down(m, self.now if self.now > 0 else -1.0)
        if down != float("inf"):
            self._at(down, "fail", m)

    # ---- synchronizer side ---------------------------------------------------------------

    def _on_register(self, m: int, incarnation: int) -> None:
        lr = self.learners[m]
        state = self.sync.register(lr.name, self.now)
        self._schedule_tick()
        size = sum(4 * f.values.numel() for f in state.fragments)
        self._send_down(lr, -1, size, "state", state)
        if incarnation == lr.incarnation and lr.up and lr.beating != incarnation:
            lr.beating = incarnation
            self._at(self.now + self.protocol.heartbeat_interval_s, "send_heartbeat", m, incarnation)

    def _on_heartbeat(self, m: int, incarnation: int) -> None:
        lr = self.learners[m]
        try:
            self.sync.heartbeat(lr.name, self.now)
        except Rejected:
            if lr.up and incarnation == lr.incarnation and not lr.registering:
                self._register(lr)  # our lease expired: rejoin with the full state
        self._schedule_tick()

    def _on_contribution(self, c: Contribution) -> None:
        try:
            actions = self.sync.contribute(c, self.now)
        except Rejected:
            return  # counted by the synchronizer (summary "rejections")
        if self.checker:
            self.checker.on_accepted(c)
        self._handle(actions)
        self._schedule_tick()

    def _on_tick(self) -> None:
        self._tick_at = None
        self._handle(self.sync.tick(self.now))
        self._schedule_tick()

    def _handle(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, RoundClosed):
                if self.checker:
                    self.checker.on_round(action, self.sync)
                share = self._share[action.fragment]
                for mc in action.merged:
                    m = self._by_name[mc.learner_id].index
                    self.recorder.accounting.credit(m, mc.first_step, mc.first_step + mc.steps - 1, share)
            elif isinstance(action, Broadcast):
                arrivals = [
                    self._send_down(self._by_name[name], action.update.fragment, len(action.update.payload),
                                    "update", action.update)
                    for name in action.recipients
                ]
                if arrivals:
                    self.sync.observe_sync_time(max(arrivals) - self.now)
            # LeaseExpired needs nothing from this driver: the core already stopped waiting.
