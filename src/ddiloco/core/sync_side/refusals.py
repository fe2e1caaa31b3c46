"""The ledger of refused work: every refused contribution, by learner and reason, with the
steps and tokens it held (docs/design.md, "Decisions the paper leaves open": *Refused honest
work*).

Goodput counts chip-time whose work reached the global model. Work an honest learner trained
and sent, and that the synchronizer then refused, is thrown away as surely as a crash; this
ledger makes it visible. Each reason is of one :class:`RefusalKind`, decided by whether a
learner that follows the protocol can earn it and whether the work is then lost:

- ``HONEST``: a well-behaved learner can earn it and its work is thrown away (``stale``,
  ``norm_bound``, ``future_version``, ``replaced``, ``slice_incomplete``: a rank of a sharded
  learner died before sending its slice). Every such refusal is a defect to drive to
  zero; the run's figure is :func:`honest_total` of its steps.
- ``MEMBER``: only a misbehaving member earns it — a claim the clock, the configuration or the
  message bounds rule out (``implausible``, ``malformed``, ``bad_codec``, ``bad_size``,
  ``non_finite``, ``unknown_fragment``, ``slice_mismatch``). It is a member's refusal, never honest work.
- ``RESENT``: no work is lost at the refusal: the learner sends it again after registering
  (``unknown_learner``, ``superseded``, ``registry_full``), it goes into the fragment's next
  contribution (``busy``, ``timed_out``: no place for its upload, or its stream stalled), it was
  merged already (``duplicate``: a retry whose first reply was lost), or it lies past the spent
  budget (``finished``).

The core cannot tell a member sending an outer gradient beyond the norm bound from an honest
learner whose scale changed: both are ``norm_bound``. So the ledger is per learner, and a
driver that knows which ids are hostile (the probes, the simulator) sums the honest figure over
the others only; a real run has no hostile members by assumption, and its honest figure is
every learner's.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class RefusalKind(enum.StrEnum):
    HONEST = "honest"
    """A well-behaved learner can earn it, and its work is thrown away."""
    MEMBER = "member"
    """Only a member misbehaving earns it (an impossible claim or a malformed message)."""
    RESENT = "resent"
    """No work lost at the refusal: sent again, merged already, or past the budget."""


KIND_OF: dict[str, RefusalKind] = {
    "stale": RefusalKind.HONEST,
    "norm_bound": RefusalKind.HONEST,
    "future_version": RefusalKind.HONEST,
    "replaced": RefusalKind.HONEST,
    "repeated": RefusalKind.HONEST,
    "slice_incomplete": RefusalKind.HONEST,
    "implausible": RefusalKind.MEMBER,
    "malformed": RefusalKind.MEMBER,
    "bad_codec": RefusalKind.MEMBER,
    "bad_size": RefusalKind.MEMBER,
    "non_finite": RefusalKind.MEMBER,
    "unknown_fragment": RefusalKind.MEMBER,
    "slice_mismatch": RefusalKind.MEMBER,
}
"""Each refusal's kind by its :class:`~ddiloco.core.shared.messages.RejectReason` code, where not
``RESENT``. Codes, not the enum: ``ddiloco status`` reads this without the core's messages
(and torch); ``tests/core/test_refused_honest_work.py`` holds every key to a reason."""


def kind_of(reason: str) -> RefusalKind:
    """The kind of refusal ``reason`` (a reason code; an unknown one, of a newer synchronizer, is ``RESENT``)."""
    return KIND_OF.get(reason, RefusalKind.RESENT)


def honest_total(by_reason: Mapping[str, int]) -> int:
    """The honest work thrown away (steps, tokens or refusals), from its counts by reason."""
    return sum(n for reason, n in by_reason.items() if kind_of(reason) is RefusalKind.HONEST)


def lost_total(by_reason: Mapping[str, int]) -> int:
    """The work thrown away, honest or not (steps, tokens or refusals), from its counts by reason: what a
    learner's user is told of (a real run has no hostile members by assumption: every such refusal
    is a defect to report where the user looks, issue 57)."""
    return sum(n for reason, n in by_reason.items() if kind_of(reason) is not RefusalKind.RESENT)


def honest_learner_steps(learners: Iterable[Mapping[str, Any]], hostile: Iterable[str] = ()) -> int:
    """:func:`honest_total` of the steps summed over learners as ``ddiloco status --json`` lists them (``id``,
    ``refused_steps``), leaving out the ``hostile`` ids."""
    members = set(hostile)
    return sum(honest_total(lr.get("refused_steps", {})) for lr in learners if lr.get("id") not in members)


@dataclass(slots=True)
class Refusals:
    """One learner's refused contributions: how many, and the steps and tokens they held, by reason."""

    count: Counter[str] = field(default_factory=Counter)
    steps: Counter[str] = field(default_factory=Counter)
    tokens: Counter[str] = field(default_factory=Counter)

    def add(self, reason: str, steps: int, tokens: int) -> None:
        """One contribution refused for ``reason`` (a reason code), holding ``steps`` and ``tokens``."""
        self.count[str(reason)] += 1
        self.steps[str(reason)] += steps
        self.tokens[str(reason)] += tokens

    def state_dict(self) -> dict[str, dict[str, int]]:
        return {"count": dict(self.count), "steps": dict(self.steps), "tokens": dict(self.tokens)}

    @classmethod
    def from_state(cls, state: Mapping[str, Mapping[str, int]] | None) -> "Refusals":
        state = state or {}
        return cls(*(Counter({str(k): int(v) for k, v in state.get(key, {}).items()})
                     for key in ("count", "steps", "tokens")))
