"""A learner's link to the synchronizer: the background threads that carry out its core's actions.

The core (:class:`~ddiloco.core.learner.Learner`) decides; these threads only execute and
report back, so compute never waits for the network. For every synchronizer shard (one,
unless the synchronizer is sharded by fragment) there are three:

- *sender*: compresses and uploads contributions (``Send``), and tells the core how each
  call ended — accepted, refused with a reason, or undelivered;
- *control*: carries out joins and heartbeats (``SendJoin``, ``SendHeartbeat``);
- *receiver*: holds the update stream of the shard's current session, resubscribing (with
  the versions held, so recent updates are replayed) whenever it breaks or the session
  changes.

One more thread ticks the core at its ``next_deadline()`` (heartbeats, join retries, the end
of a wait). A shard that is slow or unreachable holds up only its own threads: the learner
keeps exchanging the fragments of the others. Every call into the core is made under one lock.
Whatever changes the model's parameters — adopting a joined state, applying an update — is
queued for the training thread, which hands it to the core between two steps
(:attr:`LearnerLink.inbox`); an update goes there already decoded by the receiver. Copies
between host and accelerator are staged so the training stream never waits
(:mod:`ddiloco.runtime.learner.staging`).
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

from ddiloco.core.actions import (Behind, Fail, LearnerAction, Outage, OutagePhase, Send, SendHeartbeat, SendJoin,
                                  SendLeave, Stale, Starved)
from ddiloco.core.deadlines import call_deadline_s, client_join_link, join_state_bytes
from ddiloco.core.learner import Learner
from ddiloco.core.shard_link import BACKOFF_START_S, backoff_after
from ddiloco.core.messages import Request, Session, StopNotice
from ddiloco.errors import DdilocoError
from ddiloco.runtime.client import JoinResult, CallRefused, SyncClient, Unreachable
from ddiloco.runtime.learner.staging import HostStaging

log = logging.getLogger("ddiloco.learner")

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


REPEAT_EVERY_S = 30.0
"""A refusal repeated for the same reason is logged again at most this often, with its count."""


class Repeats:
    """Refusals logged once per reason and then summarized: on a slow link every contribution may
    be refused alike (``stale``), and a line per call buries everything else in the log."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._clock = clock
        self._said: dict[object, tuple[float, int]] = {}
        """Per key: when it was last logged, and how many times it came since."""

    def say(self, key: object, fmt: str, *args: object) -> None:
        now = self._clock()
        said = self._said.get(key)
        if said is None or now - said[0] >= REPEAT_EVERY_S:
            repeats = f" ({said[1]} more like it in the last {now - said[0]:.0f} s)" if said and said[1] else ""
            self._log.info(fmt + "%s", *args, repeats)
            self._said[key] = (now, 0)
        else:
            self._said[key] = (said[0], said[1] + 1)
            self._log.debug(fmt, *args)


def next_delay(delay: float) -> float:
    """The core's backoff with ±20% jitter, so that many learners do not call back in step."""
    return backoff_after(delay) * random.uniform(0.8, 1.2)


