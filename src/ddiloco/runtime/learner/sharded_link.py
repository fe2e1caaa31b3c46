"""One rank's own connection to the synchronizer, for a sharded (FSDP2) learner.

Every rank uploads its own slices (``core/shared/slices.py``), so the learner's uplink is spread over its
ranks and no rank builds a whole fragment's Δ; and every rank receives only its own slices: of the
state (rank 0 in its join, the others by a fetch under the session rank 0 opened) and of every update
(a stream per rank, each update cut by the synchronizer: ``runtime/sync/slice_parts.py``). Rank 0
alone speaks for the learner otherwise: it joins, heartbeats and leaves.

Nothing here decides anything: each call's outcome (accepted, refused and why, or unanswered) is
recorded for the training thread, which applies the outcomes of all ranks to every rank's learner
core at the same step, so the W cores — one per rank, each over its own slice — stay identical.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddiloco.core.learner_side.shard_link import BACKOFF_MAX_S, BACKOFF_START_S
from ddiloco.core.shared.actions import LearnerAction, Send, SendHeartbeat, SendLeave
from ddiloco.core.shared.messages import FragmentUpdate, GlobalState, Join, RejectReason, Request, Session, StopNotice
from ddiloco.core.shared.slices import SliceSpec
from ddiloco.runtime.call_errors import Unreachable
from ddiloco.runtime.client import CallRefused, JoinResult, SyncClient, UpdateStream
from ddiloco.runtime.learner.held_updates import Received

log = logging.getLogger("ddiloco.learner")


class Answer(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    UNANSWERED = "unanswered"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended, as the training thread hands it to the learner cores."""

    request: Request
    """The request without its payload (outcomes travel to every rank)."""
    answer: Answer
    reason: RejectReason | None = None
    stop: bool = False


