"""Where a learner stands, and what its training loop does between two steps.

Both drivers ask the core the same question between two steps
(:meth:`~ddiloco.core.learner_side.learner_core.Learner.between_steps`) and do what it answers: the virtual
cluster's learner node, and ``LearnerRuntime`` in a user's loop (``ddiloco learner``, the
examples). Neither decides by itself when to wait, when to close or when the loop is over.
"""

from __future__ import annotations

import enum

from ddiloco.core.shared.messages import RejectReason


class LearnerPhase(enum.StrEnum):
    IDLE = "idle"
    """Created; ``start`` sends the first join."""
    JOINING = "joining"
    """The first joins are on their way (or will be retried): no state to train from yet."""
    TRAINING = "training"
    STOPPING = "stopping"
    """The run's budget is spent: the driver calls ``close`` at the next step boundary."""
    STOPPED = "stopped"
    FAILED = "failed"


class LoopMove(enum.StrEnum):
    """What the training loop does next, between two steps."""

    STEP = "step"
    """Take the next inner step."""
    WAIT = "wait"
    """Wait for the synchronizer: no global state yet, or synchronous DiLoCo waits for the update
    of a fragment it sent (``protocol.max_wait_s``)."""
    CLOSE = "close"
    """The run's budget is spent: send what is left and leave (``Learner.close``)."""
    END = "end"
    """Closed, or failed: the loop is over (a failure is the driver's to raise)."""


class UpdateResult(enum.StrEnum):
    APPLIED = "applied"
    IGNORED = "ignored"
    """Already held (duplicate or older), or from another synchronizer incarnation."""
    GAP = "gap"
    """A version was missed: the learner registers again to get the full state."""


REJOIN_ON = frozenset({
    RejectReason.UNKNOWN_LEARNER,  # lease expired, or the synchronizer restarted
    RejectReason.SUPERSEDED,       # the synchronizer holds a newer session of ours than we do
    RejectReason.STALE,            # our anchors are too far behind and no update came since (``_stale_on_its_link``)
    RejectReason.FUTURE_VERSION,   # the synchronizer rolled back to a checkpoint
})
"""Refusals of the current session that call for the full state again."""
TRY_AGAIN = frozenset({RejectReason.BUSY, RejectReason.TIMED_OUT})
"""Refusals of a contribution for the synchronizer's load or a stalled stream, not for its content:
nothing of it was merged, so its work goes into the fragment's next contribution (as an unanswered
call's does)."""
FATAL = frozenset({RejectReason.UNAUTHENTICATED, RejectReason.BAD_PROTOCOL_VERSION, RejectReason.LAYOUT_MISMATCH,
                   RejectReason.REPLACED})
"""Refusals no retry can fix (``replaced``: a later process holds this learner id; two processes
taking it back from each other would fight for ever, so the earlier one stops)."""
