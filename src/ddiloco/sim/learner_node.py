"""A learner process of the virtual cluster: a real model and trainer around the core's
:class:`~ddiloco.core.learner.Learner`, whose actions it carries out over the virtual network.

It only executes: a ``Send`` becomes a call on the uplink, a reply or an update is handed
back to the core, a call that gets no answer before its deadline is reported undelivered.
What any of it means is the core's business. The node also plays the process's fate: it
crashes and restarts (a new *boot*: fresh core and optimizer, it joins again), it freezes
(nothing runs until it thaws; the synchronizer sees silence), its link may be cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ddiloco.core.actions import (
    Accepted,
    Admitted,
    Fail,
    LearnerAction,
    Refused,
    Reply,
    Send,
    SendHeartbeat,
    SendJoin,
    SendLeave,
)
from ddiloco.core.learner import Learner, LearnerPhase
from ddiloco.core.messages import FragmentUpdate, Request, StopNotice
from ddiloco.sim.events import Ev
from ddiloco.sim.invariants import InvariantViolation
from ddiloco.measures import Direction
from ddiloco.sim.timeline import Happening

if TYPE_CHECKING:
    from ddiloco.sim.cluster import VirtualCluster


@dataclass(slots=True)
class LearnerNode:
    index: int
    name: str
    model: Any
    trainer: Any
    sampler: Any
    core: Learner
    boot: int = 0
    up: bool = True
    frozen_until_s: float = 0.0
    stepping: bool = False
    step_offset: int = 0
    """Steps of earlier boots (the accounting numbers a learner's steps across restarts)."""
    calls: dict[int, tuple[Request, int]] = field(default_factory=dict)
    """Calls awaiting an answer: the request and the shard it went to."""
    tick_at: float | None = None
    offsets: dict[tuple[int, int], int] = field(default_factory=dict)
    """(incarnation, session) → step offset of the boot that held it (to credit merged steps)."""
    failure: Fail | None = None

    @property
    def ready(self) -> bool:
        """Holds the global state from every shard (the timeline's join and rejoin)."""
        return self.core.joined and not self.core.rejoining()

    # ---- carrying out the core's actions ---------------------------------------------------

    def execute(self, cluster: "VirtualCluster", actions: list[LearnerAction]) -> None:
        for action in actions:
            if isinstance(action, Send):
                contribution = action.encode()
                if cluster.checker:
                    cluster.checker.on_sent(self.core, contribution)
                self.call(cluster, contribution, action.fragment, len(contribution.payload), action.shard)
            elif isinstance(action, (SendJoin, SendHeartbeat, SendLeave)):
                self.call(cluster, action.message, -1, 0, action.shard)
            elif isinstance(action, Fail):
                self.failure = action
        self.schedule_tick(cluster)

    def call(self, cluster: "VirtualCluster", request: Request, fragment: int, payload_bytes: int, shard: int) -> None:
        """One RPC to a synchronizer shard: the request travels up; the reply (or the deadline) comes back."""
        now = cluster.queue.now
        call_id = cluster.new_call_id()
        self.calls[call_id] = (request, shard)
        for arrival in cluster.network.deliveries(self.name, Direction.UP, fragment, payload_bytes, now):
            cluster.queue.at(arrival, Ev.REQUEST, self.index, self.boot, call_id, request, shard)
        cluster.queue.at(now + cluster.rpc_deadline_s(payload_bytes), Ev.CALL_TIMEOUT, self.index, self.boot, call_id)

    def schedule_tick(self, cluster: "VirtualCluster") -> None:
        deadline = self.core.next_deadline()
        if deadline is not None and (self.tick_at is None or deadline < self.tick_at):
            self.tick_at = deadline
            cluster.queue.at(deadline, Ev.LEARNER_TICK, self.index, self.boot)

    # ---- what arrives ----------------------------------------------------------------------

    def on_reply(self, cluster: "VirtualCluster", call_id: int, reply: Reply, shard: int) -> None:
        call = self.calls.pop(call_id, None)
        if call is None:
            return  # the call already timed out (or this is a duplicate answer)
        request, _ = call
        now = cluster.queue.now
        if isinstance(reply, Admitted):
            held = self.core.links[shard].session
            was_ready, rejoin = self.ready, self.boot > 0 or self.core.joined
            actions = self.core.on_admitted(reply.state, now, stop=reply.stop, shard=shard)
            if self.ready and not was_ready:
                cluster.timeline.add(now, Happening.REJOINED if rejoin else Happening.JOINED, self.index)
            session = self.core.links[shard].session
            if session != held and session is not None:
                self.offsets[(session.incarnation, session.number)] = self.step_offset
                if cluster.checker:
                    for f in reply.state.fragments:
                        cluster.checker.on_anchor(self.core, f.fragment)
        elif isinstance(reply, Accepted):
            actions = self.core.on_accepted(request, now, stop=reply.stop, shard=shard)
        else:
            assert isinstance(reply, Refused)
            actions = self.core.on_refused(request, reply.reason, now, shard=shard)
        self.execute(cluster, actions)

    def on_push(self, cluster: "VirtualCluster", message: FragmentUpdate | StopNotice) -> None:
        now = cluster.queue.now
        if isinstance(message, StopNotice):
            self.execute(cluster, self.core.on_stop(now))
            return
        before = self.core.versions[message.fragment]
        actions = self.core.on_update(message, now)
        if cluster.checker and self.core.versions[message.fragment] != before:
            cluster.checker.on_anchor(self.core, message.fragment)
        self.execute(cluster, actions)

    def on_timeout(self, cluster: "VirtualCluster", call_id: int) -> None:
        call = self.calls.pop(call_id, None)
        if call is not None:
            request, shard = call
            self.execute(cluster, self.core.on_undelivered(request, cluster.queue.now, shard=shard))

    def on_tick(self, cluster: "VirtualCluster") -> None:
        self.tick_at = None
        now = cluster.queue.now
        actions = self.core.tick(now)
        deadline = self.core.next_deadline()
        if deadline is not None and deadline <= now:
            raise InvariantViolation(f"{self.name}'s core asks to be woken at {deadline!r} after its tick at {now!r}: "
                                     "time would stand still")
        self.execute(cluster, actions)

    # ---- the training loop -----------------------------------------------------------------

    def advance(self, cluster: "VirtualCluster") -> None:
        """Between steps: close when told to stop, else start the next step if the core allows."""
        if not self.up or self.stepping or self.failure is not None:
            return
        now = cluster.queue.now
        if self.core.phase is LearnerPhase.STOPPING:
            self.execute(cluster, self.core.close(now))
        elif self.core.can_step(now):
            self.stepping = True
            cluster.queue.at(now + cluster.recorder.timer.draw(self.index), Ev.STEP_END, self.index, self.boot, now)

    def on_step_end(self, cluster: "VirtualCluster", started_s: float) -> None:
        self.stepping = False
        x, y = self.sampler.next_batch()
        now = cluster.queue.now
        self.trainer.step(x, y, cluster.recorder.run_progress(cluster.tokens, now))
        tokens = x.numel()
        cluster.tokens += tokens
        sends = self.core.record_step(tokens, now - started_s, now)
        cluster.recorder.accounting.add_step(self.index, self.step_offset + self.core.step, started_s, now)
        self.execute(cluster, list(sends))
        if cluster.recorder.eval_due(cluster.tokens, now):
            cluster.evaluate()

    # ---- the process's fate ----------------------------------------------------------------

    def crash(self) -> None:
        self.up = False
        self.stepping = False
        self.boot += 1  # everything in flight for the old process dies with it
        self.calls.clear()
        self.tick_at = None

    def restart(self, cluster: "VirtualCluster", core: Learner) -> None:
        """A fresh process: new core (new boot), new optimizer state; it joins and adopts the global state."""
        self.step_offset += self.core.step
        self.core = core
        self.up = True
        self.trainer.reset_optimizer()
        cluster.network.reset(self.name, cluster.queue.now)
        self.execute(cluster, core.start(cluster.queue.now))
