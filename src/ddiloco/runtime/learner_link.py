"""A learner's link to the synchronizer: the background threads that carry out its core's actions.

The core (:class:`~ddiloco.core.learner.Learner`) decides; these threads only execute and
report back, so compute never waits for the network:

- *sender*: compresses and uploads contributions (``Send``), and tells the core how each
  call ended — accepted, refused with a reason, or undelivered;
- *control*: carries out joins and heartbeats (``SendJoin``, ``SendHeartbeat``) and calls
  the core's ``tick`` at its ``next_deadline()``;
- *receiver*: holds the update stream of the current session, resubscribing (with the
  versions held, so recent updates are replayed) whenever it breaks or the session changes.

Every call into the core is made under one lock. Whatever changes the model's parameters —
adopting a joined state, applying an update — is queued for the training thread, which
hands it to the core between two steps (``LearnerLink.inbox``).
"""

from __future__ import annotations

import enum
import logging
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ddiloco.core.actions import Fail, LearnerAction, Send, SendHeartbeat, SendJoin, SendLeave
from ddiloco.core.learner import Learner
from ddiloco.core.messages import RejectReason, Request, Session
from ddiloco.runtime.auth import AuthenticationError
from ddiloco.runtime.client import JoinResult, Refused, SyncClient, Unreachable

log = logging.getLogger("ddiloco.learner")

BACKOFF_START_S = 0.2
BACKOFF_MAX_S = 2.0
CONTROL_MAX_WAIT_S = 1.0


class Inbox(enum.Enum):
    """What the background threads hand to the training thread."""

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


def next_delay(delay: float) -> float:
    return min(BACKOFF_MAX_S, delay * 2) * random.uniform(0.8, 1.2)


