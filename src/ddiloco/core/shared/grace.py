"""Minimum quorum and the adaptive grace window (docs/concepts.md, "Grace window").

Once K learners have contributed to a round, the synchronizer waits a little longer for
stragglers — but only as long as the fast learners would not notice: a fragment is in
flight for τ inner steps before a learner misses its new value, so the slack is
τ·ξ_step − (ξ_quorum + ξ_sync) and the window is g = min(γ·max(0, slack), g_max).

ξ_sync, one definition for both drivers: from the event that closes a round until its update
has left for the last of its recipients — the merge, the round log's wait where there is
one, and the send. A driver reports it per update (``SyncTimeObserved``); no observation
when no recipient listens. Where the drivers' worlds differ:

- the gRPC runtime (``runtime/sync/core_host.py``) stops the clock when the last
  recipient's stream has written the update (gRPC's flow control holds a write while the
  learner's link is behind, so a slow link shows); the core's compute is wall time;
- the virtual cluster (``sim/sync_node.py``) stops it when the update has left for the last
  recipient over its virtual link: its transfer counts (a slow link shows), its latency does
  not, as on a real stream, whose write returns long before the bytes arrive. A merge takes no
  virtual time there, and no round log is waited for. (It stopped the clock at the arrival
  until issue 42's long-link measurement: one far learner's latency then counted in every
  round's ξ_sync and closed every round's grace window for the near learners.)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class MovingAverage:
    """Exponential moving average; ``None`` until the first sample."""

    weight: float = 0.2
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


@dataclass(slots=True)
class GraceWindow:
    """Measures the timings that size the grace window and computes its length."""

    overlap_steps: int
    gamma: float
    max_s: float
    quorum_s: MovingAverage = field(default_factory=MovingAverage)
    sync_s: MovingAverage = field(default_factory=MovingAverage)

    def observe_quorum(self, seconds: float) -> None:
        """Time from a round's first contribution to reaching quorum."""
        self.quorum_s.add(max(0.0, seconds))

    def observe_sync(self, seconds: float) -> None:
        """ξ_sync of one update, as the module's docstring defines it (measured by the driver)."""
        self.sync_s.add(max(0.0, seconds))

    def length_s(self, step_time_s: float) -> float:
        """g for learners whose (fastest) inner step takes ``step_time_s`` seconds."""
        slack = self.overlap_steps * step_time_s - (self.quorum_s.get() + self.sync_s.get())
        return min(self.gamma * max(0.0, slack), self.max_s)


def effective_quorum(quorum: int, alive: int, *, strict: bool) -> int:
    """K, lowered to the number of live learners unless the quorum is strict.

    A learner whose lease expired is no longer waited for; with ``strict`` (synchronous
    DiLoCo) everyone waits for K contributions whatever happens.
    """
    return quorum if strict else max(1, min(quorum, alive))
