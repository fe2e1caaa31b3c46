"""Updates a learner missed while its update stream was broken, replayed when it is back.

A learner whose stream broke for a moment (a network blip, a partition) comes back holding
older versions than the synchronizer's. Rather than send it the whole state again, the
synchronizer keeps each fragment's last few updates and replays those newer than what the
learner says it holds; a learner that missed more than that finds a gap at the next update
and joins again (``Learner.on_update``). A stream that falls ``STREAM_BACKLOG`` updates
behind is closed as too slow (its learner resubscribes, and replays or rejoins).

Both drivers follow this rule: what the learner announces is
:meth:`~ddiloco.core.learner_side.learner_core.Learner.stream_versions`, what comes back is
:meth:`ReplayLog.since`. Only when differs, because their streams break differently: a gRPC
learner makes its stream again whenever it breaks, after the core's backoff
(``core/learner_side/shard_link.py``, with jitter), while a virtual cluster's stream loses messages only in
a partition and is made again the moment the partition ends.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

REPLAY_UPDATES = 8
"""Recent updates kept per fragment..."""
REPLAY_BYTES_MIN = 64 << 20
REPLAY_STATE_SHARE = 8
"""... within one byte budget for the whole synchronizer: the larger of ``REPLAY_BYTES_MIN``
and 1/``REPLAY_STATE_SHARE`` of its fp32 state (0.5 bytes per parameter, about one int4
update of every fragment on a large model). The oldest update of any fragment goes first."""
STREAM_BACKLOG = 64
"""Updates queued for one learner's stream before it is closed as too slow."""


class ReplayLog(Generic[T]):
    """The last updates of every fragment, as the driver sends them (``T``: its form of an update)."""

    def __init__(self, fragments: int, budget_bytes: int = REPLAY_BYTES_MIN) -> None:
        self._recent: list[collections.deque[tuple[int, T, int]]] = [collections.deque() for _ in range(fragments)]
        self._order: collections.deque[int] = collections.deque()
        """Fragments in the order their kept updates were recorded (oldest first)."""
        self.budget_bytes = budget_bytes
        self.held_bytes = 0

    def record(self, fragment: int, version: int, update: T, size: int) -> None:
        recent = self._recent[fragment]
        if len(recent) == REPLAY_UPDATES:
            self._drop(fragment)
        recent.append((version, update, size))
        self._order.append(fragment)
        self.held_bytes += size
        while self.held_bytes > self.budget_bytes and len(self._order) > 1:
            self._drop(self._order[0])

    def _drop(self, fragment: int) -> None:
        """Forget the oldest kept update of ``fragment``."""
        _, _, size = self._recent[fragment].popleft()
        self._order.remove(fragment)  # its first occurrence is that update's
        self.held_bytes -= size

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


def replay_budget(state_bytes: int) -> int:
    """The replay log's byte budget for a synchronizer holding ``state_bytes`` of fp32 fragments."""
    return max(REPLAY_BYTES_MIN, state_bytes // REPLAY_STATE_SHARE)
