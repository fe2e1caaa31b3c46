"""Per-learner speed profiles: hardware generation times seeded jitter."""

from __future__ import annotations

import numpy as np


class StepTimer:
    """Draws inner-step durations. Learner m is slow when m >= M·(1 − slow_fraction), so the
    slow generation is the same set of learners in every mode."""

    def __init__(
        self, *, learners: int, step_time_s: float, jitter: float, slow_fraction: float, slow_factor: float, seed: int
    ) -> None:
        first_slow = learners - round(learners * slow_fraction)
        self.slow = tuple(m >= first_slow for m in range(learners))
        """Which learners are on the slow generation (for reports; the draws use ``base_s``)."""
        self.base_s = [step_time_s * (slow_factor if slow else 1.0) for slow in self.slow]
        self.jitter = jitter
        self._rngs = [np.random.default_rng(s) for s in np.random.SeedSequence([seed, 0x57E9]).spawn(learners)]

    def slow_learners(self) -> tuple[int, ...]:
        return tuple(m for m, slow in enumerate(self.slow) if slow)

    def draw(self, learner: int) -> float:
        noise = float(self._rngs[learner].lognormal(0.0, self.jitter)) if self.jitter else 1.0
        return self.base_s[learner] * noise
