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

Beyond ``protocol.staleness_reach`` (3 by default) times ``staleness_max`` and beyond the bound
in time (below) the contribution is refused as ``stale``, and the learner says once that its link
is too long for the configured period and which period would fit (:func:`period_that_fits`). Why
this reach, measured on the virtual cluster with one learner whose round trip always spans 2, 4 or
8 times ``staleness_max`` rounds, paired by seed with the three near learners alone (docs/design.md,
"Decisions the paper leaves open": *One learner on a long link*): merged at 2x, its work left the
model no worse than without it; merged at 4x and 8x, worse in every seed, and refused there, no
worse. Earlier measurements, which read the far learner as costing about 0.1 in eval loss whatever
the rule, were the virtual cluster's error, not the rule's: it counted the far learner's latency in
every round's ξ_sync (``core/shared/grace.py``), which left the near learners no grace window. Steeper
weights than this one did no better in those measurements. With a reach of 1, the every-fault-kind
chaos run refused 617 honest steps made 7-11 versions late by a transient link fault (docs/chaos.md).

A reach counted in versions cannot cover a delay counted in seconds: a tiny unpaced run merges
17-20 versions a second per fragment, so a link fault that holds a learner's work 1-3 s makes it
17-69 versions late, and the every-fault-kind chaos run at reach 4 still refused 1,755 and 2,489
honest steps. So there is a second bound, in time (:class:`StalenessBound`): a contribution is
also merged, at the same falling weight, when its base version stopped being current less than
``protocol.staleness_leases`` (1 by default) leases ago, and refused as stale only beyond both
bounds. Why the lease: it is how long the protocol already lets a learner go unheard and still
counts it alive, waiting for its work (quorum, grace, all-live close); a delay shorter than that
is, by the protocol's own account, a live learner's delay, and its work honest. The same lease
bounds how long a learner's work may lag beyond the reach before it is a distance, not a delay:
a fault holds a learner for the fault's length, a link too long for the period holds it for good,
and past a lease of it the bound in time no longer lets its work in
(``GlobalFragment.check_version``); a learner whose base versions are each superseded within a
second, round trip after round trip, would otherwise be merged for ever. The bound does not
let a member steer the model: a contribution measured from an old version has no power a fresh
one lacks (any payload can be sent from the current version at full weight); it is scaled down by
the weight, clipped by the norm bound and capped by ``max_weight_ratio`` like any other.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddiloco.core.shared.protocol_config import ProtocolConfig


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


@dataclass(frozen=True, slots=True)
class StalenessBound:
    """Where late becomes too late: more than ``versions`` behind *and* superseded ``seconds`` ago or more."""

    versions: int
    """The largest lag merged whatever its age (``staleness_reach`` x ``staleness_max``)."""
    seconds: float
    """Work whose base version stopped being current less than this long ago is merged whatever its
    lag (``staleness_leases`` x ``lease_s``; 0: the bound in versions alone)."""

    @classmethod
    def of(cls, config: ProtocolConfig) -> StalenessBound:
        return cls(staleness_limit(config.staleness_max, config.staleness_reach),
                   config.staleness_leases * config.lease_s)

    def merges(self, lag: int, age_s: float | None) -> bool:
        """Whether work ``lag`` versions behind, whose base stopped being current ``age_s`` ago
        (None: not known, e.g. superseded before a restart), can still be merged."""
        return lag <= self.versions or (age_s is not None and age_s < self.seconds)

    def why_not(self, base_version: int, version: int, age_s: float | None, *, late_for_s: float = 0.0) -> str:
        """The refusal's detail for work measured from ``base_version`` at ``version``, beyond both
        bounds (``late_for_s``: how long the learner's work of this fragment has lagged so far)."""
        said = f"base version {base_version} lags {version} by more than {self.versions}"
        if self.seconds > 0.0 and late_for_s >= self.seconds:
            return (f"{said}, as this learner's work of the fragment has for {late_for_s:.1f} s (bound "
                    f"{self.seconds:g} s): a link too long for this period, not a delay")
        if self.seconds <= 0.0:
            return said
        when = ("at a time not known (before this synchronizer started)" if age_s is None else
                f"{age_s:.2f} s ago" if math.isfinite(age_s) else f"more than {self.seconds:g} s ago")
        return f"{said} and was superseded {when} (bound {self.seconds:g} s)"


class SupersededTimes:
    """When each recent version of one fragment stopped being current (the synchronizer's clock).

    Only the versions superseded within the time bound are kept (at 20 versions a second and a
    10 s lease, 200 floats); a version superseded before this synchronizer's start (restored from
    its checkpoint and round log, whose times belonged to another process's clock) has no time,
    and only the bound in versions applies to work measured from it."""

    __slots__ = ("_since", "_first", "_times")

    def __init__(self) -> None:
        self._since = self._first = 0
        """The first version seen superseded since the start, and the first one whose time is kept."""
        self._times: deque[float] = deque()

    def superseded(self, version: int, now: float, keep_s: float) -> None:
        """``version`` stopped being current at ``now``; forget the versions superseded over ``keep_s`` ago."""
        if self._first + len(self._times) != version:
            self.clear()
            self._since = self._first = version
        self._times.append(now)
        while self._times and now - self._times[0] > keep_s:
            self._times.popleft()
            self._first += 1

    def age_s(self, version: int, now: float) -> float | None:
        """How long ago ``version`` stopped being current: None if not known, infinite if so long
        ago that its time was forgotten."""
        if version < self._since:
            return None
        i = version - self._first
        return math.inf if i < 0 else now - self._times[i] if i < len(self._times) else None

    def clear(self) -> None:
        self._times.clear()
        self._since = self._first = 0
