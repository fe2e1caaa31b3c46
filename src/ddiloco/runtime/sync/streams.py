"""Learners' update streams: the synchronizer pushes every new fragment value as it is made.

Each learner holds one server stream (``Updates``); a broadcast is serialized once and
queued to every recipient's stream, and a stop notice goes the same way. What is replayed to
a learner that resubscribes, and when a stream is too slow, is the protocol's rule
(:mod:`ddiloco.core.sync_side.replay`, followed by the virtual cluster too).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ddiloco.core.shared.messages import FragmentUpdate, StopNotice
from ddiloco.core.sync_side.replay import ReplayLog, too_slow
from ddiloco.runtime.wire import update_chunks

log = logging.getLogger("ddiloco.sync")

CLOSE = object()
"""What a stream's queue carries, besides (fragment, chunks, delivery) and stop notices, to end it."""


@dataclass(slots=True)
class Delivery:
    """One update on its way into its recipients' streams: ``on_sent`` runs once the last of
    them has written it, or dropped it with its stream (ξ_sync ends there: core/shared/grace.py)."""

    on_sent: Callable[[], None]
    pending: int = 0

    def done(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.on_sent()


@dataclass(slots=True)
class Subscriber:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    backlog: int = 0


class UpdateStreams:
    def __init__(self, fragments: int, replay_bytes: int) -> None:
        self._subscribers: dict[str, Subscriber] = {}
        self._replay: ReplayLog[list[bytes]] = ReplayLog(fragments, replay_bytes)

    def subscribe(self, learner: str) -> Subscriber:
        """A new stream for ``learner`` (replacing the one it had, which is closed)."""
        previous = self._subscribers.get(learner)
        if previous is not None:
            previous.queue.put_nowait(CLOSE)
        sub = self._subscribers[learner] = Subscriber()
        return sub

    def unsubscribe(self, learner: str, sub: Subscriber) -> None:
        """``sub``'s stream has ended: what it had not written is dropped."""
        if self._subscribers.get(learner) is sub:
            del self._subscribers[learner]
        while not sub.queue.empty():
            item = sub.queue.get_nowait()
            if isinstance(item, tuple) and item[2] is not None:
                item[2].done()

    def replay(self, have_versions: list[int]) -> Iterator[tuple[int, list[bytes]]]:
        """Recent updates newer than what a resubscribing learner holds, per fragment in order."""
        return self._replay.since(have_versions)

    def publish(self, update: FragmentUpdate, recipients: tuple[str, ...],
                on_sent: Callable[[], None] | None = None) -> None:
        """Queue ``update`` to each recipient's stream; ``on_sent`` runs once every stream it
        was queued to has written it (never, if no recipient listens)."""
        chunks = update_chunks(update)
        self._replay.record(update.fragment, update.version, chunks, sum(map(len, chunks)))
        delivery = Delivery(on_sent) if on_sent is not None else None
        for name in recipients:
            sub = self._subscribers.get(name)
            if sub is None:
                continue  # not listening right now: it replays or rejoins when it resubscribes
            if too_slow(sub.backlog):
                log.warning("learner %s: update stream too slow, closing it", name)
                self.close(name)
                continue
            sub.backlog += 1
            sub.queue.put_nowait((update.fragment, chunks, delivery))
            if delivery is not None:
                delivery.pending += 1

    def stop(self, recipients: tuple[str, ...] | None = None) -> None:
        """Tell learners (all subscribed ones by default) that the run's budget is spent."""
        names = list(self._subscribers) if recipients is None else recipients
        for name in names:
            sub = self._subscribers.get(name)
            if sub is not None:
                sub.queue.put_nowait(StopNotice())

    def close(self, learner: str) -> None:
        sub = self._subscribers.pop(learner, None)
        if sub is not None:
            sub.queue.put_nowait(CLOSE)

    def close_all(self) -> None:
        for name in list(self._subscribers):
            self.close(name)
