"""The virtual cluster's clock: a priority queue of typed events, ordered by (time, sequence)."""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any


class Ev(enum.Enum):
    # at a learner process
    STEP_END = enum.auto()
    REPLY = enum.auto()
    """The synchronizer's answer to one of the learner's calls."""
    PUSH = enum.auto()
    """An update or a stop notice on the learner's update stream."""
    CALL_TIMEOUT = enum.auto()
    LEARNER_TICK = enum.auto()
    # at the synchronizer
    REQUEST = enum.auto()
    SYNC_TICK = enum.auto()
    DELIVERED = enum.auto()
    """A joining learner's global state arrived (or its transfer failed): its lease runs from now."""
    # the failure trace and the adversary
    CRASH = enum.auto()
    RECOVER = enum.auto()
    FREEZE = enum.auto()
    THAW = enum.auto()
    PARTITION = enum.auto()
    PARTITION_END = enum.auto()
    """The learner's links are back: its update stream resubscribes and what it missed is replayed."""
    SYNC_CRASH = enum.auto()
    SYNC_RESTART = enum.auto()


@dataclass(order=True, slots=True)
class Event:
    time: float
    seq: int
    kind: Ev = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)


class EventQueue:
    """Events in time order; ties keep the order they were scheduled in (determinism)."""

    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self.now = 0.0

    def at(self, time: float, kind: Ev, *args: Any) -> None:
        heapq.heappush(self._heap, Event(max(time, self.now), next(self._seq), kind, args))

    def pop(self) -> Event:
        event = heapq.heappop(self._heap)
        self.now = event.time
        return event

    def next_time(self) -> float:
        """When the next event happens (inf when there is none)."""
        return self._heap[0].time if self._heap else float("inf")

    def __len__(self) -> int:
        return len(self._heap)

    def pending(self) -> list[Event]:
        return sorted(self._heap)

    def clear(self) -> None:
        self._heap.clear()
