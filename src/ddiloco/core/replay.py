"""Updates a learner missed while its update stream was broken, replayed when it is back.

A learner whose stream broke for a moment (a network blip, a partition) comes back holding
older versions than the synchronizer's. Rather than send it the whole state again, the
synchronizer keeps each fragment's last few updates and replays those newer than what the
learner says it holds; a learner that missed more than that finds a gap at the next update
and joins again (``Learner.on_update``). Both drivers follow this rule: the gRPC service
when a learner resubscribes, the virtual cluster when a partition ends. A stream that falls
``STREAM_BACKLOG`` updates behind is closed as too slow (its learner resubscribes, and
replays or rejoins).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

REPLAY_UPDATES = 8
"""Recent updates kept per fragment..."""
REPLAY_BYTES = 256 << 20
"""... within this many bytes per fragment."""
STREAM_BACKLOG = 64
"""Updates queued for one learner's stream before it is closed as too slow."""


class ReplayLog(Generic[T]):
    """The last updates of every fragment, as the driver sends them (``T``: its form of an update)."""

    def __init__(self, fragments: int) -> None:
        self._recent: list[collections.deque[tuple[int, T, int]]] = [
            collections.deque(maxlen=REPLAY_UPDATES) for _ in range(fragments)
        ]

    def record(self, fragment: int, version: int, update: T, size: int) -> None:
        recent = self._recent[fragment]
        recent.append((version, update, size))
        while len(recent) > 1 and sum(s for _, _, s in recent) > REPLAY_BYTES:
            recent.popleft()

    def since(self, held: Sequence[int]) -> Iterator[tuple[int, T]]:
        """(fragment, update) for every kept update newer than the versions ``held``, in order."""
        for p, recent in enumerate(self._recent):
            have = held[p] if p < len(held) else 0
            for version, update, _ in list(recent):
                if version > have:
                    yield p, update


def too_slow(backlog: int) -> bool:
    """Is a stream this many updates behind to be closed?"""
    return backlog >= STREAM_BACKLOG
