"""The thread that runs the synchronizer's core, and the carrying-out of its actions.

The core is touched by that one thread only: every call into it (events, questions, the
checkpoint's snapshot) runs on one dedicated worker thread, so its calls are serialized
without locks and a long merge never stalls the sockets (which the asyncio event loop
serves). After every event the thread publishes :attr:`SyncHost.view`, an immutable
:class:`~ddiloco.core.sync_side.status_snapshot.CoreView` (phase, versions, learners alive, tokens) that the
event loop, metrics and logs read instead of the core; whatever else they need (status) is
asked through :meth:`SyncHost.query`, which runs on the core's thread too. (Reading the core
from the event loop while its thread registered a burst of learners once raised "dictionary
changed size during iteration" inside the timer and killed the service.)

``handle`` feeds the core one event with the host's clock and carries out what comes
back — except the reply, which it returns to the gRPC handler that asked:

- ``LogRound`` → the round log (:mod:`ddiloco.runtime.sync.round_log`), when there is one;
  then every stream operation waits, in order, until the records before it are durable;
- ``Broadcast`` → every recipient's update stream (and the measured merge-and-send time
  back to the core, which sizes its grace window);
- ``StopLearners`` → a stop notice on those streams; ``LeaseExpired`` → close that stream;
- ``LinkStarved`` → a warning in the log;
- ``RoundClosed`` and ``Checkpoint`` → the service's observer (metrics, goodput, the
  state directory); ``Finished`` → :attr:`finished`.

A timer task calls ``Tick`` at the core's ``next_deadline()`` (grace windows, leases, the
time budget, the drain).

Status never waits for a merge: the merge kernels release the GIL, so the event loop runs
while the core's thread merges, and :meth:`SyncHost.status` answers from the status the core's
thread last published (at most ``STATUS_REFRESH_S`` older than its latest event) whenever the
core's thread has an event in hand or queued; only an idle core is asked (a round of a
1B-parameter model's fragment takes a good part of a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol, TypeVar

from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    Broadcast,
    Checkpoint,
    Finished,
    LeaseExpired,
    LinkStarved,
    LogRound,
    Refused,
    Reply,
    RoundClosed,
    StopLearners,
    SyncAction,
    SyncEvent,
    SyncTimeObserved,
    Tick,
)
from ddiloco.core.sync_side.status_snapshot import CoreView, SyncStatus
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.runtime.sync.round_log import RoundLog
from ddiloco.runtime.sync.streams import UpdateStreams

log = logging.getLogger("ddiloco.sync")

T = TypeVar("T")
TIMER_MAX_WAIT_S = 1.0
"""The timer wakes at least this often (an idle core has no deadline)."""
STATUS_WAIT_S = 0.05
"""How long a status call waits for an idle core's thread before it answers from the published status."""
STATUS_REFRESH_S = 0.25
"""The core's thread publishes its status after an event when the published one is this old, and
after the last event of a burst (so that an idle core's published status is its latest)."""


class HostObserver(Protocol):
    """What the service does with the core's records."""

    def on_round(self, record: RoundClosed, elapsed_s: float) -> None: ...

    def on_checkpoint(self, state: dict[str, Any]) -> None: ...

    def on_event(self, actions: list[SyncAction]) -> None: ...


