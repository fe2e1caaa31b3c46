"""How much a late contribution counts, and where late becomes too late (docs/design.md,
"Late contributions and staleness").

A contribution's *lag* is how many versions its fragment moved between the anchor it was
measured from and the round it lands in. Up to ``protocol.staleness_max`` it is merged at
full weight: lags that short are what the protocol makes by design (late work riding along
with the next round, a learner one version behind at every close under overlap and the grace
window) and every recorded result was measured with them at full weight. Beyond it, the
contribution is merged with its weight scaled by ``(staleness_max + 1) / (lag + 1)``: a Δ
measured ``lag`` rounds ago points where the model was then, and how far it may be off grows
with the rounds merged since, so it counts in inverse proportion to them (the polynomial
staleness weight of asynchronous SGD, at its gentlest exponent). Before this rule, every
such contribution was refused: a learner whose round trip always spans more rounds than
``staleness_max`` — the far-away island the method is for — trained, followed the model, and
had all of its work thrown away.

Beyond ``protocol.staleness_reach`` (4 by default) times ``staleness_max`` the contribution is
refused as ``stale``, and the learner says once that its link is too long for the configured
period and which period would fit (:func:`period_that_fits`). Why this weight and this reach,
measured on the virtual cluster with one learner whose round trip always spans 2, 4 or 8 times
``staleness_max`` rounds (docs/design.md, "Decisions the paper leaves open": *One learner on a
long link*): over 6 seeds, merging its late work at these weights was no worse than refusing it
at 2x and 4x (paired means +0.02 and +0.01 against a per-seed spread of about 0.2). Steeper
weights did not do better: the square of this one was worse than refusing in 3 seeds of 3 at
every span, ``exp(-(lag - staleness_max) / staleness_max)`` was +0.04 at 4x over 6 seeds, and a
weight of 0 (accepted, merged with no weight) was itself +0.02 to +0.03: what remains is the
cost of a never-fresh learner in the rounds, not of its merged work. Beyond 4x (8x measured, 3
seeds, +0.06) the work would count for little, and the learner is better served by the
period it is told. With a reach of 1, the every-fault-kind chaos run refused 617 honest steps
made 7-11 versions late by a transient link fault (docs/chaos.md).
"""

from __future__ import annotations

import math


def staleness_limit(staleness_max: int, reach: float) -> int:
    """The largest lag merged at all (``reach`` times ``staleness_max``, at least ``staleness_max``)."""
    return max(staleness_max, int(reach * staleness_max))


def staleness_weight(lag: int, staleness_max: int) -> float:
    """What a contribution's merge weight is multiplied by at ``lag`` versions behind."""
    return 1.0 if lag <= staleness_max else (staleness_max + 1) / (lag + 1)


def period_that_fits(period: int, lag: int, limit: int) -> int:
    """The period H at which a round trip spanning ``lag`` rounds of period ``period`` spans at
    most ``limit``: the rounds come that much slower, the link's round trip stays the same."""
    return period * math.ceil(lag / max(1, limit))
