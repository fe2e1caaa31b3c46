"""The virtual cluster's clock: a priority queue of typed events, ordered by (time, sequence).

Each event is a small frozen dataclass naming what happens and to whom. Events for a learner
process carry its index and *boot*: one meant for a process that has since died (or been
restarted) is dropped when it comes due.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ddiloco.core.shared.actions import Admitted, Reply
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Request, StopNotice
from ddiloco.core.sync_side.upload_admission import InFlight

# ---- at a learner process ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AtLearner:
    m: int
    boot: int


@dataclass(frozen=True, slots=True)
class StepEnd(AtLearner):
    started_s: float


@dataclass(frozen=True, slots=True)
class ReplyArrives(AtLearner):
    """The synchronizer's answer to one of the learner's calls."""

    call_id: int
    reply: Reply
    shard: int


@dataclass(frozen=True, slots=True)
class PushArrives(AtLearner):
    """An update or a stop notice on the learner's update stream."""

    message: FragmentUpdate | StopNotice


@dataclass(frozen=True, slots=True)
class CallTimeout(AtLearner):
    call_id: int


@dataclass(frozen=True, slots=True)
class LearnerTick(AtLearner):
    pass


# ---- at the synchronizer ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestArrives:
    m: int
    boot: int
    call_id: int
    request: Request
    shard: int


@dataclass(frozen=True, slots=True)
class UploadHeader:
    """The first bytes of a stalled upload: its place is held, its body never comes."""

    m: int
    boot: int
    call_id: int
    request: Contribution
    shard: int


@dataclass(frozen=True, slots=True)
class UploadCut:
    """A stalled upload's deadline: the synchronizer ends it (``timed_out``) if it still holds it."""

    shard: int
    incarnation: int
    upload: InFlight


@dataclass(frozen=True, slots=True)
class SyncTick:
    shard: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class StateArrives:
    """A joining learner's global state arrived (or its transfer failed): its lease runs from now."""

    shard: int
    incarnation: int
    m: int
    boot: int
    admitted: Admitted
    arrived: bool


# ---- the failure trace and the adversary ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Crash:
    m: int


@dataclass(frozen=True, slots=True)
class Recover:
    m: int


@dataclass(frozen=True, slots=True)
class Arrive:
    """A late learner's process starts (``cluster.late_learners``): it joins as a restarted one
    does, holding nothing of the run yet."""

    m: int


@dataclass(frozen=True, slots=True)
class Freeze:
    m: int
    until_s: float


@dataclass(frozen=True, slots=True)
class Thaw:
    m: int


@dataclass(frozen=True, slots=True)
class Partition:
    m: int
    until_s: float


@dataclass(frozen=True, slots=True)
class PartitionEnd:
    """The learner's links are back: its update stream resubscribes and what it missed is replayed."""

    m: int


@dataclass(frozen=True, slots=True)
class Stall:
    """From now until ``until_s``, learner ``m``'s uploads stall after their header."""

    m: int
    until_s: float


@dataclass(frozen=True, slots=True)
class SyncCrash:
    shard: int
    until_s: float


@dataclass(frozen=True, slots=True)
class SyncRestart:
    shard: int


@dataclass(frozen=True, slots=True)
class FloodJoin:
    """One join of the adversary's flood against a synchronizer shard; the next follows until ``until_s``."""

    shard: int
    number: int
    until_s: float


SimEvent = (StepEnd | ReplyArrives | PushArrives | CallTimeout | LearnerTick | RequestArrives | UploadHeader
            | UploadCut | SyncTick | StateArrives | Crash | Recover | Arrive | Freeze | Thaw | Partition | PartitionEnd
            | Stall | SyncCrash | SyncRestart | FloodJoin)


@dataclass(order=True, slots=True)
class Event:
    time: float
    seq: int
    what: SimEvent = field(compare=False)


class EventQueue:
    """Events in time order; ties keep the order they were scheduled in (determinism)."""

    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self.now = 0.0

    def at(self, time: float, what: SimEvent) -> None:
        heapq.heappush(self._heap, Event(max(time, self.now), next(self._seq), what))

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
