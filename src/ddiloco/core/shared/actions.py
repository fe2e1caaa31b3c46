"""What the two state machines ask their drivers to do, and the synchronizer's timer events.

A driver (the virtual cluster, the gRPC runtime) feeds a machine events and carries out the
actions it returns, nothing more: every protocol decision — who is refused and why, when
a round closes, when to register again, when the run stops — is taken by the machine.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ddiloco.core.shared.codecs import Codec
from ddiloco.core.shared.messages import (
    Contribution,
    FragmentUpdate,
    GlobalState,
    Heartbeat,
    Join,
    Leave,
    RejectReason,
    Request,
    Session,
)

# ---- synchronizer: events that are not messages ------------------------------------------


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: expire leases and grace windows due by now (see ``next_deadline``)."""


@dataclass(frozen=True, slots=True)
class SyncTimeObserved:
    """ξ_sync of one update, measured by the driver as ``core/shared/grace.py`` defines it (grace window input)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class StateDelivered:
    """The global state an ``Admitted`` reply carried reached its learner (``ok``), or its transfer
    failed: the learner's lease, which waited while the state was on its way, runs from now."""

    learner_id: str
    session: Session
    ok: bool = True


SyncEvent = Join | Heartbeat | Contribution | Leave | Tick | SyncTimeObserved | StateDelivered

# ---- synchronizer: actions ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """Reply to a Join: the learner's new session and the full global state."""

    learner_id: str
    state: GlobalState
    stop: bool = False
    data_shard: int = 0
    """The part of the training data this learner id trains on (kept while the registry knows it)."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """Reply to a heartbeat, contribution or leave that the synchronizer took."""

    learner_id: str
    request: Request
    stop: bool = False
    """The budget is spent: the learner should flush and leave."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Reply to a request the synchronizer refused (counted; global state untouched)."""

    learner_id: str
    request: Request
    reason: RejectReason
    detail: str


Reply = Admitted | Accepted | Refused


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Send ``update`` to every learner in ``recipients`` (the live ones when it was made)."""

    update: FragmentUpdate
    recipients: tuple[str, ...]


class CloseReason(enum.StrEnum):
    """Why a round closed."""

    ALL_LIVE = "all-live"
    """Every live learner contributed."""
    GRACE = "grace"
    """The grace window after the quorum ran out."""
    NO_GRACE = "no-grace"
    """Quorum reached and the measured slack left no grace window."""
    QUORUM = "quorum"
    """Strict quorum (synchronous DiLoCo): K contributions, merge at once."""
    DRAIN = "drain"
    """End of the run: whatever is pending, quorum or not."""


@dataclass(frozen=True, slots=True)
class MergedContribution:
    learner_id: str
    session: int
    seq: int
    tokens: int
    steps: int
    compute_s: float
    first_step: int
    base_version: int
    arrived_s: float


@dataclass(frozen=True, slots=True)
class RoundClosed:
    """Record of one merge: who counted, why the round closed, what quorum was required."""

    fragment: int
    version: int
    merged: tuple[MergedContribution, ...]
    quorum_required: int
    reason: CloseReason
    grace_s: float
    opened_at_s: float
    closed_at_s: float
    incarnation: int = 0
    alive: int = 0
    """Live learners when the round's quorum was decided (at close for all-live and strict rounds)."""
    coherence: float = 1.0
    """How aligned the merged outer gradients were (``accumulate.Accumulated.coherence``)."""

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.merged)

    @property
    def late(self) -> int:
        """Merged contributions measured from an older version than the one this round replaced."""
        return sum(c.base_version < self.version - 1 for c in self.merged)


@dataclass(frozen=True, slots=True)
class LogRound:
    """Append a merged round to the round log (the write-ahead log beside the checkpoints).

    The :class:`Broadcast` that follows carries the same update: a driver that keeps a log
    sends it only once this record is durable, so a version that any learner received is
    always one the synchronizer can restore (:meth:`Synchronizer.replay_round` after the
    latest checkpoint)."""

    update: FragmentUpdate
    plain: bool
    """The drain's plain step (no momentum), as :meth:`GlobalFragment.close` took it."""
    reached: tuple[tuple[str, int], ...] = ()
    """Per merged contribution, its learner and the last step it covered: a restart that replays the
    round moves the learners' data positions as the merge did (``data_position.py``)."""


