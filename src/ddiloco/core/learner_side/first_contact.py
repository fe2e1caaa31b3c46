"""Before a learner joins: how long it waits for a synchronizer that does not answer, when it says
so, when it gives up; and whether the synchronizers it reached are the shards of one run.

A learner may start before its synchronizer (a job script starts both at once): it probes the
synchronizer for the run's layout and configuration (a join that registers nothing) until it
answers, saying once that it waits, warning after ``OUTAGE_AFTER_S`` and every ``OUTAGE_SUMMARY_S``
since, and giving up only at its join timeout, if it has one. The driver makes the calls, sleeps
and writes the lines (``runtime/learner/connect.py``); whatever follows the probe — the join, its
retries and refusals — is :class:`~ddiloco.core.learner_side.learner_core.Learner`'s.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ddiloco.core.learner_side.link_watch import OUTAGE_AFTER_S, OUTAGE_SUMMARY_S
from ddiloco.core.shared.errors import ConfigError


class ProbeMove(enum.Enum):
    """What a learner does after a probe the synchronizer did not answer."""

    SAY_WAITING = "say_waiting"
    """The first time: one line, then wait."""
    WAIT = "wait"
    WARN = "warn"
    """Unanswered this long: a warning (is it running, is that its port?), then wait."""
    GIVE_UP = "give_up"
    """The join timeout would pass before the next probe."""


class ProbeWait:
    """One learner's wait for its synchronizer, from its first probe at ``started_s``."""

    def __init__(self, started_s: float, timeout_s: float | None = None) -> None:
        self.started_s = started_s
        self.deadline_s = None if not timeout_s else started_s + timeout_s
        """No limit for a timeout of 0 or None: a learner started before its synchronizer waits for it."""
        self._said = False
        self._warned_s: float | None = None

    def unanswered(self, now: float, delay_s: float) -> ProbeMove:
        """A probe went unanswered at ``now``: what to do before the next, ``delay_s`` later (the
        core's backoff from ``BACKOFF_START_S``, with the driver's jitter)."""
        if self.deadline_s is not None and now + delay_s > self.deadline_s:
            return ProbeMove.GIVE_UP
        if not self._said:
            self._said = True
            return ProbeMove.SAY_WAITING
        if now - self.started_s >= OUTAGE_AFTER_S and (self._warned_s is None
                                                       or now - self._warned_s >= OUTAGE_SUMMARY_S):
            self._warned_s = now
            return ProbeMove.WARN
        return ProbeMove.WAIT


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """What a synchronizer's probe says of the run it serves."""

    address: str
    run_sha256: str
    shards: int
    """How many shards the run's synchronizer has (1: not sharded)."""
    shard: int


def shard_order(headers: Sequence[ShardHeader]) -> list[int]:
    """The indices of ``headers`` in shard order, once they are the shards of one run, each once;
    otherwise a :class:`ConfigError` naming the addresses."""
    first = headers[0]
    for h in headers:
        if h.run_sha256 != first.run_sha256:
            raise ConfigError(f"the synchronizers at {first.address} and {h.address} serve different runs "
                              "(another model or configuration): they are not shards of one synchronizer")
    if {h.shards for h in headers} != {len(headers)}:
        raise ConfigError(f"the synchronizer at {first.address} is one of {first.shards} shard(s), but "
                          f"{len(headers)} address(es) were given: connect to every shard, each once")
    by_shard: dict[int, int] = {}
    for i, h in enumerate(headers):
        other = by_shard.setdefault(h.shard, i)
        if other != i:
            raise ConfigError(f"the synchronizers at {headers[other].address} and {h.address} both serve shard "
                              f"{h.shard}: they claim the same fragments")
    return [by_shard[s] for s in range(len(headers))]
