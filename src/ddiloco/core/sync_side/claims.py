"""What a member may claim: no more work than the clock allows, counted; never a refusal for speed.

A learner reports its training progress (cumulative tokens and steps per process boot)
and, with every contribution, the tokens and steps behind it; the first feeds the run's
budget, the second the merge weights. Both come from a member the synchronizer cannot
watch, so both are *counted* only as far as time allows: since a fixed origin a learner is
credited at most ``elapsed / min_step_s + 1`` steps (``min_step_s``: the fastest inner step
the run counts), each of at most ``tokens_per_step`` tokens (what it declared when it joined,
never above the run's own cap). What lies beyond is clipped, and counted as clipped: a progress
report adds only what fits to the budget, a contribution's steps and tokens are cut to what fits
(its efficiency, tokens per step, kept) before they weigh in its merge, while its outer gradient
is merged. So one member's message can neither end a run nor outweigh the others by claiming
work it could not have done, and an honest learner faster than any floor loses nothing but
the weight of what the floor leaves uncounted.

*Why a clip and not a refusal* (issue 57). A floor on the step time is not a property of honest
learners: a small model on a GPU steps faster than 1 ms, and so do the first steps of a loop that
slows down later. Refused, their work was thrown away (an honest ~1 ms loop was refused in one
launch of three; a faster one hundreds of times a run). What the check protects is the weight and
the budget, and a clip protects both as well as a refusal did. What is still refused is what an
honest learner cannot send: tokens beyond those it declared per step (its core raises before it
sends them) and a sequence number further ahead than one send per period of ``min_step_s`` steps
(an honest learner sends a fragment again only once its previous send was answered: a round
trip, which no learner makes in ``period × min_step_s``, 10 µs a step by default).

The bound is on totals since the origin, not on what one message adds since
the previous one: messages arrive late and back to back (a slow link, a busy synchronizer),
and an honest learner's totals never outrun the clock, whereas two reports a millisecond
apart may well carry seconds of work between them.

*The origin follows the learner's progress, not its session.* A learner that registers
again with the same process (same boot, same synchronizer incarnation: after a partition
longer than a lease, say) keeps its progress where the synchronizer still holds the version
it was measured from, and sends it at once. Bounded from the new session's start, that work
was refused: in the every-fault-kind chaos run, 763-768 steps claimed 0.04 s into the new
session, all of learner-0's work of the partition thrown away. So the origin of a
contribution's claims is the start of its boot's *first* session at this incarnation (when
its global state arrived), and the steps and compute seconds accepted since are summed across
its sessions: a re-registration moves no allowance either way, and a member still cannot
claim more steps than wall time allows since its progress could have begun. A synchronizer
restarted from its checkpoint has no origin for a boot (another incarnation's clock), yet the
learner keeps its progress where the restored value is the one it holds (the round log): the
boot the checkpoint lists starts with a head start of what a learner may keep,
``staleness_max`` periods at ``min_step_s`` (``Registry.kept_s``), once; a new process has
none. Claims beyond these count for nothing (clipped, ``claims_clipped["steps"]`` in status).

The sequence number of a contribution is held to the same clock: a learner sends a
fragment at most once per period, so ``seq`` (counted from 0 in each session) may not exceed
the periods that fit since the origin. A far-future ``seq`` (which would lock the
real learner out of the fragment as ``duplicate``) is refused as ``implausible``.

Claimed times are held to the same clock, clipped too (they are
measurements, and an honest learner's may be a little off): the compute seconds a learner
claims for one fragment add up to at most the wall time since the origin (they feed the
reported goodput), and its step time lies between ``min_step_s`` and the wall time per step
claimed since the origin (it feeds the grace window and the spacing of rounds, which one
far-off claim would otherwise set for everyone). What was clipped is counted by :class:`ClipReason`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from ddiloco.core.shared.messages import (
    MAX_STEP_TIME_S,
    MAX_TOKENS_PER_STEP,
    Contribution,
    Progress,
    Rejected,
    RejectReason,
)

BOOTS_KEPT = 4
"""Process boots per learner whose cumulative reports are remembered; older ones are folded
into the learner's total (a boot that comes back after that is clipped like a new one)."""


