"""A learner process of the virtual cluster: a real model and trainer around the core's
:class:`~ddiloco.core.learner_side.learner_core.Learner`, whose actions it carries out over the virtual network.

It only executes: a ``Send`` becomes a call on the uplink, a reply or an update is handed
back to the core, a call that gets no answer before its deadline is reported undelivered.
What any of it means is the core's business. The node also plays the process's fate: it
crashes and restarts (a new *boot*: fresh core and optimizer, it joins again), it freezes
(nothing runs until it thaws; the synchronizer sees silence), its link may be cut. A process
draws its data from where the synchronizer says its learner's data reached the global model
(``data_position``), as ``ddiloco learner`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.learner_side.learner_phase import LoopMove
from ddiloco.core.shared.actions import (
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
from ddiloco.core.shared.deadlines import join_state_bytes
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Request, StopNotice
from ddiloco.sim.events import CallTimeout, LearnerTick, RequestArrives, StepEnd, UploadHeader
from ddiloco.sim.host import NodeHost
from ddiloco.sim.invariants import InvariantViolation


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
    arrives_s: float = 0.0
    """When its process first starts: later than 0 for a late learner (``cluster.late_learners``)."""
    frozen_until_s: float = 0.0
    stepping: bool = False
    step_offset: int = 0
    """Steps of earlier boots (the accounting numbers a learner's steps across restarts)."""
    calls: dict[int, tuple[Request, int]] = field(default_factory=dict)
    """Calls awaiting an answer: the request and the shard it went to."""
    tick_at: float | None = None
    session_boots: dict[tuple[int, int], int] = field(default_factory=dict)
    """(incarnation, session) → the boot that held it (to credit merged steps)."""
    step_bases: dict[int, int] = field(default_factory=dict)
    """Per boot, what turns a contribution's step (numbered by the data stream) into the
    accounting's (numbered across boots): the steps of earlier boots less where its data resumed."""
    failure: Fail | None = None

    @property
    def ready(self) -> bool:
        """Holds the global state from every shard (the timeline's join and rejoin)."""
        return self.core.joined and not self.core.rejoining()

    # ---- carrying out the core's actions ---------------------------------------------------

    def execute(self, host: NodeHost, actions: list[LearnerAction]) -> None:
        for action in actions:
            if isinstance(action, Send):
                contribution = action.encode()
                if host.checker:
                    host.checker.on_sent(self.core, contribution)
                self.call(host, contribution, action.fragment, len(contribution.payload), action.shard)
            elif isinstance(action, SendJoin):  # the reply brings the shard's state back
                self.call(host, action.message, -1, 0, action.shard,
                          reply_bytes=join_state_bytes(self.core.plan, self.core.config, action.shard))
            elif isinstance(action, (SendHeartbeat, SendLeave)):
                self.call(host, action.message, -1, 0, action.shard)
            elif isinstance(action, Fail):
                self.failure = action
        self.schedule_tick(host)

    def call(self, host: NodeHost, request: Request, fragment: int, payload_bytes: int, shard: int, *,
             reply_bytes: int = 0) -> None:
        """One RPC to a synchronizer shard: the request travels up; the reply (or the deadline) comes back.
        Its deadline counts what it carries both ways (``core/shared/deadlines.py``)."""
        now = host.queue.now
        call_id = host.new_call_id()
        self.calls[call_id] = (request, shard)
        if isinstance(request, Contribution) and host.uploads_stall(self.name):
            header = host.send_header(self.name, fragment)
            if header is not None:
                host.queue.at(header, UploadHeader(self.index, self.boot, call_id, request, shard))
        else:
            for arrival in host.send_up(self.name, fragment, payload_bytes):
                host.queue.at(arrival, RequestArrives(self.index, self.boot, call_id, request, shard))
        deadline_s = host.call_deadline_s(payload_bytes + reply_bytes)
        host.queue.at(now + deadline_s, CallTimeout(self.index, self.boot, call_id))

    def schedule_tick(self, host: NodeHost) -> None:
        deadline = self.core.next_deadline()
        if deadline is not None and (self.tick_at is None or deadline < self.tick_at):
            self.tick_at = deadline
            host.queue.at(deadline, LearnerTick(self.index, self.boot))

    # ---- what arrives ----------------------------------------------------------------------

    def on_reply(self, host: NodeHost, call_id: int, reply: Reply, shard: int) -> None:
        call = self.calls.pop(call_id, None)
        if call is None:
            return  # the call already timed out (or this is a duplicate answer)
        request, _ = call
        now = host.queue.now
        if isinstance(reply, Admitted):
            held = self.core.links[shard].session
            was_ready, rejoin = self.ready, self.boot > 0 or self.core.joined
            actions = self.core.on_admitted(reply.state, now, stop=reply.stop, shard=shard)
            if self.ready and not was_ready:
                host.on_ready(self.index, rejoin)
            session = self.core.links[shard].session
            if session != held and session is not None:
                self.session_boots[(session.incarnation, session.number)] = self.boot
                if host.checker:
                    for f in reply.state.fragments:
                        host.checker.on_anchor(self.core, f.fragment)
        elif isinstance(reply, Accepted):
            actions = self.core.on_accepted(request, now, stop=reply.stop, shard=shard)
        else:
            assert isinstance(reply, Refused)
            actions = self.core.on_refused(request, reply.reason, now, shard=shard)
        self.execute(host, actions)

    def on_push(self, host: NodeHost, message: FragmentUpdate | StopNotice) -> None:
        now = host.queue.now
        if isinstance(message, StopNotice):
            self.execute(host, self.core.on_stop(now))
            return
        before = self.core.versions[message.fragment]
        actions = self.core.on_update(message, now)
        if host.checker and self.core.versions[message.fragment] != before:
            host.checker.on_anchor(self.core, message.fragment)
        self.execute(host, actions)

    def on_timeout(self, host: NodeHost, call_id: int) -> None:
        call = self.calls.pop(call_id, None)
        if call is not None:
            request, shard = call
            self.execute(host, self.core.on_undelivered(request, host.queue.now, shard=shard))

    def on_tick(self, host: NodeHost) -> None:
        self.tick_at = None
        now = host.queue.now
        actions = self.core.tick(now)
        deadline = self.core.next_deadline()
        if deadline is not None and deadline <= now:
            raise InvariantViolation(f"{self.name}'s core asks to be woken at {deadline!r} after its tick at {now!r}: "
                                     "time would stand still")
        self.execute(host, actions)

    # ---- the training loop -----------------------------------------------------------------

    def advance(self, host: NodeHost) -> None:
        """Between steps: close when told to stop, else start the next step if the core allows."""
        if not self.up or self.stepping or self.failure is not None:
            return
        now = host.queue.now
        move = self.core.between_steps(now)
        if move is LoopMove.CLOSE:
            self.execute(host, self.core.close(now))
        elif move is LoopMove.STEP:
            self.stepping = True
            host.queue.at(now + host.step_time_s(self.index), StepEnd(self.index, self.boot, now))

    def on_step_end(self, host: NodeHost, started_s: float) -> None:
        self.stepping = False
        batch = self.core.next_batch
        if self.core.step == 0:  # this process's first step: its data resumes at the learner's data_position
            self.sampler.skip_to(batch)
            self.step_bases[self.boot] = self.step_offset - batch
            host.on_resume(self.index, batch)
        x, y = self.sampler.next_batch()
        now = host.queue.now
        self.trainer.step(x, y, host.run_progress())
        tokens = x.numel()
        sends = self.core.record_step(tokens, now - started_s, now)
        host.on_step(self.index, tokens, self.step_offset + self.core.step, started_s, batch)
        self.execute(host, list(sends))
        host.after_step()

    # ---- the process's fate ----------------------------------------------------------------

    def crash(self) -> None:
        self.up = False
        self.stepping = False
        self.boot += 1  # everything in flight for the old process dies with it
        self.calls.clear()
        self.tick_at = None

    def arrive(self, host: NodeHost) -> None:
        """A late learner's process starts: its first core joins the run under way."""
        self.up = True
        self.execute(host, self.core.start(host.queue.now))

    def restart(self, host: NodeHost, core: Learner) -> None:
        """A fresh process: new core (new boot), new optimizer state; it joins and adopts the global state."""
        self.step_offset += self.core.step
        self.core = core
        self.up = True
        self.trainer.reset_optimizer()
        host.reset_links(self.name)
        self.execute(host, core.start(host.queue.now))