class LearnerLink:
    """Every shard's channel, one shared core, lock and inbox."""

    def __init__(self, core: Learner, clients: list[SyncClient], lock: threading.RLock, staging: HostStaging,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.staging = staging
        self.lock = lock
        self.clock = clock
        self.stats = LinkStats()
        self.inbox: queue.Queue[tuple[Inbox, Any]] = queue.Queue()
        self.fatal: BaseException | None = None
        self.closing = threading.Event()
        self.channels = [ShardChannel(self, shard, client) for shard, client in enumerate(clients)]
        self._leaves: list[SendLeave] = []
        self._tick_wake = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name=f"ddiloco-tick-{core.learner_id}", daemon=True)

    def start(self) -> None:
        """Start every thread; the core's first joins follow (``Learner.start``)."""
        for channel in self.channels:
            channel.start()
        self._ticker.start()

    def _tick_loop(self) -> None:
        while not self.closing.is_set():
            with self.lock:
                deadline = self.core.next_deadline()
            wait = CONTROL_MAX_WAIT_S if deadline is None else min(CONTROL_MAX_WAIT_S, max(0.0, deadline - self.clock()))
            if self._tick_wake.wait(wait):
                self._tick_wake.clear()
                continue
            self.tell_core(lambda core: core.tick(self.clock()))

    @property
    def backlog(self) -> int:
        return sum(c.outbox.qsize() for c in self.channels)

    def dispatch(self, actions: list[LearnerAction]) -> None:
        for action in self.staging.stage(actions):
            if isinstance(action, Send):
                self.channels[action.shard].outbox.put(action)
            elif isinstance(action, (SendJoin, SendHeartbeat)):
                self.channels[action.shard].control(action)
            elif isinstance(action, Fail):
                self.fail(DdilocoError(action.detail))  # one line for the user, never retried
            elif isinstance(action, SendLeave):
                self._leaves.append(action)  # once the senders have delivered what is queued
            elif isinstance(action, Starved):
                log.warning("none of this learner's work has reached the synchronizer in its last %d steps, although "
                            "it answers: its link is too slow for the protocol (%d contributions waiting)",
                            action.steps, self.backlog)
            elif isinstance(action, Stale):
                log.warning("this learner's contributions arrive stale: fragment %d, measured from version %d, was "
                            "refused although updates reach it in order (it holds version %d by now): its link's "
                            "round trip spans more rounds than the synchronizer merges late work from "
                            "(protocol.staleness_max x protocol.staleness_reach). It trains on, following the "
                            "global model, without registering again; its own work is merged again once the link "
                            "is faster or the rounds slower: protocol.period = %d would fit",
                            action.fragment, action.base_version, action.held_version, action.period_fits)
            elif isinstance(action, Outage):
                self.channels[action.shard].say_outage(action)
            elif isinstance(action, Behind):
                log.warning("%s", action.describe())

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
        for channel in self.channels:
            channel.wake()
        self.inbox.put((Inbox.WAKE, None))

    def close(self, timeout_s: float) -> None:
        """Deliver what is queued, leave every shard if the core said so, then stop every thread."""
        for channel in self.channels:
            channel.outbox.put(None)
        for channel in self.channels:
            channel.join_sender(timeout_s)
        if self.fatal is None:
            for leave in self._leaves:
                self.channels[leave.shard].leave(leave)
        self.closing.set()
        self._tick_wake.set()
        for channel in self.channels:
            channel.stop(timeout_s)
        if self._ticker.is_alive():
            self._ticker.join(timeout_s)


