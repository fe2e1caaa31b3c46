"""Whether a learner's link carries its work: the two things a learner says when it does not.

A learner never waits for the network, so its own steps per second hide a link that is too
slow. Two signs, each said once (and again only after the link recovered):

- *starved* (:class:`~ddiloco.core.actions.Starved`): none of its work has been accepted for
  ``STARVED_PERIODS`` periods;
- *behind* (:class:`~ddiloco.core.actions.Behind`): some arrives, but its recent
  contributions carried ``BEHIND_AT`` periods of steps each on average, because each waited
  for the one before it to be answered (``SendSchedule.held``).
"""

from __future__ import annotations

from collections import deque

from ddiloco.core.actions import Behind, LearnerAction, Starved

STARVED_PERIODS = 3
"""None of a live learner's work accepted for this many of its periods: link-starved, as the
learner sees it and as the synchronizer does (``Registry``, with at least two leases)."""
BEHIND_AT = 1.5
"""Behind when the recent contributions carried this many periods of steps each on average (a
third of the sends waited for the one before): below what the protocol needs."""
CAUGHT_UP_AT = 1.2
"""Caught up again under this many periods per contribution."""


class LinkWatch:
    def __init__(self, period: int, fragments: int) -> None:
        self.period = period
        self._accepted_at_step = 0
        """The step at which a contribution was last accepted, or a state adopted."""
        self._carried: deque[int] = deque(maxlen=2 * fragments)
        """Steps carried by each of the last sends (H each when the link keeps up)."""
        self.starved = False
        self.behind = False

    def arrived(self, step: int) -> None:
        """A contribution was accepted, or a global state adopted, at ``step``."""
        self._accepted_at_step = step
        self.starved = False

    def sent(self, steps: int) -> None:
        """A contribution carrying ``steps`` steps went out."""
        self._carried.append(steps)

    def check(self, step: int, *, training: bool, rejoining: bool) -> list[LearnerAction]:
        """What to say at ``step`` while ``training``: starved (not while ``rejoining``: its work
        waits for the new state), behind."""
        if not training:
            return []
        actions: list[LearnerAction] = []
        unaccepted = step - self._accepted_at_step
        if not rejoining and not self.starved and unaccepted >= STARVED_PERIODS * self.period:
            self.starved = True
            actions.append(Starved(unaccepted))
        if len(self._carried) == self._carried.maxlen:
            mean = sum(self._carried) / len(self._carried)
            if not self.behind and mean >= BEHIND_AT * self.period:
                self.behind = True
                actions.append(Behind(mean, self.period))
            elif self.behind and mean < CAUGHT_UP_AT * self.period:
                self.behind = False
        return actions
