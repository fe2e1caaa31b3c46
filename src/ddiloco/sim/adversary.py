"""The adversary's timed faults: partitions, freezes and stalled uploads of learners, crashes of the
synchronizer, floods of abandoned joins.

Learner crashes come from :class:`~ddiloco.sim.faults.FailureTrace` (shared with the
baselines); the faults here exist to attack the protocol: a *partition* cuts a learner off
the synchronizer (both directions) for a while; a *freeze* keeps a learner's process alive
but silent (SIGSTOP) for longer than its lease, so it resumes holding a stale state; a
*synchronizer crash* loses everything after its last checkpoint; a *join flood* registers under
new ids, ``faults.join_flood_per_s`` a second, each join abandoned; a *stall* lets a learner's
uploads start and never finish. Each is a Poisson process
with a rate per virtual second, drawn from its own seeded stream, and only inside the
attack window (``until_s``: the safety phase of ``ddiloco simtest``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.settings.config import FaultConfig
from ddiloco.settings.fault_kinds import FaultKind


@dataclass(frozen=True, slots=True)
class Window:
    kind: FaultKind
    """PARTITION, FREEZE, STALL, SYNC_CRASH or JOIN_FLOOD."""
    target: int
    """Learner index, or synchronizer shard index for a synchronizer crash or a join flood."""
    start_s: float
    end_s: float


def plan_windows(faults: FaultConfig, *, learners: int, until_s: float, seed: int, shards: int = 1) -> list[Window]:
    """Every timed fault of a run, in time order (windows of one target never overlap)."""
    windows: list[Window] = []
    # A kind added later draws from streams after the others', so their windows stay what they were.
    streams = np.random.SeedSequence([seed, 0xADD5]).spawn(3 * learners + 2 * shards)
    for m in range(learners):
        windows += _poisson(FaultKind.PARTITION, m, faults.partition, faults.partition_s, until_s, streams[2 * m])
        windows += _poisson(FaultKind.FREEZE, m, faults.freeze, faults.freeze_s, until_s, streams[2 * m + 1])
    for shard in range(shards):
        windows += _poisson(FaultKind.SYNC_CRASH, shard, faults.sync_crash, faults.sync_downtime_s, until_s,
                            streams[2 * learners + shard])
        windows += _poisson(FaultKind.JOIN_FLOOD, shard, faults.join_flood, faults.join_flood_s, until_s,
                            streams[2 * learners + shards + shard])
    for m in range(learners):
        windows += _poisson(FaultKind.STALL, m, faults.stall, faults.stall_s, until_s,
                            streams[2 * learners + 2 * shards + m])
    return sorted(windows, key=lambda w: (w.start_s, w.kind, w.target))


def _poisson(kind: FaultKind, target: int, rate: float, mean_s: float, until_s: float,
             stream: np.random.SeedSequence) -> list[Window]:
    rng = np.random.default_rng(stream)
    out: list[Window] = []
    t = 0.0
    while rate > 0:
        t += float(rng.exponential(1.0 / rate))
        if t >= until_s:
            break
        end = t + mean_s * float(rng.uniform(0.5, 1.5))
        out.append(Window(kind, target, t, end))
        t = end
    return out