@dataclass(frozen=True, slots=True)
class LeaseExpired:
    learner_id: str
    at_s: float


@dataclass(frozen=True, slots=True)
class LinkStarved:
    """A live learner's work has not reached the synchronizer for ``for_s``: its link cannot carry it."""

    learner_id: str
    for_s: float


@dataclass(frozen=True, slots=True)
class LearnersForgotten:
    """Dead long enough to be dropped from the registry: drivers drop what they keep per learner."""

    learner_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopLearners:
    """The budget is spent: tell these learners to flush and leave."""

    recipients: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    """The run is over: the last rounds are merged; drivers may shut down."""

    at_s: float


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write a checkpoint durably (atomically); a restart resumes from the latest one.

    ``state`` is :meth:`Synchronizer.checkpoint_meta`: everything but the fragments' tensors,
    which the driver copies a fragment at a time (:meth:`Synchronizer.fragment_state`) as it
    writes them, so a checkpoint never holds a copy of the whole model."""

    state: dict[str, Any]


SyncAction = (Reply | Broadcast | LogRound | RoundClosed | LeaseExpired | LinkStarved | LearnersForgotten | StopLearners | Finished
              | Checkpoint)

# ---- learner: actions ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Upload a contribution whose Δ is taken at the step boundary (the parameters move on with
    the next step): either already encoded (``encoded``: the core's one fused pass on the
    CPU with int4, or the codec on a GPU, run by a driver) or as a tensor that ``encode()``
    compresses — on another thread, so a real learner never runs the codec inside its
    training loop.
    """

    header: Contribution
    """Every field of the contribution but its payload, which is empty."""
    delta: torch.Tensor | None
    """Δ to compress, or None when ``encoded`` holds the payload."""
    codec: Codec
    shard: int = 0
    """The synchronizer shard that owns the fragment."""
    ready: Callable[[], object] | None = None
    """Waits until ``delta`` or ``encoded`` holds its values, when a driver compresses and
    copies Δ on an accelerator asynchronously (``runtime/learner/staging.py``); None: it
    already does."""
    encoded: np.ndarray | None = None
    """The payload's bytes, written by the core (``core/learner_side/flat.py``) or by a driver's device
    staging; None: ``delta`` is to encode."""

    @property
    def fragment(self) -> int:
        return self.header.fragment

    def encode(self) -> Contribution:
        """The contribution with its payload: compressed on the host (a Δ still on an accelerator
        is copied here, by the thread that encodes: a real learner's sender thread)."""
        if self.ready is not None:
            self.ready()
        if self.encoded is not None:
            return dataclasses.replace(self.header, payload=self.encoded.tobytes())
        assert self.delta is not None
        return dataclasses.replace(self.header, payload=self.codec.encode(self.delta.cpu()))


@dataclass(frozen=True, slots=True)
class SendJoin:
    message: Join
    shard: int = 0


@dataclass(frozen=True, slots=True)
class SendHeartbeat:
    message: Heartbeat
    shard: int = 0


@dataclass(frozen=True, slots=True)
class SendLeave:
    message: Leave
    shard: int = 0


@dataclass(frozen=True, slots=True)
class Fail:
    """A refusal the learner cannot recover from (wrong token, another protocol): stop with an error."""

    reason: RejectReason
    detail: str


@dataclass(frozen=True, slots=True)
class Starved:
    """None of this learner's work has reached the synchronizer for ``steps`` steps while it trained
    (its link cannot carry its contributions, or the synchronizer is unreachable): say so, once."""

    steps: int


