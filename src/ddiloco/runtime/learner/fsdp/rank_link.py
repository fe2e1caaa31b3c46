"""One rank's own connection to the synchronizer, for a sharded (FSDP2) learner: a link helper per rank.

Every rank uploads its own slices (``core/shared/slices.py``), so the learner's uplink is spread over its
ranks and no rank builds a whole fragment's Δ; and every rank receives only its own slices: of the
state (rank 0 in its join, the others by a fetch under the session rank 0 opened) and of every update
(a stream per rank, each update cut by the synchronizer: ``runtime/sync/slice_parts.py``). Rank 0
alone speaks for the learner otherwise: it joins, heartbeats and leaves.

The calls run where an unsharded learner's do, in a link helper process of the rank's own
(``helper.py``, given ``part`` and the rank's ``cuts``): gRPC, compressing Δ, decoding each cut
update and the retries of the stream never take the rank's interpreter lock, which the thread
that launches its kernels needs. Δ crosses in the rank's out slots (the int4 payload of the core's
fused pass on the CPU, else float32 for the helper to compress) and decoded updates in its in slots
(``slots.py``); the training thread writes a due slice
into its slot and announces it, and a *relay* thread here reads what the helper reports. A slot's
pages are given back once the rank is done with it (the send's call ended; the update applied), so
between uses the slots are no process's memory. A helper that dies is started again: its calls
in flight count as undelivered, and its stream resumes from the versions the rank holds.

Nothing here decides anything: each call's outcome (accepted, refused and why, or undelivered) is
recorded for the training thread, which applies the outcomes of all ranks to every rank's learner
core at the same step, so the W cores — one per rank, each over its own slice — stay identical.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import queue
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import LearnerAction, Send, SendHeartbeat, SendLeave
from ddiloco.core.shared.messages import Contribution, GlobalState, Join, Leave, RejectReason, Request, Session
from ddiloco.core.shared.slice_cut import cut_size
from ddiloco.core.shared.slices import SliceSpec
from ddiloco.runtime.client import ClientSpec, JoinResult
from ddiloco.runtime.learner.calls import HelperCalls
from ddiloco.runtime.learner.fsdp.held_updates import Received
from ddiloco.runtime.learner.helper_process import HelperProcess
from ddiloco.runtime.learner.helper_relay import HelperRelay
from ddiloco.runtime.learner.helper_wire import Ask, HelperSpec, Msg, PipeClosed, pickled, receive_state
from ddiloco.runtime.learner.out_slots import OutSlots
from ddiloco.runtime.learner.slots import Slot, SlotArea, SlotLayout
from ddiloco.runtime.learner.staging import HostStaging

log = logging.getLogger("ddiloco.learner")

CLOSE_S = 30.0
"""How long a closing rank lets its helper deliver what is queued and leave."""
ANSWER_GRACE_S = 30.0
"""Beyond a join's or fetch's own deadline, how long the rank waits for its helper to report it."""


class Answer(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    UNDELIVERED = "undelivered"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended, as the training thread hands it to the learner cores."""

    request: Request
    """The request without its payload (outcomes travel to every rank)."""
    answer: Answer
    reason: RejectReason | None = None
    stop: bool = False