class RankLink:
    """This rank's uploads (a sender thread) and its own update stream (a receiver thread, which
    also decodes each update: ``decode``)."""

    def __init__(self, client: SyncClient, learner_id: str, slices: list[SliceSpec], *, rank: int,
                 world: int, decode: Callable[[FragmentUpdate], torch.Tensor]) -> None:
        self.client = client
        self.learner_id = learner_id
        self.slices = slices
        self._decode = decode
        self.broken: str | None = None
        """Why an update the synchronizer sent could not be decoded for this rank's slice (the learner stops)."""
        self.part = (rank, world)
        self.leader = rank == 0
        self.bytes_up = 0
        self.bytes_down = 0
        """Payload bytes this rank received: its slices of states and updates."""
        self.sent = 0
        self.unreachable = 0
        self.rejected: Counter[str] = Counter()
        self._outbox: queue.Queue[LearnerAction | None] = queue.Queue()
        self._outcomes: list[Outcome] = []
        self._updates: list[Received] = []
        self._stop_notice = False
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._follow: tuple[Session, list[int]] | None = None
        self._stream: UpdateStream | None = None
        self._sender = threading.Thread(target=self._send_loop, name=f"ddiloco-send-{learner_id}", daemon=True)
        self._sender.start()
        self._followed = threading.Event()
        self._receiver = threading.Thread(target=self._receive_loop, name=f"ddiloco-recv-{learner_id}", daemon=True)
        self._receiver.start()

    # ---- the training thread ---------------------------------------------------------------

    def dispatch(self, actions: list[LearnerAction]) -> None:
        """Queue the uploads (every rank) and the heartbeats and leaves (rank 0) among ``actions``."""
        for action in actions:
            if isinstance(action, Send) or (self.leader and isinstance(action, (SendHeartbeat, SendLeave))):
                self._outbox.put(action)

    @property
    def backlog(self) -> int:
        return self._outbox.qsize()

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
        try:
            joined = self.client.join(join, timeout_s, part=self.part)
        except CallRefused as err:
            return Outcome(join, Answer.REFUSED, err.reason)
        except Unreachable as err:
            log.warning("join of %s unanswered: %s", self.learner_id, err)
            return Outcome(join, Answer.UNANSWERED)
        self.bytes_down += sum(4 * f.values.numel() for f in joined.state.fragments)
        return joined

    def fetch(self, session: Session, timeout_s: float) -> GlobalState | None:
        """Another rank's slices of the state, under ``session`` (rank 0's); None if refused or unanswered."""
        try:
            state = self.client.fetch_state(timeout_s, learner_id=self.learner_id, session=session, part=self.part)
        except (CallRefused, Unreachable) as err:
            log.warning("rank %d of %s: state fetch failed: %s", self.part[0], self.learner_id, err)
            return None
        self.bytes_down += sum(4 * f.values.numel() for f in state.fragments)
        return state

    def follow(self, session: Session, versions: list[int]) -> None:
        """Receive this rank's slices of the updates of ``session`` from ``versions`` on (a new stream)."""
        with self._lock:
            self._follow = (session, list(versions))
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
        self._followed.set()

    def drain(self) -> None:
        """Wait until every queued call has ended (the flush of a closing learner)."""
        done = threading.Event()
        self._outbox.put(_Marker(done))  # type: ignore[arg-type]
        done.wait()

    def close(self) -> None:
        self._closing.set()
        self._outbox.put(None)
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
        self._followed.set()
        self._sender.join(timeout=30.0)
        # The receiver decodes with torch: left running into the interpreter's exit, a decode in
        # progress aborted the process ("terminate called without an active exception").
        self._receiver.join(timeout=30.0)
        self.client.close()

    # ---- threads ---------------------------------------------------------------------------

    def _record(self, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes.append(outcome)

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            if isinstance(item, _Marker):
                item.done.set()
                continue
            request: Request
            try:
                if isinstance(item, Send):
                    c = dataclasses.replace(item.encode(), slice=self.slices[item.fragment])
                    request = dataclasses.replace(c, payload=b"")
                    stop = self.client.contribute(c).stop
                    self.bytes_up += len(c.payload)
                    self.sent += 1
                elif isinstance(item, SendHeartbeat):
                    request = item.message
                    stop = self.client.heartbeat(item.message).stop
                else:
                    assert isinstance(item, SendLeave)
                    request = item.message
                    self.client.leave(item.message)
                    stop = False
                self._record(Outcome(request, Answer.ACCEPTED, stop=stop))
            except CallRefused as err:
                self.rejected[str(err.reason)] += 1
                self._record(Outcome(request, Answer.REFUSED, err.reason))
            except Unreachable:
                self.unreachable += 1
                self._record(Outcome(request, Answer.UNANSWERED))

    def _receive_loop(self) -> None:
        delay = BACKOFF_START_S
        while not self._closing.is_set():
            self._followed.wait()
            with self._lock:
                follow = self._follow
            if follow is None or self._closing.is_set():
                self._followed.clear()
                continue
            session, versions = follow
            stream = self.client.updates(self.learner_id, versions, session, self.part)
            with self._lock:
                if self._follow is not follow:  # a newer registration meanwhile
                    stream.cancel()
                    continue
                self._stream = stream
            try:
                for item in stream:
                    received = None if isinstance(item, StopNotice) else self._decoded(item)
                    with self._lock:
                        if isinstance(item, StopNotice):
                            self._stop_notice = True
                        elif received is not None:
                            self._updates.append(received)
                            self.bytes_down += len(item.payload)
                            versions[item.fragment] = max(versions[item.fragment], item.version)
                    delay = BACKOFF_START_S
            except CallRefused as err:  # the session ended: the core rejoins, and follow() names the new one
                log.info("update stream of %s refused (%s)", self.learner_id, err)
                with self._lock:
                    if self._follow is follow:
                        self._followed.clear()
            except Unreachable as err:
                log.info("update stream of %s broke (%s): subscribing again", self.learner_id, err)
            with self._lock:
                self._stream = None
                moved = self._follow is not follow
            if not moved and not self._closing.is_set():  # broken or ended, not replaced: again, after a pause
                time.sleep(delay)
                delay = min(2 * delay, BACKOFF_MAX_S)

    def _decoded(self, update: FragmentUpdate) -> Received | None:
        """The update with its values, decoded here, off the training thread; None (and the link
        broken, with why) if it does not fit this rank's slice."""
        try:
            return Received(update, self._decode(update))
        except (ValueError, IndexError) as err:
            self.broken = self.broken or (f"an update of fragment {update.fragment} (version {update.version}) "
                                          f"does not fit this rank's slice: {err}")
            return None


@dataclass(frozen=True, slots=True)
class _Marker:
    done: threading.Event
