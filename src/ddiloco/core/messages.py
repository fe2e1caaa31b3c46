"""What learners and the synchronizer say to each other.

Messages are small frozen dataclasses validated on construction, as in h11: a driver only
moves them (over a virtual link or protobuf, see ``runtime/wire.py``); it never interprets
them. What each state machine asks its driver to do is in :mod:`ddiloco.core.actions`.

Identity. A learner process is a *boot* (a fresh id every time the process starts); every
registration at the synchronizer opens a *session* (a number the synchronizer hands out);
the synchronizer itself runs as an *incarnation* (a fresh number every time it starts or
restarts from a checkpoint). Contributions carry their session, updates and the global
state carry their incarnation: that is how both sides recognise work measured from a state
that is no longer current.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


class RejectReason(enum.StrEnum):
    """Why a message was refused: a stable code for status pages, metrics and the wire."""

    MALFORMED = "malformed"
    UNKNOWN_LEARNER = "unknown_learner"
    """Not registered, or its lease expired: register again."""
    SUPERSEDED = "superseded"
    """Sent in an older session of a learner that has registered again since."""
    UNKNOWN_FRAGMENT = "unknown_fragment"
    BAD_CODEC = "bad_codec"
    BAD_SIZE = "bad_size"
    NON_FINITE = "non_finite"
    NORM_BOUND = "norm_bound"
    FUTURE_VERSION = "future_version"
    """Measured from a version this synchronizer never produced (it restarted from a checkpoint)."""
    STALE = "stale"
    DUPLICATE = "duplicate"
    FINISHED = "finished"
    """The run's budget is spent and its last merge done."""
    # Decided at the wire, before a message reaches the core:
    UNAUTHENTICATED = "unauthenticated"
    BAD_PROTOCOL_VERSION = "bad_protocol_version"
    CHUNK_ASSEMBLY = "chunk_assembly"
    TOO_LARGE = "too_large"
    LAYOUT_MISMATCH = "layout_mismatch"


class Rejected(Exception):
    """A message the synchronizer refuses (counted; global state untouched)."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = RejectReason(reason)
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Session:
    """One registration of a learner at one synchronizer incarnation.

    Numbers are handed out in order within an incarnation; a synchronizer that restarts is a
    new incarnation, so a session of the old one is recognised (and its learner told to
    register again) whatever its number. Incarnations are ids, not counters: they have no
    order (a restarted process draws a fresh random one).
    """

    incarnation: int
    number: int

    def __post_init__(self) -> None:
        if self.incarnation < 0 or self.number < 0:
            raise ValueError(f"bad session {self.incarnation}/{self.number}")

    def __str__(self) -> str:
        return f"{self.incarnation}/{self.number}"


@dataclass(frozen=True, slots=True)
class Progress:
    """Training a learner process has done since it booted (cumulative, so idempotent).

    A message that is lost, duplicated or reordered cannot make the synchronizer count the
    same tokens twice: it keeps the largest total it has seen per (learner, boot).
    """

    boot: str
    tokens: int = 0
    steps: int = 0

    def __post_init__(self) -> None:
        if not self.boot:
            raise ValueError("progress without boot id")
        if self.tokens < 0 or self.steps < 0:
            raise ValueError(f"negative progress: tokens={self.tokens} steps={self.steps}")


@dataclass(frozen=True, slots=True)
class Join:
    """Register (again): the synchronizer answers with the full global state."""

    learner_id: str
    boot: str

    def __post_init__(self) -> None:
        if not self.learner_id or not self.boot:
            raise ValueError("join without learner id or boot id")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Renews the lease of a session and reports progress."""

    learner_id: str
    session: Session
    progress: Progress

    def __post_init__(self) -> None:
        if not self.learner_id:
            raise ValueError("heartbeat without learner id")


@dataclass(frozen=True, slots=True)
class Leave:
    """A learner is done: the synchronizer stops waiting for it at once."""

    learner_id: str
    session: Session
    progress: Progress


@dataclass(frozen=True, slots=True)
class Contribution:
    """One learner's compressed outer gradient Δ = anchor − θ for one fragment."""

    learner_id: str
    session: Session
    """The registration whose anchors Δ was measured from."""
    fragment: int
    base_version: int
    """Version of the global fragment value the anchor holds."""
    seq: int
    """Per (session, fragment) sequence number; detects duplicates."""
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
    progress: Progress | None = None
    """The learner's cumulative progress, reported on the way (the budget)."""

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
    holds ``version-1`` *of the same incarnation* reconstructs ``version`` bit for bit.
    """

    fragment: int
    version: int
    codec: str
    payload: bytes
    incarnation: int = 0
    round_age_s: float = 0.0
    """How long before this update the round's first fresh contribution arrived: learners send
    their next contribution of the fragment H steps after that moment, all in phase."""

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
    incarnation: int = 0
    session: Session | None = None
    """The session this state opens for the learner that joined (None for a plain fetch)."""

    def versions(self) -> tuple[int, ...]:
        return tuple(f.version for f in self.fragments)


@dataclass(frozen=True, slots=True)
class StopNotice:
    """The run's budget is spent: flush what is unsent, leave, exit."""


Request = Join | Heartbeat | Contribution | Leave
"""What a learner sends and the synchronizer answers (one reply each)."""
