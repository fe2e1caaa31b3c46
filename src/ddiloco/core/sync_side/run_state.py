"""The run around the protocol: its budget, its phases and when to checkpoint.

Written once for every driver: the virtual cluster, the gRPC service and the launcher all
learn from the synchronizer when the budget is spent, when learners must stop and when the
run is over, instead of each keeping its own count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ddiloco.core.shared.deadlines import drain_after_stop_s
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.claims import ClaimLimits, ProgressLedger


class RunPhase(enum.StrEnum):
    WAITING = "waiting"
    """No learner has joined yet: the clock of a time budget has not started."""
    RUNNING = "running"
    STOPPING = "stopping"
    """Budget spent: learners were told to flush and leave; the last rounds are pending."""
    FINISHED = "finished"
    """Everything merged; new joins are refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunLimits:
    """When a run ends and how often the synchronizer's state is made durable."""

    tokens: int = 0
    """Stop once learners report this many trained tokens in all; 0 = no token budget."""
    time_s: float = 0.0
    """Stop this many seconds after the first join; 0 = no time budget."""
    drain_timeout_s: float = drain_after_stop_s(ProtocolConfig())
    """After the stop, how long to wait for learners to flush and leave before the last merge
    (the run's configuration gives its own protocol's, ``Config.run_limits``)."""
    checkpoint_every_rounds: int = 0
    """Checkpoint after this many merged rounds (0 = never by count)..."""
    checkpoint_every_s: float = 0.0
    """... or this many seconds after the previous checkpoint, if rounds were merged (0 = never)."""
    learners: int = 0
    """M, the run's learners: their data shards, and four times as many may hold a lease at once
    (0: no cap; a data shard is then a learner's trailing number, else 0)."""

    def validate(self) -> None:
        if min(self.tokens, self.time_s, self.checkpoint_every_rounds, self.checkpoint_every_s, self.learners) < 0:
            raise ConfigError(f"run limits must be >= 0: {self}")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain timeout must be >= 0, got {self.drain_timeout_s}")

    @property
    def max_learners(self) -> int:
        """Leases held at once: four times M (a cluster re-registering after a blip, restarts)."""
        return 4 * self.learners

    @property
    def checkpoints(self) -> bool:
        return bool(self.checkpoint_every_rounds or self.checkpoint_every_s)


@dataclass(slots=True)
class RunState:
    """Phase, counted progress and checkpoint schedule of one run (part of the checkpoint)."""

    limits: RunLimits
    progress: ProgressLedger
    """Counted tokens per learner (only what its claims could plausibly hold)."""
    phase: RunPhase = RunPhase.WAITING
    started_at_s: float | None = None
    stopped_at_s: float | None = None
    earlier_elapsed_s: float = 0.0
    """Seconds the run ran in previous incarnations (a time budget spans restarts)."""
    rounds_since_checkpoint: int = 0
    last_checkpoint_s: float | None = None

    @classmethod
    def new(cls, limits: RunLimits, claims: ClaimLimits) -> "RunState":
        return cls(limits, ProgressLedger(claims))

    @property
    def tokens(self) -> int:
        return self.progress.tokens

    def start(self, now: float) -> None:
        if self.phase is RunPhase.WAITING:
            self.phase = RunPhase.RUNNING
            self.started_at_s = now - self.earlier_elapsed_s
            self.last_checkpoint_s = now

    def budget_spent(self, now: float) -> bool:
        if self.phase is not RunPhase.RUNNING:
            return False
        limits = self.limits
        if limits.tokens and self.tokens >= limits.tokens:
            return True
        # The same sum as in ``deadline()``: a tick at the deadline must find the budget spent.
        return bool(limits.time_s) and self.started_at_s is not None and now >= self.started_at_s + limits.time_s

    def deadline(self) -> float | None:
        """When the run's clock next needs the synchronizer's attention."""
        if self.phase is RunPhase.RUNNING and self.limits.time_s and self.started_at_s is not None:
            return self.started_at_s + self.limits.time_s
        if self.phase is RunPhase.STOPPING and self.stopped_at_s is not None:
            return self.stopped_at_s + self.limits.drain_timeout_s
        return None

    def drain_due(self, now: float, alive: int) -> bool:
        return self.phase is RunPhase.STOPPING and (
            alive == 0 or (self.stopped_at_s is not None and now >= self.stopped_at_s + self.limits.drain_timeout_s)
        )

    def checkpoint_due(self, now: float) -> bool:
        limits = self.limits
        if not limits.checkpoints or self.rounds_since_checkpoint == 0:
            return False
        if limits.checkpoint_every_rounds and self.rounds_since_checkpoint >= limits.checkpoint_every_rounds:
            return True
        # The first one is due a period after the run began (not never: a large model's first
        # rounds may take longer than the time limit to reach the round limit).
        last = self.last_checkpoint_s if self.last_checkpoint_s is not None else self.started_at_s
        return bool(limits.checkpoint_every_s) and last is not None and now - last >= limits.checkpoint_every_s

    def elapsed_s(self, now: float) -> float:
        """Seconds the run's clock has counted, earlier incarnations included (it waits for the first join)."""
        if self.started_at_s is None:
            return self.earlier_elapsed_s
        end = now if self.stopped_at_s is None else min(now, self.stopped_at_s)
        return end - self.started_at_s

    def tokens_left(self) -> int:
        """Tokens the budget still allows (0 without a token budget, or once it is spent)."""
        return max(0, self.limits.tokens - self.tokens) if self.limits.tokens else 0

    def time_left_s(self, now: float) -> float:
        """Seconds the time budget still allows (0 without one, or once the run stops)."""
        if not self.limits.time_s or self.phase in (RunPhase.STOPPING, RunPhase.FINISHED):
            return 0.0
        return max(0.0, self.limits.time_s - self.elapsed_s(now))

    def state_dict(self, now: float) -> dict[str, Any]:
        return {
            "phase": str(self.phase),
            "elapsed_s": self.elapsed_s(now),
            # Per (learner, boot): reports are cumulative, so after a restart the learners'
            # next reports continue these totals instead of adding to them.
            "progress": self.progress.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase = RunPhase(state["phase"])
        if self.phase in (RunPhase.RUNNING, RunPhase.STOPPING):
            self.phase = RunPhase.WAITING  # the clock goes on when learners come back
        self.earlier_elapsed_s = float(state["elapsed_s"])
        self.progress.load_state_dict(state["progress"])
        self.started_at_s = self.stopped_at_s = None
        self.rounds_since_checkpoint = 0
