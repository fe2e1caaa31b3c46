"""What the synchronizer knows of one learner (:class:`LearnerRecord`), and the counts of the
learners the registry no longer lists (:class:`Forgotten`): the registry's rows, apart from its
rules (``core/sync_side/registry.py``)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ddiloco.core.shared.messages import Session
from ddiloco.core.sync_side.refusals import Refusals

RETIRED_BOOTS = 8
"""Replaced boots remembered per learner id (a checkpoint keeps them too)."""
ACCEPT_TIMES = 256
"""Recent acceptance times kept per learner (contributions per minute in status)."""
RATE_WINDOW_S = 60.0
"""The window of a learner's contributions per minute."""


@dataclass(slots=True)
class LearnerRecord:
    """What the synchronizer knows of one learner."""

    session: Session
    boot: str = ""
    alive: bool = True
    lease_until_s: float = 0.0
    last_seen_s: float = 0.0
    session_started_s: float = 0.0
    admitting_until_s: float | None = None
    """While the global state is on its way: the lease waits, up to this time."""
    dead_since_s: float | None = None
    starved: bool = False
    heard: bool = False
    """Heard from (a heartbeat or a contribution) since this session's join: an idle registration
    until then (``Registry.make_room``)."""
    step_time_s: float | None = None
    tokens_per_step: int = 0
    data_shard: int = 0
    accepted: int = 0
    rejected: int = 0
    registrations: int = 0
    last_seq: dict[int, int] = field(default_factory=dict)
    merged_through: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per fragment, the base version and the last step of the current session's newest merged
    contribution: a later Δ from that base or an older one carries it again (``repeated``)."""
    """Last accepted sequence number per fragment, in the current session."""
    accepted_at: dict[int, float] = field(default_factory=dict)
    """When a contribution of each fragment was last accepted, in the current session."""
    claims_since_s: float | None = None
    """Since when this boot's claims are bounded: the start of its first session at this
    synchronizer incarnation (None until it registered here). A learner keeps its progress across
    a re-registration, so its allowance follows the boot, not the session (``core/sync_side/claims.py``)."""
    claims_head_s: float = 0.0
    """How much earlier than :attr:`claims_since_s` its claims may have begun: the progress a learner
    may keep across a synchronizer restart, for the boot a restored checkpoint lists (``core/sync_side/claims.py``)."""
    steps_accepted: dict[int, int] = field(default_factory=dict)
    """Steps of the contributions accepted per fragment since :attr:`claims_since_s` (what they may
    claim is bounded by the wall time since: ``core/sync_side/claims.py``)."""
    compute_accepted: dict[int, float] = field(default_factory=dict)
    """Compute seconds accepted per fragment since :attr:`claims_since_s` (bounded the same way)."""
    refusals: Refusals = field(default_factory=Refusals)
    """Its refused contributions by reason, with the steps and tokens they held (``core/sync_side/refusals.py``)."""
    accept_times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=ACCEPT_TIMES))
    retired_boots: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RETIRED_BOOTS))

    def accepted_per_min(self, now: float) -> int:
        """Contributions accepted in the minute before ``now``; 0 once the learner is gone (its
        last minute would otherwise show a dead learner at work for a minute more)."""
        if not self.alive:
            return 0
        recent = [t for t in self.accept_times if now - t <= RATE_WINDOW_S]
        if len(recent) == ACCEPT_TIMES and now > recent[0]:  # more than we keep: scale the ones we have
            return round(len(recent) * RATE_WINDOW_S / (now - recent[0]))
        return len(recent)

    def claims_origin_s(self) -> float:
        """Since when its contributions' claims are bounded (:attr:`claims_since_s`, set by every registration)."""
        return (self.session_started_s if self.claims_since_s is None else self.claims_since_s) - self.claims_head_s

    def last_progress_s(self) -> float:
        """When this learner's work last reached the synchronizer (or its session began)."""
        return max(self.accepted_at.values(), default=self.session_started_s)


@dataclass(frozen=True, slots=True)
class Forgotten:
    """Counts of learners the registry no longer lists."""

    learners: int = 0
    accepted: int = 0
    rejected: int = 0
    registrations: int = 0
