"""Learners' update streams: the synchronizer pushes every new fragment value as it is made.

Each learner holds one server stream (``Updates``); a broadcast is serialized once and
queued to every recipient's stream. The last few updates of each fragment are kept, so a
learner whose stream broke for a moment resubscribes with the versions it holds and gets
what it missed replayed, instead of fetching the full state. A stream that falls too far
behind is closed (its learner resubscribes, and replays or rejoins).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Iterator

from ddiloco.core.messages import FragmentUpdate
from ddiloco.runtime.wire import update_chunks

log = logging.getLogger("ddiloco.sync")

REPLAY_UPDATES = 8
"""Recent updates kept per fragment for learners whose update stream broke briefly..."""
REPLAY_BYTES = 256 << 20
"""... within this many bytes per fragment (a learner that misses more fetches the full state)."""
STREAM_BACKLOG = 64
"""Updates queued for one learner's stream before it is closed as too slow (it resubscribes)."""


class StreamItem:
    """Markers a stream's queue carries besides updates."""

    CLOSE = object()
    STOP = object()


@dataclass(slots=True)
class Subscriber:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    backlog: int = 0


class UpdateStreams:
    def __init__(self, fragments: int) -> None:
        self._subscribers: dict[str, Subscriber] = {}
        self._recent: list[collections.deque[tuple[int, list[bytes]]]] = [
            collections.deque(maxlen=REPLAY_UPDATES) for _ in range(fragments)
        ]

    def subscribe(self, learner: str) -> Subscriber:
        """A new stream for ``learner`` (replacing the one it had, which is closed)."""
        previous = self._subscribers.get(learner)
        if previous is not None:
            previous.queue.put_nowait(StreamItem.CLOSE)
        sub = self._subscribers[learner] = Subscriber()
        return sub

    def unsubscribe(self, learner: str, sub: Subscriber) -> None:
        if self._subscribers.get(learner) is sub:
            del self._subscribers[learner]

    def replay(self, have_versions: list[int]) -> Iterator[tuple[int, list[bytes]]]:
        """Recent updates newer than what a resubscribing learner holds, per fragment in order."""
        for p, recent in enumerate(self._recent):
            held = have_versions[p] if p < len(have_versions) else 0
            for version, chunks in list(recent):
                if version > held:
                    yield p, chunks

    def publish(self, update: FragmentUpdate, recipients: tuple[str, ...]) -> None:
        chunks = update_chunks(update)
        recent = self._recent[update.fragment]
        recent.append((update.version, chunks))
        while len(recent) > 1 and sum(len(c) for _, chunk_list in recent for c in chunk_list) > REPLAY_BYTES:
            recent.popleft()
        for name in recipients:
            sub = self._subscribers.get(name)
            if sub is None:
                continue  # not listening right now: it replays or rejoins when it resubscribes
            if sub.backlog >= STREAM_BACKLOG:
                log.warning("learner %s: update stream too slow, closing it", name)
                self.close(name)
                continue
            sub.backlog += 1
            sub.queue.put_nowait((update.fragment, chunks))

    def stop(self, recipients: tuple[str, ...] | None = None) -> None:
        """Tell learners (all subscribed ones by default) that the run's budget is spent."""
        names = list(self._subscribers) if recipients is None else recipients
        for name in names:
            sub = self._subscribers.get(name)
            if sub is not None:
                sub.queue.put_nowait(StreamItem.STOP)

    def close(self, learner: str) -> None:
        sub = self._subscribers.pop(learner, None)
        if sub is not None:
            sub.queue.put_nowait(StreamItem.CLOSE)

    def close_all(self) -> None:
        for name in list(self._subscribers):
            self.close(name)
