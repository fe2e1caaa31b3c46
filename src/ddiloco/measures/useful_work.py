"""Goodput and uptime, from what actually happened in a run
(docs/design.md, "Goodput and uptime, as measured").

Every finished inner step is recorded with its virtual start and end. A step is *credited*
once its work reaches the global model — for Decoupled DiLoCo when the contribution that
carries it is merged (each fragment credits its share of the parameters), for data parallel
when the step is committed (at once if elastic, at the next checkpoint if not). Work lost to
a crash or a rollback is never credited.

- goodput = credited chip-time / provisioned chip-time (every learner, from its arrival: the
  start, or later for a late learner, to the end of the run);
- uptime = share of wall time covered by at least one credited step: the global model advances.

Both drivers derive model uptime from intervals of work that reached the global model with
:func:`covered_s`, and credit a merged contribution with its fragment's :func:`fragment_shares`;
:class:`Accounting` is the virtual cluster's record of every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def covered_s(intervals: Iterable[tuple[float, float]], *, reach: float = float("-inf")) -> tuple[float, float]:
    """Seconds covered by the union of ``intervals`` (past ``reach``), and how far they reach."""
    covered = 0.0
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            covered += end - start
            reach = end
    return covered, reach


def fragment_shares(numels: Iterable[int]) -> list[float]:
    """Each fragment's share of the parameters: what a merged contribution to it credits."""
    numels = list(numels)
    total = sum(numels)
    return [n / total for n in numels]



class Accounting:
    def __init__(self, arrivals_s: list[float]) -> None:
        """``arrivals_s``: when each learner's chip joins the job (0 for all but late learners)."""
        learners = len(arrivals_s)
        self._arrivals_s = arrivals_s
        self._start: list[list[float]] = [[] for _ in range(learners)]
        self._end: list[list[float]] = [[] for _ in range(learners)]
        self._busy: list[list[float]] = [[] for _ in range(learners)]
        self._credit: list[list[float]] = [[] for _ in range(learners)]

    def add_step(self, learner: int, step: int, start_s: float, end_s: float, busy_s: float | None = None) -> None:
        """Record learner's ``step``-th finished step (1-based, contiguous per learner).

        ``busy_s`` is the chip's own compute inside [start_s, end_s] (defaults to all of it);
        time spent waiting for others or for the network is provisioned but not useful.
        """
        if step != len(self._start[learner]) + 1:
            raise ValueError(f"learner {learner}: step {step} recorded out of order")
        self._start[learner].append(start_s)
        self._end[learner].append(end_s)
        self._busy[learner].append(end_s - start_s if busy_s is None else busy_s)
        self._credit[learner].append(0.0)

    def credit(self, learner: int, first_step: int, last_step: int, fraction: float) -> None:
        """Credit ``fraction`` of steps first_step..last_step (inclusive) of ``learner``."""
        credits = self._credit[learner]
        for i in range(max(first_step, 1) - 1, min(last_step, len(credits))):
            credits[i] = min(1.0, credits[i] + fraction)

    def steps(self, learner: int) -> int:
        return len(self._start[learner])

    def goodput(self, wall_s: float) -> float:
        """Credited compute of the steps finished by ``wall_s``, over the chip-time provisioned
        by then (M·``wall_s`` when every learner was there from the start).

        Asked again after the run, it says how much of the work done up to ``wall_s`` ended
        up in the model (credits arrive later than the work: at merges, at checkpoints).
        """
        if wall_s <= 0:
            return 0.0
        useful = sum(
            float(np.dot(np.asarray(b), np.asarray(c) * (np.asarray(e) <= wall_s)))
            for b, c, e in zip(self._busy, self._credit, self._end)
            if b
        )
        provisioned = sum(max(0.0, wall_s - arrived) for arrived in self._arrivals_s)
        return useful / provisioned if provisioned > 0 else 0.0

    def uptime(self, wall_s: float) -> float:
        """Share of [0, ``wall_s``] covered by at least one credited step."""
        covered, _ = covered_s(
            ((s, min(e, wall_s)) for starts, ends, credits in zip(self._start, self._end, self._credit)
             for s, e, c in zip(starts, ends, credits) if c > 0 and s < wall_s),
            reach=0.0,
        )
        return min(1.0, covered / wall_s) if wall_s > 0 else 0.0
