"""What a member may claim: no more work than the run's configuration makes possible.

A learner reports its training progress (cumulative tokens and steps per process boot)
and, with every contribution, the tokens and steps behind it; the first feeds the run's
budget, the second the merge weights. Both come from a member the synchronizer cannot
watch, so both are trusted only as far as time allows: since its last counted report a
learner can have taken at most ``elapsed / min_step_s + 1`` steps (``min_step_s``: the
fastest inner step the run believes possible), each of at most ``tokens_per_step`` tokens
(what it declared when it joined, never above the run's own cap). What lies beyond is not
counted — a progress report is clipped (and counted as clipped), a contribution refused as
``implausible`` — so one member's message can neither end a run nor outweigh the others by
claiming work it could not have done.

The sequence number of a contribution is held to the same clock: a learner sends a
fragment at most once per period, so ``seq`` may run ahead of the last accepted one by at
most the periods that fit in the elapsed time. A far-future ``seq`` (which would lock the
real learner out of the fragment as ``duplicate``) is refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddiloco.core.messages import MAX_TOKENS_PER_STEP, Contribution, Progress, RejectReason, Rejected

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
                       last_seq: int, period: int) -> None:
    """:class:`Rejected` unless ``c`` is new (``duplicate``) and claims work that fits since ``since_s``
    (the learner's registration, or its last accepted contribution of this fragment; ``implausible``)."""
    if c.seq <= last_seq:
        raise Rejected(RejectReason.DUPLICATE, f"seq {c.seq} for fragment {c.fragment} already received")
    steps = limits.steps_in(now - since_s)
    if c.steps > steps:
        raise Rejected(RejectReason.IMPLAUSIBLE, f"{c.steps} steps claimed in {now - since_s:.3g}s "
                                                 f"(at most {steps} at one per {limits.min_step_s:g}s)")
    if c.tokens > c.steps * tokens_per_step:
        raise Rejected(RejectReason.IMPLAUSIBLE, f"{c.tokens} tokens in {c.steps} steps "
                                                 f"(at most {tokens_per_step} per step)")
    ahead = 1 + steps // period
    if c.seq > last_seq + ahead:
        raise Rejected(RejectReason.IMPLAUSIBLE, f"seq {c.seq} runs {c.seq - last_seq} ahead of the last "
                                                 f"accepted one (at most {ahead})")


@dataclass(slots=True)
class _Boot:
    """One learner process's reports: what it claimed, and what of it was counted."""

    claimed_tokens: int = 0
    claimed_steps: int = 0
    tokens: int = 0
    steps: int = 0
    at_s: float | None = None
    """When it was last counted (this incarnation's clock; None after a restore)."""


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
        """Count what ``progress`` adds, within what fits since the boot was last counted
        (``since_s``, the learner's registration, for a boot not counted in this incarnation)."""
        key = (learner_id, progress.boot)
        boot = self._boots.get(key)
        if boot is None:
            boot = self._boots[key] = _Boot()
            self._fold_old_boots(learner_id)
        new_steps = progress.steps - boot.claimed_steps
        new_tokens = progress.tokens - boot.claimed_tokens
        if new_steps <= 0 and new_tokens <= 0:
            return  # a repeated or reordered report
        start = boot.at_s if boot.at_s is not None else since_s
        steps = min(max(new_steps, 0), self.limits.steps_in(now - start))
        tokens = min(max(new_tokens, 0), steps * tokens_per_step)
        if steps < new_steps or tokens < new_tokens:
            self.clipped += 1
        boot.claimed_steps = max(boot.claimed_steps, progress.steps)
        boot.claimed_tokens = max(boot.claimed_tokens, progress.tokens)
        boot.steps += steps
        boot.tokens += tokens
        boot.at_s = now
        self._by_learner[learner_id] = self._by_learner.get(learner_id, 0) + tokens
        self.tokens += tokens

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
            "boots": [[name, boot, b.claimed_tokens, b.claimed_steps, b.tokens, b.steps]
                      for (name, boot), b in self._boots.items()],
            "learners": dict(self._by_learner),
            "tokens": self.tokens,
            "clipped": self.clipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The times are of another incarnation's clock: each boot's next report is measured
        # from its learner's new registration.
        self._boots = {(str(a), str(b)): _Boot(int(ct), int(cs), int(t), int(s))
                       for a, b, ct, cs, t, s in state["boots"]}
        self._by_learner = {str(k): int(v) for k, v in state["learners"].items()}
        self.tokens = int(state["tokens"])
        self.clipped = int(state.get("clipped", 0))
