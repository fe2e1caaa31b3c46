"""A learner's standing with one synchronizer shard: its session, lease upkeep and join retries.

The synchronizer may be sharded by fragment (shard i owns the fragments p with
p mod shards = i): every shard is a synchronizer of its own, with its own incarnation,
registry and leases. A learner registers with each, heartbeats to each, and when it loses
its state at one shard it joins that shard again while it keeps exchanging the fragments
of the others. Unsharded runs have one shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco.core.shared.messages import Session

BACKOFF_START_S = 0.2
"""First wait before calling a synchronizer again that did not answer (or refused a join for now)."""
BACKOFF_MAX_S = 2.0


def backoff_after(delay_s: float) -> float:
    """The next wait: twice the last, at most ``BACKOFF_MAX_S`` (drivers may add jitter)."""
    return min(BACKOFF_MAX_S, delay_s * 2)


@dataclass(slots=True)
class ShardLink:
    session: Session | None = None
    joining: bool = False
    """A join is on its way (or will be retried); the shard's fragments are not sent meanwhile."""
    heartbeat_due_s: float | None = None
    join_retry_s: float | None = None
    backoff_s: float = BACKOFF_START_S
    data_position: int = 0
    """Where this shard's last admission said the learner's data resumes (``core/sync_side/data_position.py``)."""

    def start_join(self) -> None:
        self.joining = True
        self.heartbeat_due_s = self.join_retry_s = None

    def admitted(self, session: Session, now: float, data_position: int = 0) -> None:
        self.session = session
        self.data_position = data_position
        self.joining = False
        self.join_retry_s = None
        self.backoff_s = BACKOFF_START_S
        # At once: the lease began when the state was delivered, and on a slow link the last of
        # it reached us only now; the heartbeat also tells the synchronizer we hold the state.
        self.heartbeat_due_s = now

    def newer(self, session: Session) -> bool:
        """A later registration at the same incarnation (incarnations are ids: they have no order)."""
        held = self.session
        return held is None or (session.incarnation == held.incarnation and session.number > held.number)

    def retry_later(self, now: float) -> None:
        self.join_retry_s = now + self.backoff_s
        self.backoff_s = backoff_after(self.backoff_s)

    def heartbeat_due(self, now: float, interval_s: float) -> bool:
        """Is a heartbeat due now? (Moves the next one past ``now`` either way.)"""
        if self.heartbeat_due_s is None or now < self.heartbeat_due_s:
            return False
        self.heartbeat_due_s += interval_s * max(1, math.ceil((now - self.heartbeat_due_s) / interval_s))
        return True

    def quiet(self) -> None:
        self.heartbeat_due_s = self.join_retry_s = None
