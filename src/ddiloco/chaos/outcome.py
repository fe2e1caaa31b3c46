"""What ``ddiloco chaos`` records while it runs: faults, status polls, restarts, and the outcome."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from ddiloco.chaos.schedule import Fault
from ddiloco.runtime.batch_log import ProcessBatches


@dataclass
class FaultRecord:
    """A scheduled fault and what became of it (times in seconds after the first join)."""

    fault: Fault
    started_s: float | None = None
    ended_s: float | None = None
    skipped: str = ""
    """Why nothing was injected (the target was not running), else empty."""


@dataclass(frozen=True)
class ShardCounts:
    """One synchronizer process's counters at one poll: each process checkpoints its own and a
    restart of it resumes from them, so they are totalled per process (``report.across_incarnations``)."""

    instance_id: str
    rejections: dict[str, int]
    registrations: dict[str, int]
    """Per learner, its registrations at this process (the status's own counter)."""
    refused_steps: dict[str, int] = field(default_factory=dict)
    """Steps of the contributions this process refused, by reason (``core/sync_side/refusals.py``)."""

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> ShardCounts:
        return cls(instance_id=status["instance_id"], rejections=dict(status["rejections"]),
                   registrations={lr["id"]: lr["registrations"] for lr in status["learners"]},
                   refused_steps=dict(status.get("refused_steps", {})))


@dataclass(frozen=True)
class Sample:
    """One poll of the synchronizer's status."""

    t_s: float
    """Seconds after the first join (negative before it)."""
    instance_id: str
    """Every shard's incarnation: a new one whenever any synchronizer process restarted."""
    phase: str
    versions: tuple[int, ...]
    alive: dict[str, bool]
    tokens: int
    grace_window_s: float
    longest_pause_s: float
    shards: tuple[ShardCounts, ...]
    """Each synchronizer process's counters, in shard order (one for an unsharded synchronizer)."""

    @classmethod
    def from_status(cls, t_s: float, status: dict[str, Any]) -> Sample:
        """One poll's sample from the (merged) status dict, as ``SyncClient.status_dict`` returns it."""
        return cls(t_s=t_s, instance_id=status["instance_id"], phase=status["phase"],
                   versions=tuple(f["version"] for f in status["fragments"]),
                   alive={lr["id"]: lr["alive"] for lr in status["learners"]}, tokens=status["tokens"],
                   grace_window_s=status["grace"]["window_s"], longest_pause_s=status["longest_pause_s"],
                   shards=tuple(ShardCounts.from_status(s) for s in status.get("per_shard", [status])))


@dataclass
class LiveState:
    """What the live view shows after each poll."""

    clock_s: float
    """The schedule's clock (seconds since the first join while the synchronizer was up)."""
    window_s: float
    run_s: float
    phase: str
    faults_so_far: collections.Counter
    active: list[str]
    max_version: int
    alive: int
    learners: int
    sync_up: bool
    longest_pause_s: float
    status_url: str


@dataclass
class SyncRecovery:
    """One kill -9 of the synchronizer (or of one of its shards), and what the restarted one resumed
    from (times after the first join)."""

    target: str
    """``sync``, or ``sync-I`` for shard I."""
    killed_at_s: float
    versions_at_kill: tuple[int, ...]
    """Versions of the killed process's fragments at its last poll before the kill."""
    tokens_at_kill: int
    answering_at_s: float | None = None
    versions_resumed: tuple[int, ...] = ()
    """The checkpoint's versions, as the restarted synchronizer first reported them."""
    tokens_resumed: int = 0
    first_merge_after_s: float | None = None
    """From answering again to its first merge: the restart's own pause."""

    @property
    def rounds_lost(self) -> int:
        """Versions merged before the kill that the restart did not restore (0 with the round log)."""
        return sum(max(0, a - b) for a, b in zip(self.versions_at_kill, self.versions_resumed))

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "killed_at_s": round(self.killed_at_s, 2),
                "answering_at_s": None if self.answering_at_s is None else round(self.answering_at_s, 2),
                "first_merge_after_s": None if self.first_merge_after_s is None else round(self.first_merge_after_s, 2),
                "versions_at_kill": list(self.versions_at_kill), "versions_resumed": list(self.versions_resumed),
                "rounds_lost": self.rounds_lost, "tokens_at_kill": self.tokens_at_kill,
                "tokens_resumed": self.tokens_resumed}


@dataclass
class ChaosOutcome:
    """Everything a report needs; times in seconds after the first join."""

    completed: bool
    failure: str
    records: list[FaultRecord]
    samples: list[Sample]
    sync_restarts: list[SyncRecovery]
    final_status: dict[str, Any]
    eval_loss: float | None
    wall_s: float
    status_url: str
    sync_names: tuple[str, ...] = ("sync",)
    proxy_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bytes per link and direction over the run (``--hosts netns``)."""
    connections_reset: int = 0
    stopped: str | None = None
    """The signal (SIGINT, SIGTERM) that stopped the run early, if one did."""
    batches: dict[str, list[ProcessBatches]] = field(default_factory=dict)
    """Per learner, what each of its processes trained, from its batch log (``runtime/batch_log.py``)."""

    def sync_down_of(self, target: str | None = None) -> list[tuple[float, float]]:
        """(killed, answering again) of every kill of ``target`` (None: any synchronizer process);
        one still down at the end lasts to the end."""
        end_s = max([s.t_s for s in self.samples] + [0.0])
        return [(r.killed_at_s, r.answering_at_s if r.answering_at_s is not None else end_s)
                for r in self.sync_restarts if target is None or r.target == target]

    @property
    def sync_down(self) -> list[tuple[float, float]]:
        return self.sync_down_of(None)

    @property
    def restart_pauses_s(self) -> list[float]:
        return [r.first_merge_after_s for r in self.sync_restarts if r.first_merge_after_s is not None]