@dataclass(frozen=True, slots=True)
class Behind:
    """This learner's link carries fewer contributions than the protocol makes: its last sends
    carried ``steps_per_send`` steps each on average instead of H (each waited for the one
    before it to be answered, see ``SendSchedule.held``). Its work still reaches the global
    model, at ``share`` of the protocol's pace. Said once, and again only after it caught up."""

    steps_per_send: float
    period: int
    step_s: float = 0.0
    """This learner's recent seconds per step (0: not measured yet)."""
    fastest_step_s: float = 0.0
    """Its fastest seconds per step over as many steps, earlier in the run."""
    cpu_bound: bool = False
    """Its steps slowed as its sends did (``link_watch.CPU_SLOW_AT``): the CPU, not the link, is short."""
    on_loopback: bool = False
    """The synchronizer is on this host: the link is loopback, which carries far more than any model's
    fragments, so a slow round trip is CPU time (the synchronizer's, the link helper's), never the link's."""

    @property
    def share(self) -> float:
        return self.period / self.steps_per_send

    @property
    def round_trip_s(self) -> float:
        """About how long each send waited for the one before: the steps it carried, at the recent step time."""
        return self.steps_per_send * self.step_s

    def describe(self) -> str:
        """The learner's warning: the link is blamed only when the learner's own steps kept their pace."""
        timing = (f"; a round trip of about {self.round_trip_s:.2f} s against steps of {1e3 * self.step_s:.0f} ms"
                  if self.step_s else "")
        carried = (f"this learner's sends carry {100 * self.share:.0f}% of the contributions the protocol makes "
                   f"(each carried {self.steps_per_send:.1f} steps, not H = {self.period}{timing})")
        if self.cpu_bound:
            return (f"{carried}: its steps slowed too, to {self.step_s / self.fastest_step_s:.1f}x its fastest "
                    f"({1e3 * self.fastest_step_s:.0f} ms), so the CPU is short, not necessarily the link: other "
                    "processes (the synchronizer, other learners) compete for this host's cores and its sends wait "
                    "for them as its steps do; give each process its own cores (train.threads, --threads)")
        if self.on_loopback:
            return (f"{carried}: the synchronizer is on this host, and loopback carries far more than this, so the "
                    "round trip is CPU time, not the link: the synchronizer (its merges) and this learner's link "
                    "helper wait for cores that the learners and other processes hold; its work reaches the global "
                    "model that much slower. Give each process its own cores (train.threads, --threads; fewer "
                    "learners per host) or send less often (a longer protocol.period)")
        return (f"{carried}: its steps keep their pace, so either its link is too slow for this model and period "
                "(ddiloco bandwidth says what a link needs) or the synchronizer's host is short of CPU (its merge "
                "time: `ddiloco status`, grace window ... sync ms); this learner cannot tell the two apart. Its work "
                "reaches the global model that much slower")


@dataclass(frozen=True, slots=True)
class Stale:
    """A contribution of ``fragment`` measured from version ``base_version`` was refused as stale
    although updates reach this learner in order (it holds ``held_version`` by now): its link's
    round trip spans more rounds than the synchronizer merges late work from (``core/shared/staleness.py``).
    Registering again would bring no fresher state (the state takes the same link), so the learner
    trains on, following the global model through its updates; its own work is not merged until
    the link is faster or the rounds slower. Said once, and again only after a contribution was
    accepted."""

    fragment: int
    base_version: int
    held_version: int
    period_fits: int = 0
    """The period H at which this round trip would span few enough rounds (0: not known)."""


class OutagePhase(enum.StrEnum):
    BEGAN = "began"
    """The first call to go unanswered after the shard answered (or before it ever did)."""
    ONGOING = "ongoing"
    """Still unreachable: a summary, every ``link_watch.OUTAGE_SUMMARY_S``."""
    ENDED = "ended"
    """The shard answered again."""


@dataclass(frozen=True, slots=True)
class Outage:
    """Synchronizer shard ``shard`` does not answer (or answers again): one action per change of
    state and a summary at intervals, never one per call, so a driver's log of a 30 s outage
    fits on a screen. ``for_s``: since the first call went unanswered; ``folded``: contributions
    that could not be delivered and went into the next ones; ``joined``: the learner held a state
    when it began (else it is still waiting for its first)."""

    shard: int
    phase: OutagePhase
    for_s: float = 0.0
    folded: int = 0
    joined: bool = True


LearnerAction = Send | SendJoin | SendHeartbeat | SendLeave | Fail | Starved | Behind | Stale | Outage
