"""Seeded failure traces: when each learner goes down and comes back.

A trace depends only on the seed and the fault settings, never on the mode, so a comparison
runs Decoupled DiLoCo and its baselines through exactly the same failures.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class CrashWindow:
    learner: int
    down_s: float
    up_s: float


class FailureTrace:
    """Per-learner outages: exponential times between failures, downtime uniform in [0.5, 1.5]·mean."""

    def __init__(self, *, learners: int, mtbf_s: float, downtime_s: float, horizon_s: float, seed: int) -> None:
        self.outages: list[list[CrashWindow]] = []
        streams = np.random.SeedSequence([seed, 0xFA11]).spawn(learners)
        for m, stream in enumerate(streams):
            rng = np.random.default_rng(stream)
            outages: list[CrashWindow] = []
            t = 0.0
            while mtbf_s > 0:
                t += float(rng.exponential(mtbf_s))
                if t >= horizon_s:
                    break
                up = t + downtime_s * float(rng.uniform(0.5, 1.5))
                outages.append(CrashWindow(m, t, up))
                t = up
            self.outages.append(outages)
        self._downs = [[o.down_s for o in outs] for outs in self.outages]

    def all(self) -> list[CrashWindow]:
        """Every outage, in time order."""
        return sorted((o for outs in self.outages for o in outs), key=lambda o: (o.down_s, o.learner))

    def outage_at(self, learner: int, t: float) -> CrashWindow | None:
        """The outage covering time ``t`` for ``learner``, if any."""
        i = bisect.bisect_right(self._downs[learner], t) - 1
        if i >= 0 and self.outages[learner][i].up_s > t:
            return self.outages[learner][i]
        return None

    def next_down(self, learner: int, t: float) -> float:
        """Start of the first outage strictly after ``t`` (inf if none)."""
        i = bisect.bisect_right(self._downs[learner], t)
        return self._downs[learner][i] if i < len(self._downs[learner]) else float("inf")