class RankLink:
    """This rank's link helper, its slots, and the relay thread that records what the helper reports."""

    def __init__(self, client: ClientSpec, core: Learner, slices: list[SliceSpec], numels: list[int], *,
                 rank: int, world: int) -> None:
        self.learner_id = core.learner_id
        self.slices = slices
        self.part = (rank, world)
        self.leader = rank == 0
        self.broken: str | None = None
        """Why this rank's link cannot go on (an update that does not fit its slice, a helper that cannot start)."""
        self.bytes_up = 0
        self.bytes_down = 0
        """Payload bytes this rank received: its slices of states and updates."""
        self.sent = 0
        self.unreachable = 0
        self.rejected: Counter[str] = Counter()
        uplink, downlink = core.codecs
        self._downlink = downlink
        self._numels = numels
        layout = SlotLayout(tuple(uplink.encoded_size(s.numel) if core.encodes_contributions(p)
                                  else max(uplink.encoded_size(s.numel), 4 * s.numel) for p, s in enumerate(slices)),
                            tuple(4 * s.numel for s in slices))
        self.slots = SlotArea(layout)
        self._outs = OutSlots(self.slots, HostStaging(torch.device("cpu"), downlink, [], []))
        config = core.config
        self._spec = HelperSpec(core.learner_id, (client,), layout, config.codec, config.downlink_codec,
                                config.block_size, tuple(numels), (True,) * len(slices), (None,), core.boot,
                                os.getpid(), logging.getLogger("ddiloco.learner").getEffectiveLevel(),
                                part=self.part, cuts=tuple(slices))
        self.calls = HelperCalls()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        """Notified whenever a call ends (``drain`` waits on it)."""
        self._outcomes: list[Outcome] = []
        self._updates: list[Received] = []
        self._stop_notice = False
        self._waiting: dict[int, queue.Queue[JoinResult | Outcome]] = {}
        """A join's or fetch's request id: where its answer goes (the training thread waits for it)."""
        self._follow: tuple[Session, list[int]] | None = None
        """The session this rank streams, and the versions its updates reached (a new helper resumes there)."""
        self._follow_lock = threading.Lock()
        self._leaves: list[SendLeave] = []
        self._out_lock = threading.Lock()
        """Between the training thread writing an out slot and the relay giving one back."""
        self._sending: dict[int, tuple[int, int]] = {}
        """Per send's request id: its fragment and its out slot's number."""
        self._holding: set[int] = set()
        """Fragments whose in slot holds an update the rank has not applied yet."""
        self.relay = HelperRelay(self, self.slots, self._holding, self.calls,
                                 name=f"ddiloco-relay-{core.learner_id}-{rank}", what=f"rank {rank}'s link helper",
                                 failed=lambda err: self._break(str(err)))
        self.relay.start()

    # ---- the training thread ---------------------------------------------------------------

    def dispatch(self, actions: list[LearnerAction]) -> None:
        """Announce the uploads (every rank) and the heartbeats (rank 0) among ``actions``; keep the
        leave (rank 0) for :meth:`close`."""
        for action in actions:
            if isinstance(action, Send):
                self._send(action)
            elif self.leader and isinstance(action, SendHeartbeat):
                self._call(Msg.BEAT, action.message)
            elif self.leader and isinstance(action, SendLeave):
                self._leaves.append(action)

    def _send(self, send: Send) -> None:
        """The slice's Δ (or its payload) into its out slot, announced with its header (which names the slice)."""
        p = send.fragment
        with self._out_lock:
            seq, raw = self._outs.write(send)
        header = dataclasses.replace(send.header, slice=self.slices[p])
        rid = self.calls.next_rid()
        self._sending[rid] = (p, seq)
        self.calls.call(rid, header, 0, pickled((Msg.SEND, rid, 0, header, p, seq, raw)))

    def _sent(self, rid: int) -> None:
        """A send's call ended, so its helper is done with its out slot: unless written again since, the
        slot's pages are given back (a raw Δ is 4 bytes a value; between sends it is no one's memory)."""
        sent = self._sending.pop(rid, None)
        if sent is None:
            return
        p, seq = sent
        with self._out_lock:
            if self.slots.view(Slot.OUT, p, seq) is not None:  # not written again since
                self.slots.give_back(Slot.OUT, p)

    def _call(self, kind: Msg, request: Any, *extra: Any) -> int:
        rid = self.calls.next_rid()
        self.calls.call(rid, request, 0, pickled((kind, rid, 0, request, *extra)))
        return rid

    @property
    def backlog(self) -> int:
        """Calls handed to the helper and not answered yet."""
        return len(self.calls.requests)

    def take(self) -> tuple[list[Outcome], list[Received], bool]:
        """The outcomes and updates since the last call, and whether the stream said the run stopped."""
        with self._lock:
            outcomes, updates, stop = self._outcomes, self._updates, self._stop_notice
            self._outcomes, self._updates, self._stop_notice = [], [], False
        return outcomes, updates, stop

    def take_updates(self) -> list[Received]:
        """The updates since the last call (outcomes and the stop stay for :meth:`take`)."""
        with self._lock:
            updates, self._updates = self._updates, []
        return updates

    def join(self, join: Join, timeout_s: float) -> JoinResult | Outcome:
        """Rank 0 registers the learner and receives its own slices of the state, or how the call ended."""
        answer = self._ask(Msg.JOIN, join, timeout_s)
        if isinstance(answer, JoinResult):
            self.bytes_down += sum(4 * f.values.numel() for f in answer.state.fragments)
        return answer

    def fetch(self, session: Session, timeout_s: float) -> GlobalState | None:
        """Another rank's slices of the state, under ``session`` (rank 0's); None if refused or undelivered."""
        answer = self._ask(Msg.FETCH, session, timeout_s)
        if not isinstance(answer, JoinResult):
            log.warning("rank %d of %s: state fetch %s", self.part[0], self.learner_id, answer.answer.value)
            return None
        self.bytes_down += sum(4 * f.values.numel() for f in answer.state.fragments)
        return answer.state

    def _ask(self, kind: Msg, request: Join | Session, timeout_s: float) -> JoinResult | Outcome:
        answer: queue.Queue[JoinResult | Outcome] = queue.Queue(maxsize=1)
        rid = self.calls.next_rid()
        with self._lock:
            self._waiting[rid] = answer
        self.calls.call(rid, request, 0, pickled((kind, rid, 0, request, timeout_s)))  # type: ignore[arg-type]
        try:
            return answer.get(timeout=timeout_s + ANSWER_GRACE_S)
        except queue.Empty:  # a helper that neither answers nor dies: the call went undelivered
            with self._lock:
                self._waiting.pop(rid, None)
            self.calls.done(rid)
            return Outcome(request, Answer.UNDELIVERED)  # type: ignore[arg-type]

    def follow(self, session: Session, versions: list[int]) -> None:
        """Receive this rank's slices of the updates of ``session`` from ``versions`` on (a new stream)."""
        with self._follow_lock:
            self._follow = (session, list(versions))
            self._tell_follow()

    def drain(self) -> None:
        """Wait until every call handed to the helper has ended (the flush of a closing learner)."""
        with self._idle:
            while self.calls.requests and self.relay.alive:
                self._idle.wait(1.0)

    def close(self) -> None:
        """Rank 0's leave, then the helper delivers what is queued and exits."""
        self.relay.close(CLOSE_S, self._leave)
        os.close(self.slots.fd)

    def _leave(self) -> None:
        if self.broken is None:
            for leave in self._leaves:
                self._call(Msg.LEAVE, leave.message)

    def _break(self, why: str) -> None:
        self.broken = self.broken or why

    # ---- helper → training process (the relay thread, ``helper_relay.py``) --------------------

    def helper_spec(self) -> HelperSpec:
        return self._spec

    def adopt(self, helper: HelperProcess) -> None:
        with self._follow_lock:
            lost = self.calls.started(helper)
            self._tell_follow()
        for rid in lost:
            self._ended(rid, Answer.UNDELIVERED)

    def _tell_follow(self) -> None:
        """The stream to follow, to the helper running now (under ``_follow_lock``)."""
        follow, helper = self._follow, self.calls.helper
        if follow is not None and helper is not None:
            try:
                helper.pipe.send(Msg.FOLLOW, 0, follow[0], list(follow[1]))
            except PipeClosed:
                pass  # the relay sees it die, and tells the next one

    def serve(self, helper: HelperProcess) -> None:
        """Record what the helper reports, until it closes or dies."""
        for msg in helper.messages():
            kind = msg[0]
            if kind is Msg.ASK:  # is this send still to go? Always: the cores decided it at the step
                try:
                    helper.pipe.send(Msg.ANSWER, msg[1], msg[2] is Ask.STILL_TO_SEND)
                except PipeClosed:
                    return
            elif kind is Msg.UPDATE:
                self._on_update(*msg[2:])
            elif kind is Msg.STOP_NOTICE:
                with self._lock:
                    self._stop_notice = True
            elif kind is Msg.FATAL:
                self._break(msg[1])
            elif kind is Msg.ADMITTED:
                self._answer(msg[1], receive_state(*msg[2:]))
            elif kind is Msg.ACCEPTED:
                self._ended(msg[1], Answer.ACCEPTED, stop=msg[2], nbytes=msg[3])
            elif kind is Msg.REFUSED:
                self._ended(msg[1], Answer.REFUSED, reason=msg[2])
            else:  # UNDELIVERED, or TORN: the slot was written again before the helper read it
                self._ended(msg[1], Answer.UNDELIVERED)

    def _ended(self, rid: int, answer: Answer, *, stop: bool = False, nbytes: int = 0,
               reason: RejectReason | None = None) -> None:
        entry = self.calls.done(rid)
        self._sent(rid)
        if entry is None:
            return
        request = entry[0]
        if answer is Answer.REFUSED:
            self.rejected[str(reason)] += 1
        elif answer is Answer.UNDELIVERED:
            self.unreachable += 1
        elif isinstance(request, Contribution):
            self.sent += 1
            self.bytes_up += nbytes
        outcome = Outcome(request, answer, reason, stop)
        if not self._answer(rid, outcome) and not isinstance(request, Leave):
            with self._idle:
                self._outcomes.append(outcome)
                self._idle.notify_all()

    def _answer(self, rid: int, answer: JoinResult | Outcome) -> bool:
        """Hand a join's or fetch's answer to the training thread waiting for it; False if none waits."""
        with self._idle:
            waiting = self._waiting.pop(rid, None)
            self.calls.done(rid)
            self._idle.notify_all()
        if waiting is not None:
            waiting.put(answer)
        return waiting is not None

    def _give_back(self, p: int) -> None:
        self._holding.discard(p)
        self.slots.give_back(Slot.IN, p)
        self.slots.release(Slot.IN, p)

    def _on_update(self, update: Any, p: int, seq: int, _decoded: bool) -> None:
        """An update of this rank's slice, decoded by the helper into the in slot, which the rank holds
        (no copy) until it applied the update (the ranks apply it only once every rank holds it,
        ``held_updates.py``), then gives back: between updates the slot's memory is no one's."""
        if p < 0:
            self._break(f"an update of fragment {update.fragment} (version {update.version}) does not fit this "
                        "rank's slice")
            return
        view = self.slots.view(Slot.IN, p, seq)
        assert view is not None  # the helper writes a slot again only once it is released
        self._holding.add(p)
        values = torch.from_numpy(view.view(np.float32))
        with self._follow_lock:
            if self._follow is not None and self._follow[0].incarnation == update.incarnation:
                versions = self._follow[1]
                versions[p] = max(versions[p], update.version)
        with self._lock:
            self._updates.append(Received(update, values, release=lambda: self._give_back(p)))
            self.bytes_down += cut_size(self._downlink, self._numels[p], self.slices[p])
