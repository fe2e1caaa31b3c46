"""What learners and the synchronizer say to each other, and what the core asks drivers to do.

Messages are small frozen dataclasses validated on construction, as in h11: a driver only
moves them (over a virtual link or protobuf); it never interprets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Contribution:
    """One learner's compressed outer gradient Δ = anchor − θ for one fragment."""

    learner_id: str
    fragment: int
    base_version: int
    """Version of the global fragment value the anchor holds."""
    seq: int
    """Per (learner, fragment) sequence number since registration; detects duplicates."""
    tokens: int
    steps: int
    compute_s: float
    """Seconds of inner-step compute behind this contribution (for goodput accounting)."""
    step_time_s: float
    """The learner's recent inner-step time; feeds the adaptive grace window."""
    codec: str
    payload: bytes
    first_step: int = 0
    """Learner clock of the first inner step covered (lets drivers credit the steps when merged)."""

    def __post_init__(self) -> None:
        if not self.learner_id:
            raise ValueError("contribution without learner id")
        if self.fragment < 0 or self.base_version < 0 or self.seq < 0:
            raise ValueError("negative fragment, version or seq")
        if self.tokens < 0 or self.steps < 1:
            raise ValueError(f"bad counters: tokens={self.tokens} steps={self.steps}")
        if not (math.isfinite(self.compute_s) and math.isfinite(self.step_time_s)):
            raise ValueError("non-finite timing")

    @property
    def last_step(self) -> int:
        return self.first_step + self.steps - 1


@dataclass(frozen=True, slots=True)
class FragmentUpdate:
    """A compressed outer update that moves fragment ``fragment`` from ``version-1`` to ``version``.

    The synchronizer's canonical value is the sum of dequantized updates, so a learner that
    holds ``version-1`` reconstructs ``version`` bit for bit.
    """

    fragment: int
    version: int
    codec: str
    payload: bytes

    def __post_init__(self) -> None:
        if self.fragment < 0 or self.version < 1:
            raise ValueError(f"bad update header: fragment={self.fragment} version={self.version}")


@dataclass(frozen=True, slots=True)
class FragmentValue:
    """Full fp32 value of one global fragment, for a (re)joining learner."""

    fragment: int
    version: int
    values: torch.Tensor


@dataclass(frozen=True, slots=True)
class GlobalState:
    """Every fragment's current value and version: what a (re)joining learner adopts."""

    fragments: tuple[FragmentValue, ...]

    def versions(self) -> tuple[int, ...]:
        return tuple(f.version for f in self.fragments)


# ---- actions the synchronizer returns to its driver -------------------------------------


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Send ``update`` to every learner in ``recipients`` (the live ones when it was made)."""

    update: FragmentUpdate
    recipients: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MergedContribution:
    learner_id: str
    seq: int
    tokens: int
    steps: int
    compute_s: float
    first_step: int
    base_version: int


@dataclass(frozen=True, slots=True)
class RoundClosed:
    """Record of one merge: who counted, why the round closed, what quorum was required."""

    fragment: int
    version: int
    merged: tuple[MergedContribution, ...]
    quorum_required: int
    reason: str
    """Why it closed: all-live, grace (window expired), no-grace (g = 0) or quorum (strict K)."""
    grace_s: float
    opened_at_s: float
    closed_at_s: float

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.merged)


@dataclass(frozen=True, slots=True)
class LeaseExpired:
    learner_id: str
    at_s: float


Action = Broadcast | RoundClosed | LeaseExpired


class Rejected(Exception):
    """A message the synchronizer refuses; ``reason`` is a stable code for status and metrics."""

    REASONS = (
        "malformed",
        "unknown_learner",
        "unknown_fragment",
        "bad_codec",
        "bad_size",
        "non_finite",
        "norm_bound",
        "future_version",
        "stale",
        "duplicate",
    )

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
