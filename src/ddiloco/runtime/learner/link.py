"""A learner's link to the synchronizer, as the training process sees it: a helper process,
shared slots, and small threads. The core (:class:`~ddiloco.core.learner_side.learner_core.Learner`) decides; the link carries its actions out and
reports how they ended. gRPC, protobuf, chunking, compression, decoding, retries and update
streams run in a helper process (``helper.py``), so none of it takes the training thread's
interpreter lock. Here: *dispatch* writes a due fragment's Δ into its out slot (one copy,
``out_slots.py``) and announces it, and sends joins and heartbeats as messages (``calls.py``: a
step's announces are fixed structs, ``helper_wire.SendFrames``, sent together in one system call);
the training thread releases an update's slot by a word in shared memory, no message; the *relay* thread
waits on the helper's socket and feeds the core each outcome under the lock (O(1) per
message), and starts the helper again if it dies (its calls in flight count as undelivered;
the core's usual rules take it from there); the *ticker* ticks the core at its
``next_deadline()``; on a GPU a *finisher* waits for each Δ's copy from the device before
announcing it. What changes the parameters (a joined state, an update, straight from its slot)
is queued for the training thread (:attr:`LearnerLink.inbox`), which hands it to the core
between two steps.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import Fail, LearnerAction, Outage, Send, SendHeartbeat, SendJoin, SendLeave
from ddiloco.core.shared.deadlines import call_deadline_s, client_join_link, join_state_bytes
from ddiloco.core.shared.errors import DdilocoError
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Leave, Request
from ddiloco.runtime.client import ClientSpec
from ddiloco.runtime.learner.calls import HelperCalls
from ddiloco.runtime.learner.helper_process import HelperProcess
from ddiloco.runtime.learner.helper_relay import HelperRelay
from ddiloco.runtime.learner.helper_wire import Ask, HelperSpec, Msg, PipeClosed, SendFrames, pickled, receive_state
from ddiloco.runtime.learner.link_layout import helper_spec, slot_layout
from ddiloco.runtime.learner.link_lines import say_outage, say_refusal, say_warning
from ddiloco.runtime.learner.out_slots import OutSlots
from ddiloco.runtime.learner.repeats import Repeats
from ddiloco.runtime.learner.slots import Slot, SlotArea
from ddiloco.runtime.learner.staging import HostStaging

log = logging.getLogger("ddiloco.learner")

CONTROL_MAX_WAIT_S = 1.0


class Inbox(enum.Enum):
    """What the link hands to the training thread."""

    ADMITTED = "admitted"
    UPDATE = "update"
    WAKE = "wake"


@dataclass(slots=True)
class LinkStats:
    """What the link did, for logs, tests and benchmarks."""

    contributions_sent: int = 0
    bytes_up: int = 0
    rejected: Counter = field(default_factory=Counter)
    joins: int = 0
    unreachable: int = 0


class LearnerLink:
    """Every shard's link, through one helper process; one shared core, lock and inbox."""

    def __init__(self, core: Learner, clients: list[ClientSpec], lock: threading.RLock, staging: HostStaging,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.clients = clients
        self.staging = staging
        self.lock = lock
        self.clock = clock
        self.stats = LinkStats()
        self.inbox: queue.Queue[tuple[Inbox, Any]] = queue.Queue()
        self.fatal: BaseException | None = None
        self.closing = threading.Event()
        self.slots = SlotArea(slot_layout(core, staging))
        self.outs = OutSlots(self.slots, staging)
        self.last_error = [""] * len(clients)
        """Per shard, why its last call went unanswered (for the outage's lines)."""
        self.refusals = Repeats(log)
        self.calls = HelperCalls()
        self._sends: dict[int, Send] = {}
        self._leaves: list[SendLeave] = []
        self._holding: set[int] = set()
        """Fragments whose in slot holds an update the training thread has not released yet."""
        self._frames = SendFrames(core.learner_id, core.config.codec, core.boot)
        self._tick_wake = threading.Event()
        name = core.learner_id
        self.relay = HelperRelay(self, self.slots, self._holding, self.calls, name=f"ddiloco-relay-{name}",
                                 what="the link's helper process", failed=self.fail, stopped=self.closing.is_set)
        self._ticker = threading.Thread(target=self._tick_loop, name=f"ddiloco-tick-{name}", daemon=True)
        self._finisher: queue.Queue[Send | None] | None = None
        if staging.asynchronous:
            self._finisher = queue.Queue()
            threading.Thread(target=self._finish_loop, name=f"ddiloco-finish-{name}", daemon=True).start()

    def start(self) -> None:
        """Start the helper (``HelperError``, one line, if it cannot) and the ticker."""
        self.relay.start()
        self._ticker.start()

    # ---- training process → helper ---------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Contributions handed to the helper and not yet answered."""
        return len(self._sends)

    def dispatch(self, actions: list[LearnerAction]) -> None:
        for action in self.staging.stage(actions):
            if isinstance(action, Send):
                self._send(action)
            elif isinstance(action, SendJoin):
                config = self.core.config  # the state it brings back, at the slowest link the run admits
                timeout_s = call_deadline_s(join_state_bytes(self.core.plan, config, action.shard),
                                            client_join_link(config))
                self._request(Msg.JOIN, action.message, action.shard, timeout_s)
            elif isinstance(action, SendHeartbeat):
                self._request(Msg.BEAT, action.message, action.shard)
            elif isinstance(action, Fail):
                self.fail(DdilocoError(action.detail))  # one line for the user, never retried
            elif isinstance(action, SendLeave):
                self._leaves.append(action)  # once the helper has delivered what is queued
            elif isinstance(action, Outage):
                say_outage(action, self.clients[action.shard].address, self.last_error[action.shard])
            else:
                say_warning(action, self.backlog)

    def _send(self, send: Send) -> None:
        """Δ into its out slot, then announced; on a GPU the finisher announces it once the device's
        copy has landed (``out_slots.py``)."""
        if send.ready is not None and self._finisher is not None:
            self._finisher.put(send)
            return
        self._announce(send, *self.outs.write(send))

    def _finish_loop(self) -> None:
        assert self._finisher is not None
        while (send := self._finisher.get()) is not None:
            try:
                send.ready()  # type: ignore[misc]  # waits for the copy (the interpreter lock released)
            except ValueError as err:
                self.fail(DdilocoError(f"fragment {send.fragment}: Δ is not finite ({err}): the model diverged"))
                continue
            self._announce(send, self.outs.finish(send), False)

    def _announce(self, send: Send, seq: int, raw: bool) -> None:
        rid = self.calls.next_rid()
        self._sends[rid] = Send(send.header, None, send.codec, send.shard)  # before the helper asks; without Δ
        self.calls.call(rid, send.header, send.shard, self._frames.send(rid, send.shard, send.header, send.fragment,
                                                                         seq, raw))

    def _request(self, kind: Msg, request: Any, shard: int, *extra: Any) -> None:
        """Send one call to the helper, remembered until its outcome (or the helper's death) comes back."""
        rid = self.calls.next_rid()
        self.calls.call(rid, request, shard, pickled((kind, rid, shard, request, *extra)))

    def release(self, fragment: int) -> None:
        """The training thread is done with fragment's in slot: the helper may write it again (it
        reads so in the slot's header, whichever helper runs by then; no message)."""
        self._holding.discard(fragment)
        self.slots.release(Slot.IN, fragment)

    # ---- helper → training process (the relay thread, ``helper_relay.py``) --------------------

    def helper_spec(self) -> HelperSpec:
        return helper_spec(self.core, self.lock, self.staging, self.clients, self.slots.layout)

    def adopt(self, helper: HelperProcess) -> None:
        for rid in self.calls.started(helper):
            self._lost(rid)

    def serve(self, helper: HelperProcess) -> None:
        """Feed the core what the helper reports, until it closes or dies."""
        for msg in helper.messages():
            self._on_message(helper, msg)

    def _on_message(self, helper: HelperProcess, msg: tuple) -> None:
        kind = msg[0]
        if kind is Msg.ASK:
            _, qid, what, argument = msg
            with self.lock:
                if what is Ask.STREAM_VERSIONS:
                    answer: Any = self.core.stream_versions(argument)
                else:
                    send = self._sends.get(argument)
                    answer = send is not None and self.core.still_to_send(send)
            if what is Ask.STILL_TO_SEND and not answer:
                self._done(argument)
            try:
                helper.pipe.send(Msg.ANSWER, qid, answer)
            except PipeClosed:
                pass
        elif kind is Msg.UPDATE:
            self._on_update(*msg[1:])
        elif kind is Msg.STOP_NOTICE:
            self.tell_core(lambda core: core.on_stop(self.clock()))
            self.inbox.put((Inbox.WAKE, None))
        elif kind is Msg.FATAL:
            self.fail(DdilocoError(msg[1]))
        elif kind is Msg.ADMITTED:
            self._on_admitted(*msg[1:])
        else:
            self._on_outcome(kind, msg[1], *msg[2:])

    def _done(self, rid: int) -> tuple[Request, int] | None:
        self._sends.pop(rid, None)
        return self.calls.done(rid)

    def _on_outcome(self, kind: Msg, rid: int, *fields: Any) -> None:
        entry = self._done(rid)
        if entry is None:
            return
        request, shard = entry
        clock = self.clock
        if kind is Msg.ACCEPTED:
            stop, nbytes = fields
            if isinstance(request, Leave):
                return  # the core left already (``Learner.close``)
            if isinstance(request, Contribution):
                self.stats.contributions_sent += 1
                self.stats.bytes_up += nbytes
            self.tell_core(lambda core: core.on_accepted(request, clock(), stop=stop, shard=shard))
            return
        if isinstance(request, Leave):
            log.info("leave of shard %d not confirmed: the synchronizer forgets this learner when its lease ends",
                     shard)
        if kind is Msg.REFUSED:
            reason, detail = fields
            self.stats.rejected[reason] += 1
            say_refusal(self.refusals, request, reason, shard, detail)
            self.tell_core(lambda core: core.on_refused(request, reason, clock(), shard=shard))
            return
        if kind is Msg.UNDELIVERED:
            self.stats.unreachable += 1
            self.last_error[shard] = fields[0]  # an outage is said by the core's Outage actions, not per call
            log.debug("%s to shard %d undelivered: %s", type(request).__name__, shard, fields[0])
        else:
            log.debug("contribution of fragment %d written again before it was sent: folded", request.fragment)
        self.tell_core(lambda core: core.on_undelivered(request, clock(), shard=shard))

    def _lost(self, rid: int) -> None:
        entry = self._done(rid)
        if entry is not None:
            request, shard = entry
            self.tell_core(lambda core: core.on_undelivered(request, self.clock(), shard=shard))

    def _on_update(self, shard: int, update: FragmentUpdate, p: int, seq: int, decoded: bool) -> None:
        values = None
        if p >= 0:
            self._holding.add(p)
            view = self.slots.view(Slot.IN, p, seq)
            assert view is not None  # the helper writes a slot again only once it is released
            if decoded:
                values = torch.from_numpy(view.view(np.float32))
            else:
                update = dataclasses.replace(update, payload=view)
                if self.staging.asynchronous:  # decoded on the device now, the slot free again
                    values = self.staging.decode(update, pinned=self.staging.registered is not None)
                    self.release(p)
                    p = -1
        self.inbox.put((Inbox.UPDATE, (update, values, p)))

    def _on_admitted(self, rid: int, *state: Any) -> None:
        """A join's state, mapped from its shared file (no copy: the core adopts from it)."""
        entry = self._done(rid)
        shard = entry[1] if entry is not None else 0
        result = receive_state(*state)
        self.stats.joins += 1
        session, joins = result.state.session, self.stats.joins
        assert session is not None
        log.info("joined synchronizer instance %x (shard %d, session %d) at versions %s%s", session.incarnation,
                 shard, session.number, list(result.state.versions()),
                 f": a rejoin, registration {joins} of this process" if joins > len(self.clients) else "")
        self.inbox.put((Inbox.ADMITTED, (shard, result)))

    # ---- the core ------------------------------------------------------------------------------

    def _tick_loop(self) -> None:
        while not self.closing.is_set():
            with self.lock:
                deadline = self.core.next_deadline()
            wait = CONTROL_MAX_WAIT_S if deadline is None else min(CONTROL_MAX_WAIT_S, max(0.0, deadline - self.clock()))
            if self._tick_wake.wait(wait):
                self._tick_wake.clear()
                continue
            self.tell_core(lambda core: core.tick(self.clock()))

    def tell_core(self, fn: Callable[[Learner], list[LearnerAction]]) -> None:
        """Tell the core something under the lock, and carry out what it answers."""
        with self.lock:
            actions = fn(self.core)
        self.dispatch(actions)
        self._tick_wake.set()  # its deadlines may have moved

    def fail(self, err: BaseException) -> None:
        if self.fatal is None:
            self.fatal = err
            log.error("%s", err)
        self.closing.set()
        self._tick_wake.set()
        self.inbox.put((Inbox.WAKE, None))

    def close(self, timeout_s: float) -> None:
        """Deliver what is queued, leave every shard if the core said so, then stop the helper."""
        if self._finisher is not None:
            self._finisher.put(None)
        self.relay.close(timeout_s, self._leave_every_shard)
        self.closing.set()
        self._tick_wake.set()
        self.outs.close()
        os.close(self.slots.fd)
        if self._ticker.is_alive():
            self._ticker.join(timeout_s)

    def _leave_every_shard(self) -> None:
        if self.fatal is None:
            for leave in self._leaves:
                self._request(Msg.LEAVE, leave.message, leave.shard)
