"""What the synchronizer core reports about itself: immutable snapshots for other threads.

The core is touched by one thread only (its driver's). Status pages, metrics, logs and the
service's own bookkeeping read these values instead: frozen dataclasses of tuples and
fresh dicts, built on the core's thread and never changed afterwards, so any thread may
read one while the core moves on.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ddiloco.core.shared.messages import Contribution, Rejected, Request
from ddiloco.core.sync_side.refusals import Refusals
from ddiloco.core.sync_side.rounds import RoundPhase
from ddiloco.core.sync_side.run_state import RunPhase


class ShardMerge(enum.StrEnum):
    """How the values of one status field at every shard of a sharded synchronizer make the run's
    (``runtime/sharded.py``). A field's rule rides in its metadata (:func:`merged`); a field
    without one has the same value at every shard, and the first shard's is the run's."""

    FIRST = "first"
    SUM = "sum"
    """Each shard counts its own share."""
    MIN = "min"
    MAX = "max"
    ALL = "all"
    ANY = "any"
    AGREED = "agreed"
    """The shards' common value, ``"mixed"`` when they differ."""
    OWNED = "owned"
    """Each shard's own part (its fragments): the run's is all of them, by id."""
    BY_LEARNER = "by_learner"
    """Every shard lists the same learners: each learner's entries merged field by field."""


def merged(rule: ShardMerge, **kwargs: Any) -> Any:
    """A status field whose shards' values merge by ``rule`` (``kwargs`` as for :func:`dataclasses.field`)."""
    return field(metadata={"shards": rule}, **kwargs)


def merge_rule(f: Any) -> ShardMerge:
    """The :class:`ShardMerge` of a :func:`dataclasses.fields` entry."""
    return f.metadata.get("shards", ShardMerge.FIRST)


@dataclass(frozen=True, slots=True)
class LearnerStatus:
    """One learner as the synchronizer sees it. Every field travels in the Status reply under its
    own name (``runtime/status/wire_form.py`` names the two that do not)."""

    learner_id: str
    alive: bool = merged(ShardMerge.ALL)
    """Alive in the run: at every shard."""
    last_seen_s: float
    accepted: int = merged(ShardMerge.SUM)
    rejected: int = merged(ShardMerge.SUM)
    registrations: int
    step_time_s: float | None
    tokens: int
    accepted_per_min: int = merged(ShardMerge.SUM, default=0)
    """Contributions accepted in the last minute: a learner that trains but whose work does not
    reach the synchronizer shows 0 here."""
    link_starved: bool = merged(ShardMerge.ANY, default=False)
    """Alive, but nothing of its work has been accepted for several periods (its link cannot carry it)."""
    joining: bool = merged(ShardMerge.ANY, default=False)
    """Its global state is still on its way (its lease waits)."""
    data_position: int = merged(ShardMerge.MIN, default=0)
    """The batch at which its data resumes if it starts again (``core/sync_side/data_position.py``): in a
    sharded run, the position every shard's fragments have reached."""
    refused: dict[str, int] = merged(ShardMerge.SUM, default_factory=dict)
    """Its contributions refused, by reason (``core/sync_side/refusals.py`` says which reasons are honest work lost)."""
    refused_steps: dict[str, int] = merged(ShardMerge.SUM, default_factory=dict)
    refused_tokens: dict[str, int] = merged(ShardMerge.SUM, default_factory=dict)
    """The steps and tokens those refused contributions held, by reason."""


