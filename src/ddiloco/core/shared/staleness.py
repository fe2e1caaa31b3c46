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

Beyond ``protocol.staleness_reach`` times ``staleness_max`` the contribution is refused as
``stale``, and the learner says once that its link is too long for the configured period and
which period would fit (:func:`period_that_fits`). The reach is 1 by default, so that the weights
apply only where a run asks for them: on the virtual cluster a far learner's late work merged at
these weights left the model worse than refusing it at a round trip of 2 x ``staleness_max``
rounds, and no better at 4 x and 8 x (docs/design.md, "Decisions the paper leaves open": *One learner on a long link*).
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
