"""What learners and the synchronizer say to each other.

Messages are small frozen dataclasses validated on construction, as in h11: a driver only
moves them (over a virtual link or protobuf, see ``runtime/wire.py``); it never interprets
them. What each state machine asks its driver to do is in :mod:`ddiloco.core.shared.actions`.

Identity. A learner process is a *boot* (a fresh id every time the process starts); every
registration at the synchronizer opens a *session* (a number the synchronizer hands out);
the synchronizer itself runs as an *incarnation* (a fresh number every time it starts or
restarts from a checkpoint). Contributions carry their session, updates and the global
state carry their incarnation: that is how both sides recognise work measured from a state
that is no longer current.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ddiloco.core.shared.slices import SliceSpec

# Bounds on what a message may claim. Anything beyond them comes from a bug or a hostile
# member, and would otherwise reach counters, ledgers, checkpoints and status replies.
MAX_ID_CHARS = 128
"""Learner and boot ids: printable ASCII without spaces, at most this long."""
MAX_COUNT = 2**48
"""Tokens and steps a message may claim (cumulative or per contribution): far beyond any run,
and sums of many of them still fit the wire's 64-bit integers."""
MAX_TOKENS_PER_STEP = 2**24
"""Tokens one inner step may claim (16M: a very large global batch)."""
MAX_INDEX = 2**62
"""Sequence numbers, versions, fragment indices."""
MAX_STEP_TIME_S = 3600.0
"""A step time the grace window may learn from."""
MAX_COMPUTE_S = 1e7
"""Compute seconds one contribution may claim (goodput accounting)."""


def check_id(value: str, what: str) -> None:
    """ValueError unless ``value`` is a plausible id (it becomes a key of registries and ledgers)."""
    if not value or len(value) > MAX_ID_CHARS or not (value.isascii() and value.isprintable()) or " " in value:
        raise ValueError(f"{what} must be 1..{MAX_ID_CHARS} printable ASCII characters without spaces, "
                         f"got {value[:40]!r}{'...' if len(value) > 40 else ''}")


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
    REPEATED = "repeated"
    """Measured from the anchor of the session's previous contribution of the fragment, which a round
    merged already: it carries that work again (a learner folds a contribution whose reply was lost
    into its next one, not knowing it arrived). Its steps since that contribution are lost."""
    FINISHED = "finished"
    """The run's budget is spent and its last merge done."""
    REPLACED = "replaced"
    """Another process (a later boot) registered under this learner id: this one must stop."""
    IMPLAUSIBLE = "implausible"
    """Claims more work than the run's configuration makes possible since the learner's last report."""
    REGISTRY_FULL = "registry_full"
    """As many learners hold a lease as the synchronizer admits: try again later."""
    # Decided at the wire, before a message reaches the core:
    UNAUTHENTICATED = "unauthenticated"
    BAD_PROTOCOL_VERSION = "bad_protocol_version"
    CHUNK_ASSEMBLY = "chunk_assembly"
    TOO_LARGE = "too_large"
    LAYOUT_MISMATCH = "layout_mismatch"
    TIMED_OUT = "timed_out"
    """A stream that stalled past its deadline (an upload or a download), or too many at once."""
    BUSY = "busy"
    """Too many calls at once from this peer or in all: try again later."""
    SLICE_MISMATCH = "slice_mismatch"
    """The slices of one sharded learner's contribution disagree (counters, base version, layout)."""
    SLICE_INCOMPLETE = "slice_incomplete"
    """Part of a sharded learner's contribution whose other slices did not come before its round closed."""
    UNRECOGNIZED = "unrecognized"
    """A code this learner does not know (a newer synchronizer's): the refused message is dropped."""

    @classmethod
    def parse(cls, text: str) -> "RejectReason":
        """The reason a code on the wire names (``UNRECOGNIZED`` for one this version does not know)."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNRECOGNIZED


class Rejected(Exception):
    """A message the synchronizer refuses (counted; global state untouched)."""

    def __init__(self, reason: RejectReason, detail: str, *, lost: tuple[int, int] | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = RejectReason(reason)
        self.detail = detail
        self.lost = lost
        """The (steps, tokens) of a refused contribution's work thrown away, where not all of it is
        (``repeated``: its part merged already is not); None: all of it."""

    def work_lost(self, c: "Contribution") -> tuple[int, int]:
        """The (steps, tokens) this refusal of ``c`` throws away."""
        return self.lost if self.lost is not None else (c.steps, c.tokens)


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
        check_id(self.boot, "boot id")
        if not (0 <= self.tokens <= MAX_COUNT and 0 <= self.steps <= MAX_COUNT):
            raise ValueError(f"progress out of range: tokens={self.tokens} steps={self.steps}")
        if self.tokens > self.steps * MAX_TOKENS_PER_STEP:
            raise ValueError(f"progress claims {self.tokens} tokens in {self.steps} steps")


@dataclass(frozen=True, slots=True)
class Join:
    """Register (again): the synchronizer answers with the full global state."""

    learner_id: str
    boot: str
    tokens_per_step: int = 0
    """The most tokens one of its inner steps trains (its whole data-parallel batch); 0 = not
    declared. The synchronizer never counts more per step than this (nor than its own cap)."""

    def __post_init__(self) -> None:
        check_id(self.learner_id, "learner id")
        check_id(self.boot, "boot id")
        if not 0 <= self.tokens_per_step <= MAX_TOKENS_PER_STEP:
            raise ValueError(f"tokens per step {self.tokens_per_step} not in [0, {MAX_TOKENS_PER_STEP}]")


@dataclass(frozen=True, slots=True)
class SessionReport:
    """What a heartbeat and a leave both carry: whose session, and its progress."""

    learner_id: str
    session: Session
    progress: Progress

    def __post_init__(self) -> None:
        check_id(self.learner_id, "learner id")


@dataclass(frozen=True, slots=True)
class Heartbeat(SessionReport):
    """Renews the lease of a session and reports progress."""


@dataclass(frozen=True, slots=True)
class Leave(SessionReport):
    """A learner is done: the synchronizer stops waiting for it at once."""


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
    """The first inner step covered, numbered across the learner's restarts by its data stream (step k
    trains batch k - 1, ``core/sync_side/data_position.py``): drivers credit the steps when merged, and the
    synchronizer keeps how far each learner's data reached the global model."""
    progress: Progress | None = None
    """The learner's cumulative progress, reported on the way (the budget)."""
    slice: SliceSpec | None = None
    """The part of the fragment this message carries, for one rank of a sharded learner (None: all
    of it). The payload holds the slice's values only; its counters are the whole learner's, and the
    synchronizer admits the contribution once all its slices are in (``core/sync_side/slice_assembly.py``)."""

    def __post_init__(self) -> None:
        check_id(self.learner_id, "learner id")
        if not all(0 <= v < MAX_INDEX for v in (self.fragment, self.base_version, self.seq, self.first_step)):
            raise ValueError("fragment, version, seq or first step out of range")
        # A contribution without tokens would have no weight in the merge: refuse it here,
        # before it can be accepted into a round that then has nothing to weigh.
        if not (1 <= self.steps <= MAX_COUNT and 1 <= self.tokens <= min(MAX_COUNT, self.steps * MAX_TOKENS_PER_STEP)):
            raise ValueError(f"bad counters: tokens={self.tokens} steps={self.steps}")
        if not (0.0 <= self.compute_s <= MAX_COMPUTE_S and 0.0 <= self.step_time_s <= MAX_STEP_TIME_S):
            raise ValueError(f"timing out of range: compute_s={self.compute_s} step_time_s={self.step_time_s}")

    @property
    def last_step(self) -> int:
        return self.first_step + self.steps - 1