@dataclass(frozen=True, slots=True)
class SyncStatus:
    """A snapshot of what the synchronizer knows, for status pages, metrics and tests.

    The Status reply carries every field under its own name (``runtime/status/wire_form.py``, which
    names the exceptions), and a sharded run's status merges each by its :class:`ShardMerge`:
    a new field here needs its field in ``StatusReply`` (``runtime/proto/ddiloco.proto``), and
    nothing else."""

    incarnation: int
    phase: RunPhase = merged(ShardMerge.AGREED)
    fragments: tuple[int, ...] = merged(ShardMerge.OWNED)
    """The fragments this synchronizer (shard) owns; ``versions`` and ``round_phases`` follow them."""
    versions: tuple[int, ...] = merged(ShardMerge.OWNED)
    round_phases: tuple[RoundPhase, ...] = merged(ShardMerge.OWNED)
    learners: tuple[LearnerStatus, ...] = merged(ShardMerge.BY_LEARNER)
    quorum: int
    effective_quorum: int
    grace_window_s: float
    grace_quorum_s: float
    grace_sync_s: float
    rounds_closed: dict[str, int] = merged(ShardMerge.SUM)
    rejections: dict[str, int] = merged(ShardMerge.SUM)
    tokens: int = merged(ShardMerge.MIN)
    """Every shard counts the same progress reports: the run's is the slowest shard to hear."""
    token_budget: int
    """0: no token budget."""
    tokens_left: int = merged(ShardMerge.MAX)
    time_budget_s: float
    """0: no time budget."""
    elapsed_s: float = merged(ShardMerge.MIN)
    """Seconds the run's clock has counted (from the first join, across restarts; each shard's
    clock starts at its own first join)."""
    time_left_s: float = merged(ShardMerge.MAX)
    pending_tokens: int = merged(ShardMerge.SUM)
    longest_pause_s: float = merged(ShardMerge.MAX)
    started_at_s: float | None
    """When the run's first learner joined (this incarnation's clock), None before. Not sent."""
    learners_forgotten: int = 0
    """Learners dropped from the registry after ``protocol.forget_after_s`` dead (not in ``learners``)."""
    progress_clipped: int = merged(ShardMerge.SUM, default=0)
    """Progress reports that claimed more work than the run's configuration makes possible."""
    weights_capped: int = merged(ShardMerge.SUM, default=0)
    """Contributions whose merge weight was capped (``protocol.max_weight_ratio``)."""
    claims_clipped: dict[str, int] = merged(ShardMerge.SUM, default_factory=dict)
    """Contributions whose claimed times were clipped to what the clock allows, by
    :class:`~ddiloco.core.sync_side.claims.ClipReason`."""
    link_starved_episodes: int = merged(ShardMerge.SUM, default=0)
    """Times a live learner went several periods without an accepted contribution."""
    norms_clipped: int = merged(ShardMerge.SUM, default=0)
    """Contributions let in with their Δ scaled down to the norm bound (``core/sync_side/norm_bound.py``)."""
    refused_steps: dict[str, int] = merged(ShardMerge.SUM, default_factory=dict)
    refused_tokens: dict[str, int] = merged(ShardMerge.SUM, default_factory=dict)
    """Steps and tokens of every refused contribution over the run (forgotten learners' too), by reason."""
    honest_refused_steps: int = merged(ShardMerge.SUM, default=0)
    honest_refused_tokens: int = merged(ShardMerge.SUM, default=0)
    """Of those, the honest work thrown away (``RefusalKind.HONEST`` reasons): goodput's loss to refusals."""
    idle_registrations: int = merged(ShardMerge.SUM, default=0)
    """Leases held by registrations never heard from since their join, of ids that never trained here:
    an abandoned join, or a flood of them (``Registry.idle``)."""
    oldest_idle_registration_s: float = merged(ShardMerge.MAX, default=0.0)
    """How long the oldest of those has held its lease (0: none)."""


@dataclass(frozen=True, slots=True)
class CoreView:
    """The few facts drivers need after every event, published by the core's thread."""

    phase: RunPhase
    versions: tuple[int, ...]
    alive: int
    tokens: int

    @property
    def finished(self) -> bool:
        return self.phase is RunPhase.FINISHED

    @property
    def stopping(self) -> bool:
        return self.phase in (RunPhase.STOPPING, RunPhase.FINISHED)


@dataclass(slots=True)
class SyncCounters:
    """What the synchronizer counts about its own decisions, kept across restarts in its checkpoint."""

    rejections: Counter[str] = field(default_factory=Counter)
    rounds_closed: Counter[str] = field(default_factory=Counter)
    longest_pause_s: float = 0.0
    """The longest time between two merges while the run was running."""
    weights_capped: int = 0
    claims_clipped: Counter[str] = field(default_factory=Counter)
    refusals: Refusals = field(default_factory=Refusals)
    """Every refused contribution, over the run."""
    norms_clipped: int = 0
    last_merge_s: float | None = None
    """Not restored: a restarted synchronizer's first merge starts a new pause count."""

    def refused(self, request: Request, err: Rejected) -> None:
        """A request refused: counted, and a contribution's lost work in the ledger (``core/sync_side/refusals.py``)."""
        self.rejections[str(err.reason)] += 1
        if isinstance(request, Contribution):
            self.refusals.add(err.reason, *err.work_lost(request))

    def merged(self, reason: str, now: float, running: bool) -> None:
        """A round closed at ``now``."""
        self.rounds_closed[reason] += 1
        if self.last_merge_s is not None and running:
            self.longest_pause_s = max(self.longest_pause_s, now - self.last_merge_s)
        self.last_merge_s = now

    def state_dict(self) -> dict[str, Any]:
        return {"rejections": dict(self.rejections), "rounds_closed": dict(self.rounds_closed),
                "longest_pause_s": self.longest_pause_s, "weights_capped": self.weights_capped,
                "claims_clipped": dict(self.claims_clipped), "refusals": self.refusals.state_dict(),
                "norms_clipped": self.norms_clipped}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "SyncCounters":
        return cls(Counter(state["rejections"]), Counter(state["rounds_closed"]),
                   float(state.get("longest_pause_s", 0.0)), int(state.get("weights_capped", 0)),
                   Counter({str(k): int(v) for k, v in state.get("claims_clipped", {}).items()}),
                   Refusals.from_state(state.get("refusals")), int(state.get("norms_clipped", 0)))
