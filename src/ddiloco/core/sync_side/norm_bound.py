"""The largest outer gradient a fragment accepts, learnt from what its learners send.

The bound is ``protocol.delta_norm_ratio_max`` times the lower median of the last
``NORMS_KEPT`` norms measured for the fragment: the contributions within it *and* those
above it, each of these counted at the bound it exceeded.

*Norms above the bound count.* A bound learnt only from the norms it let in cannot follow the honest
scale once that grows by more than the ratio, which an inner-lr warm-up does: a fragment's
first round holds a few steps at a small rate, the next a whole period at a larger one.
Every later contribution of every learner is then refused, no new norm is let in, and the
fragment never moves again while the learners train it apart. Measured before this rule: a
35k-parameter run on the virtual cluster with a 34-step warm-up froze fragment 1 at version 2
for all of its 1,700 steps (568 contributions refused) and its eval loss rose from 2.75 to 4.00
while data parallel's fell to 1.72; on a GPU the same froze the 2.8M-parameter point of the
model-size ladder (docs/results.md section 7). Counting refused norms, the bound reaches the
new scale once half its window has been sent at it, and the fragment moves again.

*At the bound, once per sequence number.* A refused norm enters the window as the bound it
exceeded, not as itself, and a contribution sent again under the same sequence number is
counted once. So refused contributions move the bound no faster than accepted ones could
(at most ``ratio`` times per half window, each send a new sequence number that the claim
checks must let through): a member cannot raise the bound in one go by sending one huge
contribution many times.

*Above the bound: let in small, not refused.* Even counting refused norms, the bound reaches
a new honest scale only once half its window was sent at it, and every honest contribution
sent before then was refused: one per 2.8M-parameter GPU run (docs/results.md section 7), one
in the stalled-uploads run, the first rounds after a warm-up or a learning-rate step. That
work was thrown away although nothing in it was wrong but its scale. So a contribution above
the bound is let in with its Δ scaled down to the lower median (what most learners send) and
its merge weight (after the cap, ``protocol.max_weight_ratio``) scaled by the same factor
(:meth:`NormBound.admit`): an honest learner's direction still counts, and a member gains less
than by sending just below the bound, which the bound always let in whole. Scaling to the
bound itself, at full weight, was tried first: it let the member of
``tests/core/test_hostile_members.py`` (three honest learners and one sending at 0.9 times
its estimate of the bound) grow the fragment's norm from 9.8 to 173 in ten rounds, against the
test's limit of 3 times; scaled and weighted down as here, it stays within it. A norm beyond
``ratio`` times the bound (``ratio²`` times what most learners send: no honest change of scale,
a bug or an attack) is still refused as ``norm_bound``.

*A window and its lower median, not the latest norms.* The bound follows a change of scale
only as fast as half the window fills with it. That lag is what keeps one member from
growing the model round after round: an update it pushes in makes the honest learners' next
Δ larger too (they move towards the new global value), and a bound that followed them at once
would let the member push harder each round (``tests/core/test_hostile_members.py``). While
most of the window is honest, a member can neither raise the bound nor lower it below what
most learners send.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

from ddiloco.core.shared.messages import Rejected, RejectReason

NORMS_KEPT = 32
"""Measured norms the bound is the lower median of."""
NORMS_NEEDED = 8
"""Norms measured before the bound follows them rather than the fragment's initial scale."""
NORM_FLOOR = 1e-3
"""The bound never falls below this share of the fragment's initial scale (a run whose
updates shrink toward zero must still accept an honest contribution a little above the median)."""
SENDERS_KEPT = 4096
"""Senders (learner id and session) whose last measured sequence number is remembered (the
least recent dropped)."""


class NormBound:
    """One fragment's norm bound and the recent norms behind it."""

    __slots__ = ("initial_norm", "_norms", "_last_seq")

    def __init__(self, initial_norm: float = 1.0) -> None:
        self.initial_norm = initial_norm
        """‖Θ_p‖ when the run began: the bound's scale until ``NORMS_NEEDED`` norms are known."""
        self._norms: collections.deque[float] = collections.deque(maxlen=NORMS_KEPT)
        self._last_seq: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def bound(self, ratio: float) -> float:
        """The largest ‖Δ‖ accepted now."""
        scale = max(self.initial_norm, 1.0)
        if len(self._norms) < NORMS_NEEDED:
            return ratio * scale
        recent = sorted(self._norms)
        return ratio * max(recent[(len(recent) - 1) // 2], NORM_FLOOR * scale)

    def admit(self, sender: Hashable, seq: int, norm: float, ratio: float) -> float:
        """Measure contribution ``seq`` of ``sender`` at ``norm`` (:meth:`measured`) and say how it
        is let in: the factor its Δ and its weight are scaled by (1 within the bound; above it, the
        lower median over ``norm``), or :class:`Rejected` (``norm_bound``) beyond ``ratio`` times the bound."""
        bound = self.bound(ratio)
        self.measured(sender, seq, norm, bound)  # refused or not: it follows what learners send
        if norm > ratio * bound:
            raise Rejected(RejectReason.NORM_BOUND, f"outer-gradient norm {norm:.3g} exceeds {ratio:g} times the "
                                                    f"bound {bound:.3g}")
        return 1.0 if norm <= bound else bound / ratio / norm

    def measured(self, sender: Hashable, seq: int, norm: float, bound: float) -> None:
        """Contribution ``seq`` of ``sender`` (a learner id and its session: a learner that
        registers again numbers its sends from the start) was measured at ``norm`` against
        ``bound`` (refused if above it): counted at ``min(norm, bound)``, once per sequence number."""
        if seq <= self._last_seq.get(sender, -1):
            return
        self._last_seq.pop(sender, None)
        self._last_seq[sender] = seq
        while len(self._last_seq) > SENDERS_KEPT:
            self._last_seq.popitem(last=False)
        self._norms.append(min(norm, bound))

    def state_dict(self) -> dict[str, Any]:
        return {"initial_norm": self.initial_norm, "norms": list(self._norms)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; sequence numbers start afresh (a learner's next send is new)."""
        self.initial_norm = float(saved.get("initial_norm", self.initial_norm))
        self._norms.clear()
        self._norms.extend(float(n) for n in saved.get("norms", ()))
        self._last_seq.clear()