@dataclass(frozen=True, slots=True)
class MergedRef:
    """One contribution an update merged: the learner, its session number and the contribution's
    sequence number. A learner whose answer to a contribution was lost on the way learns from the
    update whether that contribution reached the model (``SendSchedule.updated``)."""

    learner_id: str
    session: int
    seq: int


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
    merged: tuple[MergedRef, ...] = ()
    """The contributions this update merged (empty where it is replayed from a round log)."""

    def __post_init__(self) -> None:
        if self.fragment < 0 or self.version < 1:
            raise ValueError(f"bad update header: fragment={self.fragment} version={self.version}")


@dataclass(frozen=True, slots=True)
class FragmentValue:
    """Full fp32 value of one global fragment, for a (re)joining learner."""

    fragment: int
    version: int
    values: torch.Tensor | None
    """None in the synchronizer's reply to a join: a driver copies each fragment as it sends it
    (``Synchronizer.fragment_value``), so a join never holds a copy of the whole model."""


@dataclass(frozen=True, slots=True)
class GlobalState:
    """Every fragment's current value and version: what a (re)joining learner adopts."""

    fragments: tuple[FragmentValue, ...]
    incarnation: int = 0
    session: Session | None = None
    """The session this state opens for the learner that joined (None for a plain fetch)."""
    data_position: int = 0
    """Where the joining learner's data stream resumes: every batch before it reached the global
    fragments this state holds (``core/sync_side/data_position.py``; 0 for a plain fetch)."""

    def versions(self) -> tuple[int, ...]:
        return tuple(f.version for f in self.fragments)


@dataclass(frozen=True, slots=True)
class StopNotice:
    """The run's budget is spent: flush what is unsent, leave, exit."""


Request = Join | Heartbeat | Contribution | Leave
"""What a learner sends and the synchronizer answers (one reply each)."""