@dataclass(frozen=True, slots=True)
class ClaimLimits:
    min_step_s: float
    """The fastest plausible inner step (``protocol.min_step_s``)."""
    max_tokens_per_step: int = 0
    """The run's cap on tokens per step (``protocol.max_tokens_per_step``); 0 = the protocol's bound."""

    def tokens_per_step(self, declared: int) -> int:
        """What one step of a learner that declared ``declared`` (0: nothing) may count."""
        cap = self.max_tokens_per_step or MAX_TOKENS_PER_STEP
        return min(declared, cap) if declared else cap

    def steps_in(self, seconds: float) -> int:
        """The most inner steps that fit in ``seconds`` (one more: a step may end at either edge)."""
        return int(max(0.0, seconds) / self.min_step_s) + 1


def check_contribution(c: Contribution, limits: ClaimLimits, *, since_s: float, now: float, tokens_per_step: int,
                       last_seq: int, steps_before: int, compute_before: float,
                       period: int) -> tuple[Contribution, tuple[ClipReason, ...]]:
    """:class:`Rejected` unless ``c`` is new (``duplicate``), holds no more tokens per step than its
    learner declared and a sequence number that fits the time since the origin ``since_s`` (its boot's
    first session here; else ``implausible``); else ``c`` counting, with the ``steps_before`` already
    counted for its fragment since the origin, the steps that fit since then (:func:`plausible_work`)
    and its times clipped (:func:`plausible_timing`), and what was clipped."""
    if c.seq <= last_seq:
        raise Rejected(RejectReason.DUPLICATE, f"seq {c.seq} for fragment {c.fragment} already received")
    if c.tokens > c.steps * tokens_per_step:
        raise Rejected(RejectReason.IMPLAUSIBLE, f"{c.tokens} tokens in {c.steps} steps "
                                                 f"(at most {tokens_per_step} per step)")
    steps = limits.steps_in(now - since_s)
    sends = 1 + steps // period
    if c.seq > sends:
        raise Rejected(RejectReason.IMPLAUSIBLE, f"seq {c.seq} after {now - since_s:.3g}s since this process "
                                                 f"registered (at most {sends} sends fit)")
    counted, clipped = plausible_work(c, steps - steps_before)
    counted, timing = plausible_timing(counted, limits, since_s=since_s, now=now, steps_before=steps_before,
                                       compute_before=compute_before)
    return counted, clipped + timing


