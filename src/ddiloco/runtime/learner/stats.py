"""What a learner's runtime did so far: one type for the unsharded runtime (``runtime.py``) and the
sharded one (``fsdp/fsdp_runtime.py``), so the training loops that log it (``process.py``) need not know which."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """What the runtime did so far, for logs, tests and benchmarks."""

    steps: int
    contributions_sent: int
    contributions_dropped: int
    answers_lost: int
    """Contributions whose call got no answer although they were merged (the update named them)."""
    steps_unsent: int
    """Steps the last flush left out, per fragment still awaiting its update (``Learner.close``)."""
    rejected: dict[str, int]
    updates_applied: int
    updates_ignored: int
    gaps: int
    joins: int
    unreachable: int
    bytes_up: int
    step_overhead_s: float
    """Seconds spent inside ``step`` (the runtime's whole cost to the training loop)."""