class LearnerLink:
    def __init__(self, core: Learner, client: SyncClient, lock: threading.RLock,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.client = client
        self.lock = lock
        self.clock = clock
        self.stats = LinkStats()
        self.inbox: queue.Queue[tuple[Inbox, Any]] = queue.Queue()
        self.fatal: BaseException | None = None
        self._outbox: queue.Queue[Send | None] = queue.Queue()
        self._control: queue.Queue[LearnerAction] = queue.Queue()
        self._control_wake = threading.Event()
        self._closing = threading.Event()
        self._stream_session: Session | None = None
        self._session_changed = threading.Event()
        self._stream: Any = None
        self._leave_after_flush: SendLeave | None = None
        self._threads = [
            threading.Thread(target=self._sender, name=f"ddiloco-send-{core.learner_id}", daemon=True),
            threading.Thread(target=self._control_loop, name=f"ddiloco-ctl-{core.learner_id}", daemon=True),
            threading.Thread(target=self._receiver, name=f"ddiloco-recv-{core.learner_id}", daemon=True),
        ]

    def start(self, session: Session) -> None:
        self._stream_session = session
        for t in self._threads:
            t.start()

    @property
    def backlog(self) -> int:
        return self._outbox.qsize()

    # ---- dispatching the core's actions ---------------------------------------------------

    def dispatch(self, actions: list[LearnerAction]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._outbox.put(action)
            elif isinstance(action, (SendJoin, SendHeartbeat)):
                self._control.put(action)
                self._control_wake.set()
            elif isinstance(action, Fail):
                self._fail(RuntimeError(action.detail))
            elif isinstance(action, SendLeave):
                self._leave_after_flush = action  # once the sender has delivered what is queued

    def _core(self, fn: Callable[[Learner], list[LearnerAction]]) -> None:
        """Tell the core something under the lock, and carry out what it answers."""
        with self.lock:
            actions = fn(self.core)
        self.dispatch(actions)

    def _outcome(self, request: Request, call: Callable[[], Any]) -> Any:
        """Make one call; report accepted / refused / undelivered to the core. Returns the reply or None."""
        try:
            reply = call()
        except Unreachable as err:
            self.stats.unreachable += 1
            log.info("%s undelivered: %s", type(request).__name__, err)
            self._core(lambda core: core.on_undelivered(request, self.clock()))
            return None
        except Refused as err:
            self.stats.rejected[err.reason] += 1
            log.info("%s refused: %s", type(request).__name__, err.detail)
            try:
                reason = RejectReason(err.reason)
            except ValueError:
                reason = RejectReason.MALFORMED
            self._core(lambda core: core.on_refused(request, reason, self.clock()))
            return None
        except AuthenticationError as err:
            self._fail(err)
            return None
        return reply

    def _fail(self, err: BaseException) -> None:
        if self.fatal is None:
            self.fatal = err
            log.error("%s", err)
        self._closing.set()
        self._control_wake.set()
        self.inbox.put((Inbox.WAKE, None))

    # ---- sender ----------------------------------------------------------------------------

    def _sender(self) -> None:
        while True:
            send = self._outbox.get()
            if send is None:
                return
            if self.fatal is not None:
                continue
            with self.lock:
                current = self.core.is_current(send)
            if not current:
                with self.lock:
                    self.core.dropped += 1  # measured from a state the learner no longer holds
                continue
            contribution = send.encode()
            reply = self._outcome(contribution, lambda: self.client.contribute(contribution))
            if reply is not None:
                self.stats.contributions_sent += 1
                self.stats.bytes_up += len(contribution.payload)
                self._core(lambda core: core.on_accepted(contribution, self.clock(), stop=reply.stop))

    # ---- control ---------------------------------------------------------------------------

    def _control_loop(self) -> None:
        while not self._closing.is_set():
            try:
                action = self._control.get_nowait()
            except queue.Empty:
                with self.lock:
                    deadline = self.core.next_deadline()
                wait = CONTROL_MAX_WAIT_S if deadline is None else min(CONTROL_MAX_WAIT_S,
                                                                        max(0.0, deadline - self.clock()))
                if self._control_wake.wait(wait):
                    self._control_wake.clear()
                    continue
                self._core(lambda core: core.tick(self.clock()))
                continue
            if isinstance(action, SendJoin):
                self._join(action)
            elif isinstance(action, SendHeartbeat):
                beat = action.message
                reply = self._outcome(beat, lambda: self.client.heartbeat(beat))
                if reply is not None:
                    self._core(lambda core: core.on_accepted(beat, self.clock(), stop=reply.stop))

    def _join(self, action: SendJoin) -> None:
        result: JoinResult | None = self._outcome(action.message, lambda: self.client.join(action.message))
        if result is None:
            return
        self.stats.joins += 1
        session = result.state.session
        assert session is not None
        log.info("joined synchronizer instance %x (session %d) at versions %s", session.incarnation, session.number,
                 list(result.state.versions()))
        self.inbox.put((Inbox.ADMITTED, result))  # the training thread adopts it between two steps
        self._stream_session = result.state.session
        self._session_changed.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()  # subscribe again for the new session

    def _leave(self, action: SendLeave) -> None:
        try:
            self.client.leave(action.message)
        except (Unreachable, Refused, AuthenticationError) as err:
            log.info("leave failed: %s", err)

    # ---- receiver --------------------------------------------------------------------------

    def _receiver(self) -> None:
        delay = BACKOFF_START_S
        while not self._closing.is_set():
            session = self._stream_session
            self._session_changed.clear()
            with self.lock:
                held = list(self.core.versions) if self.core.session == session else [0] * len(self.core.versions)
            try:
                stream = self.client.updates(self.core.learner_id, [max(v, 0) for v in held], session)
                self._stream = stream
                for update in stream:
                    delay = BACKOFF_START_S
                    if update is None:
                        self._core(lambda core: core.on_stop(self.clock()))
                        self.inbox.put((Inbox.WAKE, None))
                    else:
                        self.inbox.put((Inbox.UPDATE, update))
                self._session_changed.wait(BACKOFF_START_S)  # closed by the synchronizer: subscribe again
            except (Unreachable, Refused):
                # Not a decision: a broken stream is re-made; whether the session is still ours
                # the core learns from its heartbeats.
                if self._session_changed.wait(delay):
                    delay = BACKOFF_START_S
                else:
                    delay = next_delay(delay)
            except AuthenticationError as err:
                self._fail(err)
                return
            finally:
                self._stream = None

    # ---- shutting down ---------------------------------------------------------------------

    def close(self, timeout_s: float) -> None:
        """Deliver what is queued, leave if the core said so, then stop every thread."""
        self._outbox.put(None)
        self._threads[0].join(timeout_s)
        if self._leave_after_flush is not None and self.fatal is None:
            self._leave(self._leave_after_flush)
        self._closing.set()
        self._control_wake.set()
        self._session_changed.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        for t in self._threads[1:]:
            t.join(timeout_s)
