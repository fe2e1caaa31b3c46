"""What happened in a virtual run, in order: failures, restarts, (re)joins and merges.

The cluster and its learner nodes append an entry when the failure trace strikes or a
learner's core reports a state change; nothing here decides anything. The closing summary
(:class:`RunEvents`, ``summary.json``'s ``events``) and the live view's counters are
computed from these entries, so what the user reads is what the run did.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


class Happening(enum.StrEnum):
    FAILURE = "failure"
    """A learner process died (the failure trace)."""
    RESTART = "restart"
    """The failed process came back, fresh: it must join again before it trains."""
    JOINED = "joined"
    """A learner holds the global state for the first time."""
    REJOINED = "rejoined"
    """A learner holds the global state again: after a restart, or after losing its session."""
    MERGE = "merge"
    """A round closed: one fragment of the global model advanced."""


@dataclass(frozen=True, slots=True)
class Entry:
    time_s: float
    kind: Happening
    learner: int | None = None


@dataclass(frozen=True, slots=True)
class RunEvents:
    """The closing summary's figures (``summary.json``'s ``events``)."""

    failures: int
    rejoins: int
    merges: int
    longest_pause_s: float
    """Longest virtual time without any merge, from the first merge to the end of the run
    (before the first merge no round could have closed yet: that is the first period, not a pause)."""
    longest_pause_from_s: float
    slow_learners: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "slow_learners": list(self.slow_learners)}


@dataclass(slots=True)
class Timeline:
    entries: list[Entry] = field(default_factory=list)
    counts: Counter[Happening] = field(default_factory=Counter)
    by_learner: Counter[tuple[Happening, int]] = field(default_factory=Counter)
    last_s: dict[tuple[Happening, int], float] = field(default_factory=dict)

    def add(self, time_s: float, kind: Happening, learner: int | None = None) -> None:
        self.entries.append(Entry(time_s, kind, learner))
        self.counts[kind] += 1
        if learner is not None:
            self.by_learner[(kind, learner)] += 1
            self.last_s[(kind, learner)] = time_s

    def of(self, kind: Happening, learner: int) -> int:
        """How many times ``kind`` happened to ``learner``."""
        return self.by_learner[(kind, learner)]

    def last(self, kind: Happening, learner: int) -> float | None:
        """When ``kind`` last happened to ``learner`` (None: never)."""
        return self.last_s.get((kind, learner))

    def summarize(self, end_s: float, slow_learners: tuple[int, ...]) -> RunEvents:
        merges = [e.time_s for e in self.entries if e.kind is Happening.MERGE]
        gaps = list(zip(merges, [*merges[1:], end_s])) if merges else [(0.0, end_s)]
        pause_from_s, pause_to_s = max(gaps, key=lambda gap: gap[1] - gap[0])
        pause_s = pause_to_s - pause_from_s
        return RunEvents(
            failures=self.counts[Happening.FAILURE],
            rejoins=self.counts[Happening.REJOINED],
            merges=len(merges),
            longest_pause_s=round(pause_s, 3),
            longest_pause_from_s=round(pause_from_s, 3),
            slow_learners=slow_learners,
        )
