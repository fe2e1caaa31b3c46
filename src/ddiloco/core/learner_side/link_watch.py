"""Whether a learner's link carries its work: the three things a learner says when it does not.

A learner never waits for the network, so its own steps per second hide a link that is too
slow. Two signs, each said once (and again only after the link recovered):

- *starved* (:class:`~ddiloco.core.shared.actions.Starved`): none of its work has been accepted for
  ``deadlines.STARVED_PERIODS`` periods and ``deadlines.STARVED_LEASES`` leases, although the synchronizer answers
  (its heartbeats, refusals);
- *behind* (:class:`~ddiloco.core.shared.actions.Behind`): some arrives, but its recent
  contributions carried ``BEHIND_AT`` periods of steps each on average, because each waited
  for the one before it to be answered (``SendSchedule.held``). A link is blamed only if the
  learner's own steps kept their pace: steps slowed ``CPU_SLOW_AT`` times its fastest mean a
  CPU shared with other processes, which slows the sends (encoding, the synchronizer's merge)
  as much as the steps (a learner on 127.0.0.1 under CPU contention was told its link was too
  slow); and a synchronizer on the same host (loopback) is never a slow link either: its round trip
  is CPU time, whatever the steps do (issue 57: steps of 1 ms kept their pace on a loaded host and
  the learner was sent to ``ddiloco bandwidth``). Over a network the learner cannot tell a slow link
  from a synchronizer short of CPU, and says so;
- *stale* (:class:`~ddiloco.core.shared.actions.Stale`): its contributions are refused as stale while
  the updates reach it in order: the round trip spans more rounds than the staleness bound.

And one thing that is not the link's fault: a synchronizer shard that does not answer at all
for ``OUTAGE_AFTER_S`` (:class:`~ddiloco.core.shared.actions.Outage`: when it begins, a summary every
``OUTAGE_SUMMARY_S``, when it ends). A slow link whose large calls time out while its
heartbeats are answered is no outage: it is *starved* or *behind*. Time spent unreachable counts toward neither *starved* nor *behind*: the
contributions folded during an outage carry many periods of steps without the link being slow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ddiloco.core.shared.actions import Behind, LearnerAction, Outage, OutagePhase, Stale, Starved
from ddiloco.core.shared.deadlines import starved

BEHIND_AT = 1.5
"""Behind when the recent contributions carried this many periods of steps each on average (a
third of the sends waited for the one before): below what the protocol needs."""


CAUGHT_UP_AT = 1.2
"""Caught up again under this many periods per contribution."""
CPU_SLOW_AT = 1.5
"""Behind with its steps this many times slower than its fastest: the CPU is short, not the link."""
OUTAGE_AFTER_S = 5.0
"""A shard whose calls have gone unanswered, with no answer in between, for this long is unreachable
(longer than the default heartbeat interval, so a slow link that passes heartbeats is not one)."""
OUTAGE_SUMMARY_S = 10.0
"""While a shard does not answer, how often the learner says how long and how much it folded."""


@dataclass(slots=True)
class _Silent:
    """A shard whose calls go unanswered: since when, what the learner folded meanwhile, and,
    once declared unreachable, when its next summary is due (None before)."""

    since_s: float
    joined: bool
    folded: int = 0
    next_summary_s: float | None = None


class _Pace:
    """The learner's seconds per step over its last ``steps`` steps, and the fastest such figure so far
    (from the step count and the clock of each ``check``)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._marks: deque[tuple[int, float]] = deque()
        self.step_s = 0.0
        self.fastest_s = 0.0

    def at(self, step: int, now: float) -> None:
        marks = self._marks
        if marks and step < marks[-1][0]:
            marks.clear()  # a rejoin rewound the count
        marks.append((step, now))
        while len(marks) > 2 and step - marks[1][0] >= self.steps:
            marks.popleft()
        first_step, first_s = marks[0]
        if step - first_step >= self.steps:
            self.step_s = (now - first_s) / (step - first_step)
            self.fastest_s = min(self.fastest_s or self.step_s, self.step_s)