class SyncHost:
    def __init__(self, core: Synchronizer, streams: UpdateStreams, observer: HostObserver, *,
                 clock: Callable[[], float] = time.monotonic, round_log: RoundLog | None = None) -> None:
        self.core = core
        self.round_log = round_log
        self._outbox: asyncio.Queue[tuple[Callable[[], None], Future | None]] = asyncio.Queue()
        """Stream operations waiting for the round log (in order: an update never overtakes another)."""
        self._sender: asyncio.Task | None = None
        self.streams = streams
        self.observer = observer
        self.clock = clock
        self.finished = asyncio.Event()
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-core")
        self.view: CoreView = core.view()  # before the thread starts: nobody else holds the core yet
        self._status: tuple[float, SyncStatus] = (time.monotonic(), core.status(clock()))
        self._events = 0
        """Events and questions handed to the core's thread and not yet answered (running or queued)."""
        self._timer: asyncio.Task | None = None
        self._stopped = False
        self.failure: BaseException | None = None
        """What broke the timer, if anything: the service stops loudly rather than serve a core that no longer ticks."""
        self.crashed = asyncio.Event()

    async def query(self, fn: Callable[[Synchronizer], T]) -> T:
        """Run a read-only question to the core on its thread (its answer must not share the core's state)."""
        self._events += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.core)
        finally:
            self._events -= 1

    async def status(self) -> SyncStatus:
        """The core's status: asked of its thread when it is idle, else the one it last published
        (a status call never queues behind an event: any of them may close a round)."""
        if self._events:
            return self._status[1]
        asked = asyncio.ensure_future(self._ask_status())
        try:
            return await asyncio.wait_for(asyncio.shield(asked), STATUS_WAIT_S)
        except asyncio.TimeoutError:
            return self._status[1]

    async def _ask_status(self) -> SyncStatus:
        # Checked when the question runs, not when it was asked: a stop before then shuts the
        # core's thread down (the status page's feed asked once more after a SIGTERM).
        if self._stopped:
            return self._status[1]
        return await self.query(self._publish_status)

    def _publish_status(self, core: Synchronizer) -> SyncStatus:
        status = core.status(self.clock())
        self._status = (time.monotonic(), status)
        return status

    async def handle(self, event: SyncEvent) -> Reply | None:
        """Feed one event; carry out the actions; return the reply to the request, if any."""

        def run() -> tuple[list[SyncAction], float, CoreView]:
            started = time.perf_counter()
            actions = self.core.handle(event, self.clock())
            elapsed = time.perf_counter() - started
            if self._events <= 1 or time.monotonic() - self._status[0] >= STATUS_REFRESH_S:
                self._publish_status(self.core)  # the last of a burst, or a while since the last one
            return actions, elapsed, self.core.view()

        self._events += 1
        try:
            actions, compute_s, self.view = await asyncio.get_running_loop().run_in_executor(self._pool, run)
        finally:
            self._events -= 1
        reply = actions[0] if actions and isinstance(actions[0], (Admitted, Accepted, Refused)) else None
        self._execute(actions, compute_s)
        return reply

    def _execute(self, actions: list[SyncAction], compute_s: float) -> None:
        started = time.perf_counter()
        merged: list[RoundClosed] = []
        durable: Future | None = None
        for action in actions:
            if isinstance(action, LogRound) and self.round_log is not None:
                u = action.update
                durable = self.round_log.append(u.fragment, u.version, action.plain, u.payload, action.reached)
            elif isinstance(action, Broadcast):
                sent = self._observe_sync(compute_s, started)
                self._stream(lambda a=action, s=sent: self.streams.publish(a.update, a.recipients, s), durable)
            elif isinstance(action, StopLearners):
                self._stream(lambda a=action: self.streams.stop(a.recipients), durable)
            elif isinstance(action, LeaseExpired):
                self._stream(lambda a=action: self.streams.close(a.learner_id), durable)
            elif isinstance(action, LinkStarved):
                log.warning("learner %s: none of its work has reached the synchronizer for %.0fs while it holds "
                            "a lease: its link is too slow for the protocol", action.learner_id, action.for_s)
            elif isinstance(action, RoundClosed):
                merged.append(action)
            elif isinstance(action, Checkpoint):
                self.observer.on_checkpoint(action.state)
            elif isinstance(action, Finished):
                self.finished.set()
        if merged:
            elapsed = compute_s + time.perf_counter() - started
            for record in merged:
                self.observer.on_round(record, elapsed)
        self.observer.on_event(actions)
        self._wake.set()  # deadlines may have moved

    def _observe_sync(self, compute_s: float, started: float) -> Callable[[], None]:
        """ξ_sync of one update (core/shared/grace.py): the core's time on the event that closed its
        round, then until the last recipient's stream has written it, the round log's wait included."""

        def sent() -> None:
            if not self._stopped:
                self._pool.submit(self.core.handle, SyncTimeObserved(compute_s + time.perf_counter() - started),
                                  self.clock())

        return sent

    def _stream(self, operation: Callable[[], None], durable: Future | None) -> None:
        """Carry out a stream operation now, or — with a round log — after the records before it are durable."""
        if self.round_log is None:
            operation()
            return
        self._outbox.put_nowait((operation, durable))
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send_when_durable())

    async def _send_when_durable(self) -> None:
        while True:
            operation, durable = await self._outbox.get()
            if durable is not None:
                await asyncio.wrap_future(durable)
            operation()
            self._outbox.task_done()

    async def durable(self) -> None:
        """Wait until every round logged so far is on disk (at once without a round log)."""
        if self.round_log is not None:
            await asyncio.wrap_future(self.round_log.barrier())

    async def flush(self) -> None:
        """Wait until every stream operation queued behind the round log is carried out."""
        await self._outbox.join()

    # ---- the timer -------------------------------------------------------------------------

    def start(self) -> None:
        self._timer = asyncio.ensure_future(self._timer_loop())

    async def _timer_loop(self) -> None:
        try:
            while not self._stopped:
                # Cleared before the deadline is read, not after the wait: the timer's own Tick
                # sets the wake like every event does, and cleared after it the loop never slept
                # (thousands of Ticks a second, a core's worth of CPU taken from the learners).
                # An event after this point sets it again, and the deadline is read anew.
                self._wake.clear()
                deadline = await self.query(lambda core: core.next_deadline())
                now = self.clock()
                wait_s = TIMER_MAX_WAIT_S if deadline is None else min(TIMER_MAX_WAIT_S, max(0.0, deadline - now))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                if not self._stopped:
                    await self.handle(Tick())
        except Exception as err:  # a bug: without the timer no lease expires and no grace window closes
            log.critical("the synchronizer's timer failed; stopping without a final checkpoint", exc_info=True)
            self.failure = err
            self.crashed.set()

    async def stop_timer(self) -> None:
        # A flag, not only cancel(): asyncio.wait_for in Python 3.11 can swallow a cancellation
        # that arrives as its inner wait completes, and the loop would run on.
        self._stopped = True
        self._wake.set()
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None

    async def stop(self) -> None:
        await self.stop_timer()
        self._pool.shutdown(wait=True)
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