def plausible_work(c: Contribution, allowed_steps: int) -> tuple[Contribution, tuple[ClipReason, ...]]:
    """``c`` counting at most ``allowed_steps`` steps (what the clock leaves since the origin, at
    least one: its outer gradient is merged whatever it claims), its tokens cut in the same
    proportion so that its tokens per step, its efficiency, stay what it claimed."""
    if c.steps <= allowed_steps:
        return c, ()
    steps = max(1, allowed_steps)
    return replace(c, steps=steps, tokens=max(1, c.tokens * steps // c.steps)), (ClipReason.STEPS,)


class ClipReason(enum.StrEnum):
    """Which claim of a contribution was clipped to what the clock allows (a status counter's key)."""

    STEPS = "steps"
    """More steps for a fragment than the clock allows since the claims' origin: the merge weight and
    the round's tokens count what it allows, the outer gradient is merged (a fast honest learner's work
    is never refused for its speed)."""
    COMPUTE = "compute_s"
    """More compute seconds for a fragment than wall time since the claims' origin."""
    STEP_TIME = "step_time_s"
    """A step time below ``min_step_s``, or above the wall time per claimed step since the origin."""


def plausible_timing(c: Contribution, limits: ClaimLimits, *, since_s: float, now: float, steps_before: int,
                     compute_before: float) -> tuple[Contribution, tuple[ClipReason, ...]]:
    """``c`` with its compute and step time clipped to what fits since the origin ``since_s``
    (with the ``steps_before`` and ``compute_before`` already accepted for its fragment since),
    and which of them were clipped.

    A step time of 0 says "not measured yet" (a learner's first steps) and is kept: it is
    no claim, and the synchronizer does not learn from it."""
    elapsed = max(0.0, now - since_s)
    compute = min(c.compute_s, max(0.0, elapsed - compute_before))
    step = c.step_time_s
    if step:
        slowest = min(MAX_STEP_TIME_S, max(limits.min_step_s, elapsed / (steps_before + c.steps)))
        step = min(max(step, limits.min_step_s), slowest)
    clipped = tuple(reason for reason, kept, claimed in ((ClipReason.COMPUTE, compute, c.compute_s),
                                                         (ClipReason.STEP_TIME, step, c.step_time_s))
                    if kept != claimed)
    return (replace(c, compute_s=compute, step_time_s=step) if clipped else c), clipped


@dataclass(slots=True)
class _Boot:
    """One learner process's reports: what it claimed, and what of it was counted."""

    claimed_tokens: int = 0
    claimed_steps: int = 0
    tokens: int = 0
    """Counted (the budget's share of this boot)."""
    origin_s: float | None = None
    """Since when this synchronizer bounds the boot's claims (this incarnation's clock; None
    until its first report here, e.g. after a restore)."""
    origin_steps: int = 0
    origin_tokens: int = 0
    """The claims already counted at the origin (a restored boot's totals continue from them)."""
    origin_counted: int = 0


@dataclass(slots=True)
class ProgressLedger:
    """Counted training progress per learner: the run's budget reads :attr:`tokens`.

    Reports are cumulative per boot, so a lost, repeated or reordered one cannot count twice:
    only what a report adds to the largest one seen so far is counted, and only as much as
    fits in the time since the boot was last counted.
    """

    limits: ClaimLimits
    tokens: int = 0
    clipped: int = 0
    """Reports that claimed more than could be counted."""
    _boots: dict[tuple[str, str], _Boot] = field(default_factory=dict)
    _by_learner: dict[str, int] = field(default_factory=dict)

    def tokens_of(self, learner_id: str) -> int:
        return self._by_learner.get(learner_id, 0)

    def report(self, learner_id: str, progress: Progress, *, now: float, since_s: float,
               tokens_per_step: int) -> None:
        """Count ``progress`` as far as it fits since the boot's origin (``since_s``, the learner's
        registration, for a boot this synchronizer has not counted yet)."""
        key = (learner_id, progress.boot)
        boot = self._boots.get(key)
        if boot is None:
            boot = self._boots[key] = _Boot()
            self._fold_old_boots(learner_id)
        if boot.origin_s is None:
            boot.origin_s = since_s
            boot.origin_steps, boot.origin_tokens, boot.origin_counted = (boot.claimed_steps, boot.claimed_tokens,
                                                                          boot.tokens)
        if progress.steps <= boot.claimed_steps and progress.tokens <= boot.claimed_tokens:
            return  # a repeated or reordered report
        boot.claimed_steps = max(boot.claimed_steps, progress.steps)
        boot.claimed_tokens = max(boot.claimed_tokens, progress.tokens)
        steps = min(boot.claimed_steps - boot.origin_steps, self.limits.steps_in(now - boot.origin_s))
        tokens = min(boot.claimed_tokens - boot.origin_tokens, steps * tokens_per_step)
        counted = max(boot.tokens, boot.origin_counted + tokens)
        if tokens < boot.claimed_tokens - boot.origin_tokens:
            self.clipped += 1  # the rest counts later, as the clock allows, if a later report claims more
        self._by_learner[learner_id] = self._by_learner.get(learner_id, 0) + counted - boot.tokens
        self.tokens += counted - boot.tokens
        boot.tokens = counted

    def _fold_old_boots(self, learner_id: str) -> None:
        keys = [k for k in self._boots if k[0] == learner_id]
        for key in keys[:-BOOTS_KEPT]:  # dicts keep insertion order: the oldest boots first
            del self._boots[key]  # their counted tokens stay in the learner's total

    def forget(self, learner_id: str) -> None:
        """Drop a forgotten learner's boots; its counted tokens stay in the run's total."""
        for key in [k for k in self._boots if k[0] == learner_id]:
            del self._boots[key]
        self._by_learner.pop(learner_id, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "boots": [[name, boot, b.claimed_tokens, b.claimed_steps, b.tokens]
                      for (name, boot), b in self._boots.items()],
            "learners": dict(self._by_learner),
            "tokens": self.tokens,
            "clipped": self.clipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The times are of another incarnation's clock: each boot's next report is measured
        # from its learner's new registration, on top of what was counted before.
        self._boots = {(str(row[0]), str(row[1])): _Boot(int(row[2]), int(row[3]), int(row[4]))
                       for row in state["boots"]}
        self._by_learner = {str(k): int(v) for k, v in state["learners"].items()}
        self.tokens = int(state["tokens"])
        self.clipped = int(state.get("clipped", 0))
