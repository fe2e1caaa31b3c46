"""What happened in a virtual run, in order: failures, restarts, (re)joins, merges, rollbacks.

The cluster and its learner nodes append an entry when the failure trace strikes or a
learner's core reports a state change; the data-parallel baselines append their steps,
the outages of their replicas and their restarts from a checkpoint. Nothing here decides
anything. The closing summary (:class:`RunEvents`, ``summary.json``'s ``events``), the
metrics rows' counters, the live view, the "what happened" panels and the marks on
``plot.png`` are all computed from these entries, so what the user reads is what the run did.
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
    """The global model advanced: a round closed (one fragment, DiLoCo) or a synchronous step was applied (data parallel)."""


@dataclass(frozen=True, slots=True)
class Rollback:
    """Non-elastic data parallel: a failure stopped the job, which restarted from its last checkpoint."""

    failed_at_s: float
    resumed_at_s: float
    """When every replica was back and the checkpoint loaded: training went on from here."""
    checkpoint_s: float
    """When the checkpoint it went back to was taken."""
    lost_steps: int
    """Steps trained since that checkpoint, thrown away."""


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
    outages: tuple[tuple[int, float, float | None], ...] = ()
    """(learner, down at, back at) of every failure in time order; back at None: still down at the end."""
    rejoined_at: tuple[tuple[int, float], ...] = ()
    """(learner, when) of every rejoin."""
    rollbacks: tuple[Rollback, ...] = ()
    reconfigurations: int = 0
    """Elastic data parallel: pauses to let a replica leave or return."""
    batches_retrained: int = 0
    """Batches a restarted learner trained again (it resumed at its data_position: ``sim/data_stream.py``)."""
    batches_skipped: int = 0
    """Batches no process of a learner trained although a later one went beyond them (0 unless broken)."""
    batches_merged_twice: int = 0
    """Batches whose work one fragment merged twice, most per learner, summed (about one period per restart)."""

    def counters(self) -> dict[str, int]:
        """The counts a metrics row carries (and the live view and the final table show)."""
        return {"failures": self.failures, "rejoins": self.rejoins, "merges": self.merges}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "slow_learners": list(self.slow_learners),
                "outages": [list(o) for o in self.outages], "rejoined_at": [list(r) for r in self.rejoined_at],
                "rollbacks": [asdict(r) for r in self.rollbacks]}


@dataclass(slots=True)
class Timeline:
    entries: list[Entry] = field(default_factory=list)
    counts: Counter[Happening] = field(default_factory=Counter)
    by_learner: Counter[tuple[Happening, int]] = field(default_factory=Counter)
    last_s: dict[tuple[Happening, int], float] = field(default_factory=dict)
    rollbacks: list[Rollback] = field(default_factory=list)
    reconfigurations: int = 0

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
            outages=self._outages(),
            rejoined_at=tuple((e.learner, round(e.time_s, 3)) for e in self.entries
                              if e.kind is Happening.REJOINED and e.learner is not None),
            rollbacks=tuple(self.rollbacks),
            reconfigurations=self.reconfigurations,
        )

    def _outages(self) -> tuple[tuple[int, float, float | None], ...]:
        """Each FAILURE paired with the same learner's next RESTART."""
        down: dict[int, float] = {}
        spans: list[tuple[int, float, float | None]] = []
        for e in sorted(self.entries, key=lambda e: e.time_s):
            if e.learner is None:
                continue
            if e.kind is Happening.FAILURE:
                down[e.learner] = e.time_s
            elif e.kind is Happening.RESTART and e.learner in down:
                spans.append((e.learner, round(down.pop(e.learner), 3), round(e.time_s, 3)))
        spans += [(m, round(t, 3), None) for m, t in down.items()]
        return tuple(sorted(spans, key=lambda span: (span[1], span[0])))
