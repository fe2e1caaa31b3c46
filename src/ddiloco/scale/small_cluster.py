"""Goodput and uptime of a few whole learners that crash and come back: the small-scale
counterpart of :func:`~ddiloco.scale.goodput_model.simulate_cell`, in closed form, in the
terms of the virtual cluster, so the two can be checked against each other
(benchmarks/bench_crosscheck.py, docs/goodput.md "Cross-checks")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddiloco.core.shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SmallClusterPrediction:
    goodput: float
    uptime: float
    availability: float
    """Share of time one learner is up (not down, not rejoining)."""


def predict_small_cluster(*, learners: int, mtbf_s: float, downtime_s: float, step_s: float, inner_steps: int,
                          rejoin_s: float = 0.0, quorum: int = 1) -> SmallClusterPrediction:
    """Long-run goodput and uptime of M whole learners that crash and come back.

    This is the small-scale counterpart of :func:`simulate_cell`, in the terms of the virtual
    cluster (``ddiloco.sim.virtual_cluster``): each learner fails after an exponential up time of mean
    ``mtbf_s``, stays down ``downtime_s`` on average, spends ``rejoin_s`` fetching the global
    state, then trains again. A step is useful once the fragment contributions carrying it are
    merged; with each fragment sent once per H steps (any P <= H, staggered offsets), a crash
    loses the partial step and every fragment's progress since its last send, (H - 1) / 2
    steps on average (a learner that dies after n < H steps keeps n(n + 1) / 2H of them). The
    global model advances while at least ``quorum`` learners are up. Steady state: the
    virtual cluster flushes every live learner at the end of a run, and a finite run of a few
    hundred steps expects this value to within half a point (it starts with every learner
    up); benchmarks/bench_crosscheck.py compares the two (docs/goodput.md, "Cross-checks").
    """
    if learners < 1:
        raise ConfigError(f"learners must be >= 1, got {learners}")
    if not 1 <= quorum <= learners:
        raise ConfigError(f"quorum must be in [1, {learners}], got {quorum}")
    if inner_steps < 1:
        raise ConfigError(f"inner_steps must be >= 1, got {inner_steps}")
    for name, value in {"downtime_s": downtime_s, "rejoin_s": rejoin_s}.items():
        if not value >= 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    if not step_s > 0:
        raise ConfigError(f"step_s must be positive, got {step_s}")
    if not mtbf_s > 0:
        raise ConfigError(f"mtbf_s must be positive (math.inf for no failures), got {mtbf_s}")
    if math.isinf(mtbf_s):
        return SmallClusterPrediction(1.0, 1.0, 1.0)
    h = inner_steps
    q = math.exp(-step_s / mtbf_s)  # P(one more step completes before the crash)
    mean_steps = q / (1.0 - q)
    k = np.arange(max(h - 1, 0))
    p_k = (1.0 - q) * q**k
    short_run_fix = float(np.sum(p_k * (k * (k + 1) / (2.0 * h) - k + (h - 1) / 2.0)))
    useful_steps = mean_steps - (h - 1) / 2.0 + short_run_fix
    cycle_s = mtbf_s + downtime_s + rejoin_s
    goodput = step_s * useful_steps / cycle_s
    availability = mtbf_s / cycle_s
    uptime = sum(math.comb(learners, j) * availability**j * (1 - availability) ** (learners - j)
                 for j in range(quorum, learners + 1))
    return SmallClusterPrediction(goodput, uptime, availability)