class LinkWatch:
    def __init__(self, period: int, fragments: int, lease_s: float, heartbeat_s: float, *,
                 on_loopback: bool = False) -> None:
        self.on_loopback = on_loopback
        """The synchronizer is on this host (what *behind* then blames: the CPU, never the link)."""
        self._answered_at_step = 0
        """The step at which the synchronizer last answered any call."""
        self._silent: dict[int, _Silent] = {}
        """Shards whose calls have gone unanswered since their last answer."""
        self._carries_fold: set[int] = set()
        """Fragments whose next send carries the steps of contributions undelivered during an outage
        (or kept across a rejoin)."""
        self.period = period
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        """How often the learner heartbeats: a synchronizer that answers does so at least this often."""
        self._accepted_at_step = 0
        """The step at which a contribution was last accepted, or a state adopted ..."""
        self._accepted_at_s = 0.0
        """... and when."""
        self._carried: deque[int] = deque(maxlen=2 * fragments)
        """Steps carried by each of the last sends (H each when the link keeps up)."""
        self._pace = _Pace(period)
        self.starved = False
        self.behind = False
        self.stale = False
        """Its contributions arrive stale (since the last one accepted, or the last state adopted)."""

    def arrived(self, step: int, now: float) -> None:
        """A contribution was accepted, or a global state adopted, at ``step`` and ``now``."""
        self._accepted_at_step = step
        self._accepted_at_s = now
        self.starved = False
        self.stale = False

    def refused_stale(self, fragment: int, base_version: int, held_version: int,
                      period_fits: int) -> list[LearnerAction]:
        """A contribution measured from ``base_version`` came back stale while the learner holds
        ``held_version`` of its fragment (``period_fits``: the period at which it would not):
        said once per episode (an episode ends when work is accepted again, or a state adopted)."""
        if self.stale:
            return []
        self.stale = True
        return [Stale(fragment, base_version, held_version, period_fits)]

    def sent(self, fragment: int, steps: int) -> None:
        """A contribution carrying ``steps`` steps went out (one carrying an outage's folds tells nothing of the link)."""
        if fragment in self._carries_fold:
            self._carries_fold.discard(fragment)
        else:
            self._carried.append(steps)

    def kept(self, fragment: int) -> None:
        """A rejoin kept ``fragment``'s progress: its next send carries the steps since its last one."""
        self._carries_fold.add(fragment)

    def unanswered(self, shard: int, now: float, *, joined: bool, folded: int | None) -> list[LearnerAction]:
        """A call to ``shard`` got no answer; ``folded``: the fragment whose contribution was folded, if any."""
        silent = self._silent.setdefault(shard, _Silent(now, joined))
        if folded is not None:
            silent.folded += 1
            self._carries_fold.add(folded)
        return self._declare(shard, silent, now)

    def _declare(self, shard: int, silent: _Silent, now: float) -> list[LearnerAction]:
        if silent.next_summary_s is not None or now - silent.since_s < OUTAGE_AFTER_S:
            return []
        silent.next_summary_s = now + OUTAGE_SUMMARY_S
        return [Outage(shard, OutagePhase.BEGAN, now - silent.since_s, silent.folded, silent.joined)]

    def answered(self, shard: int, now: float, step: int) -> list[LearnerAction]:
        """``shard`` answered (accepted, refused or admitted): an outage ends, and the starvation
        count starts again from ``step``."""
        self._answered_at_step = step
        silent = self._silent.pop(shard, None)
        if silent is None or silent.next_summary_s is None:
            return []
        self._accepted_at_step = max(self._accepted_at_step, step)
        return [Outage(shard, OutagePhase.ENDED, now - silent.since_s, silent.folded, silent.joined)]

    def outages(self, now: float) -> list[LearnerAction]:
        """An outage that began (no answer for ``OUTAGE_AFTER_S``), or a summary of one that has
        lasted another ``OUTAGE_SUMMARY_S``."""
        actions: list[LearnerAction] = []
        for shard, silent in sorted(self._silent.items()):
            if silent.next_summary_s is None:
                actions += self._declare(shard, silent, now)
            elif now >= silent.next_summary_s:
                silent.next_summary_s = now + OUTAGE_SUMMARY_S
                actions.append(Outage(shard, OutagePhase.ONGOING, now - silent.since_s, silent.folded, silent.joined))
        return actions

    @property
    def unreachable(self) -> bool:
        """Some shard has been declared unreachable."""
        return any(s.next_summary_s is not None for s in self._silent.values())

    def check(self, step: int, now: float, *, training: bool, rejoining: bool) -> list[LearnerAction]:
        """What to say at ``step`` while ``training``: starved (the synchronizer answers, not while
        ``rejoining``: its work waits for the new state; a synchronizer that answers nothing is an
        outage, said by ``outages``), behind."""
        if not training:
            return []
        self._pace.at(step, now)
        actions: list[LearnerAction] = []
        unaccepted = step - self._accepted_at_step
        # Answering: something was answered since the last acceptance, and no call has gone
        # unanswered for two heartbeats since. Else the first seconds of an outage, before it is
        # declared, read as a starved link: a learner said so 4 s into a synchronizer's restart.
        answering = (self._answered_at_step > self._accepted_at_step
                     and all(now - s.since_s <= 2 * self.heartbeat_s for s in self._silent.values()))
        if (answering and not rejoining and not self.starved
                and starved(unaccepted, now - self._accepted_at_s, self.period, self.lease_s)):
            self.starved = True
            actions.append(Starved(unaccepted))
        if len(self._carried) == self._carried.maxlen:
            mean = sum(self._carried) / len(self._carried)
            if not self.behind and mean >= BEHIND_AT * self.period:
                self.behind = True
                step_s, fastest_s = self._pace.step_s, self._pace.fastest_s
                actions.append(Behind(mean, self.period, step_s, fastest_s,
                                      cpu_bound=0 < fastest_s and step_s >= CPU_SLOW_AT * fastest_s,
                                      on_loopback=self.on_loopback))
            elif self.behind and mean < CAUGHT_UP_AT * self.period:
                self.behind = False
        return actions