class ShardChannel:
    """The threads that talk to one synchronizer shard."""

    def __init__(self, link: LearnerLink, shard: int, client: SyncClient) -> None:
        self.link = link
        self.shard = shard
        self.client = client
        self.outbox: queue.Queue[Send | None] = queue.Queue()
        self._control: queue.Queue[LearnerAction] = queue.Queue()
        self._control_wake = threading.Event()
        self._session: Session | None = None
        self._session_changed = threading.Event()
        self._stream: Any = None
        self.last_error = ""
        """Why the last call went unanswered (for the outage's lines)."""
        self.refusals = Repeats(log)
        name = f"{link.core.learner_id}-{shard}"
        self._threads = [
            threading.Thread(target=self._sender, name=f"ddiloco-send-{name}", daemon=True),
            threading.Thread(target=self._control_loop, name=f"ddiloco-ctl-{name}", daemon=True),
            threading.Thread(target=self._receiver, name=f"ddiloco-recv-{name}", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def control(self, action: LearnerAction) -> None:
        self._control.put(action)
        self._control_wake.set()

    def say_outage(self, outage: Outage) -> None:
        """One line when the shard stops answering, a summary at intervals, one line when it is back."""
        where = f"the synchronizer at {self.client.address} (shard {self.shard})"
        if outage.phase is OutagePhase.ENDED:
            log.warning("%s answers again after %.0f s%s", where, outage.for_s,
                        f"; {outage.folded} contributions were folded into later ones" if outage.joined else "")
        elif not outage.joined:
            log.warning("no answer from %s for %.0f s (%s): is it running, and is this its gRPC port (not the status "
                        "page's)? Still trying", where, outage.for_s, self.last_error)
        elif outage.phase is OutagePhase.BEGAN:
            log.warning("%s does not answer (%s): training goes on, contributions are folded into later ones until "
                        "it is back", where, self.last_error)
        else:
            log.warning("%s unreachable for %.0f s; %d contributions folded so far, training goes on", where,
                        outage.for_s, outage.folded)

    def wake(self) -> None:
        self._control_wake.set()
        self._session_changed.set()

    def _outcome(self, request: Request, call: Callable[[], Any]) -> Any:
        """Make one call; report accepted / refused / undelivered to the core. Returns the reply or None."""
        link, shard = self.link, self.shard
        try:
            reply = call()
        except Unreachable as err:
            link.stats.unreachable += 1
            self.last_error = str(err)  # an outage is said by the core's Outage actions, not per call
            log.debug("%s to shard %d undelivered: %s", type(request).__name__, shard, err)
            link.tell_core(lambda core: core.on_undelivered(request, link.clock(), shard=shard))
            return None
        except CallRefused as err:  # a wrong secret too: whether to go on is the core's decision
            reason = err.reason
            link.stats.rejected[reason] += 1
            self.refusals.say(reason, "%s refused by shard %d: %s", type(request).__name__, shard, err.detail)
            link.tell_core(lambda core: core.on_refused(request, reason, link.clock(), shard=shard))
            return None
        return reply

    # ---- sender ----------------------------------------------------------------------------

    def _sender(self) -> None:
        link = self.link
        while True:
            send = self.outbox.get()
            if send is None:
                return
            with link.lock:
                deliver = link.core.still_to_send(send)
            if not deliver:
                continue
            contribution = send.encode()
            reply = self._outcome(contribution, lambda: self.client.contribute(contribution))
            if reply is not None:
                link.stats.contributions_sent += 1
                link.stats.bytes_up += len(contribution.payload)
                link.tell_core(lambda core: core.on_accepted(contribution, link.clock(), stop=reply.stop,
                                                             shard=self.shard))

    def join_sender(self, timeout_s: float) -> None:
        self._threads[0].join(timeout_s)

    # ---- control ---------------------------------------------------------------------------

    def _control_loop(self) -> None:
        link = self.link
        while not link.closing.is_set():
            try:
                action = self._control.get_nowait()
            except queue.Empty:
                self._control_wake.wait(CONTROL_MAX_WAIT_S)
                self._control_wake.clear()
                continue
            if isinstance(action, SendJoin):
                self._join(action)
            elif isinstance(action, SendHeartbeat):
                beat = action.message
                reply = self._outcome(beat, lambda: self.client.heartbeat(beat))
                if reply is not None:
                    link.tell_core(lambda core: core.on_accepted(beat, link.clock(), stop=reply.stop,
                                                                 shard=self.shard))

    def _join(self, action: SendJoin) -> None:
        config = self.link.core.config  # the state it brings back, at the slowest link the run admits
        timeout_s = call_deadline_s(join_state_bytes(self.link.core.plan, config, self.shard), client_join_link(config))
        result: JoinResult | None = self._outcome(action.message, lambda: self.client.join(action.message, timeout_s))
        if result is None:
            return
        self.link.stats.joins += 1
        session = result.state.session
        assert session is not None
        joins = self.link.stats.joins
        log.info("joined synchronizer instance %x (shard %d, session %d) at versions %s%s", session.incarnation,
                 self.shard, session.number, list(result.state.versions()),
                 f": a rejoin, registration {joins} of this process" if joins > len(self.link.channels) else "")
        self.link.inbox.put((Inbox.ADMITTED, (self.shard, result)))  # adopted by the training thread
        self._session = session
        self._session_changed.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()  # subscribe again for the new session

    def leave(self, action: SendLeave) -> None:
        """Leave the shard; the core hears how the call ended, like any other's (a leave that got no
        answer, or a refusal, leaves this learner registered there until its lease runs out)."""
        if self._outcome(action.message, lambda: self.client.leave(action.message)) is None:
            log.info("leave of shard %d not confirmed: the synchronizer forgets this learner when its lease ends",
                     self.shard)

    # ---- receiver --------------------------------------------------------------------------

    def _receiver(self) -> None:
        link = self.link
        delay = BACKOFF_START_S
        while not link.closing.is_set():
            session = self._session
            self._session_changed.clear()
            if session is None:
                self._session_changed.wait(BACKOFF_START_S)
                continue
            with link.lock:
                held = link.core.stream_versions(self.shard)
            if held is None:  # the state this session's join brought is not adopted yet
                self._session_changed.wait(BACKOFF_START_S)
                continue
            try:
                stream = self.client.updates(link.core.learner_id, held, session)
                self._stream = stream
                for update in stream:
                    delay = BACKOFF_START_S
                    if isinstance(update, StopNotice):
                        link.tell_core(lambda core: core.on_stop(link.clock()))
                        link.inbox.put((Inbox.WAKE, None))
                    else:
                        link.inbox.put((Inbox.UPDATE, (update, link.staging.decode(update))))
                self._session_changed.wait(BACKOFF_START_S)  # closed by the synchronizer: subscribe again
            except (Unreachable, CallRefused):
                # Not a decision: a broken stream is re-made; whether the session is still ours
                # (or our secret still good) the core learns from its heartbeats.
                if self._session_changed.wait(delay):
                    delay = BACKOFF_START_S
                else:
                    delay = next_delay(delay)
            finally:
                self._stream = None

    def stop(self, timeout_s: float) -> None:
        self.wake()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        for t in self._threads[1:]:
            t.join(timeout_s)
