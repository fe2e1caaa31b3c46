"""What to break, when and for how long: fault kinds, a validated schedule, its TOML file, seeded schedules.

A schedule is data, checked once when it is built: every entry names a kind the tool can
inject, a target that exists in this run, non-negative times and positive rates. Times are
seconds after the run's first join (when the synchronizer's clock of a time budget starts),
so one schedule means the same thing however long the processes took to start.

A schedule file is TOML, one ``[[fault]]`` table per entry::

    [[fault]]
    time = 20.0           # seconds after the first join
    fault = "learner_crash"  # learner_crash, freeze, sync_crash, latency, bandwidth, reset, partition
    target = "learner-1"     # "sync" for sync_crash (the default there); "sync-I" for shard I of a sharded one
    duration = 4.0        # seconds down, frozen, or with the link degraded
    # delay_s = 0.2             latency: added one-way delay per direction
    # rate_bytes_per_s = 20000  bandwidth: the cap, per direction
    # restart = false           learner_crash: leave the learner down for the rest of the run
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.launch.placement import sync_names
from ddiloco.settings.config_sources import read_toml
from ddiloco.settings.fault_kinds import REAL, FaultKind, parse_kind

SYNC_TARGET = "sync"
_SHARD_TARGET = re.compile(r"sync-\d+")


def is_sync_target(target: str) -> bool:
    """``sync``, or ``sync-I`` (shard I when ``protocol.shards`` > 1): the launcher's names of synchronizers."""
    return target == SYNC_TARGET or _SHARD_TARGET.fullmatch(target) is not None


ENTRY_KEYS = ("time", "fault", "target", "duration", "delay_s", "rate_bytes_per_s", "restart")


def learner_name(index: int) -> str:
    """The launcher's learner ids; a schedule targets learners by them."""
    return f"learner-{index}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One scheduled fault; invalid values are refused when it is built."""

    at_s: float
    """When to inject it: seconds after the run's first join."""
    kind: FaultKind
    target: str
    """``learner-N``, or ``sync`` (``sync-I`` for shard I) for ``sync_crash``."""
    duration_s: float
    """Seconds down (learner_crash, sync_crash), frozen (freeze), or with the link degraded (network kinds)."""
    delay_s: float = 0.0
    """latency: one-way delay added per direction."""
    rate_bytes_per_s: float = 0.0
    """bandwidth: the cap per direction."""
    restart: bool = True
    """learner_crash: False leaves the learner down for the rest of the run (deliberately)."""

    def __post_init__(self) -> None:
        for name, value in (("time", self.at_s), ("duration", self.duration_s), ("delay_s", self.delay_s),
                            ("rate_bytes_per_s", self.rate_bytes_per_s)):
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{self.kind} fault: {name} must be a finite number >= 0, got {value}")
        if self.kind is FaultKind.SYNC_CRASH and not is_sync_target(self.target):
            raise ConfigError(f"sync_crash fault: target must be {SYNC_TARGET!r} (or 'sync-I', shard I), "
                              f"got {self.target!r}")
        if self.kind is not FaultKind.SYNC_CRASH and is_sync_target(self.target):
            raise ConfigError(f"{self.kind} fault: target must be a learner, got {self.target!r} "
                              "(only sync_crash targets the synchronizer)")
        if self.kind is FaultKind.LATENCY and self.delay_s <= 0:
            raise ConfigError(f"latency fault at {self.at_s:g}s: delay_s must be > 0")
        if self.kind is FaultKind.BANDWIDTH and self.rate_bytes_per_s <= 0:
            raise ConfigError(f"bandwidth fault at {self.at_s:g}s: rate_bytes_per_s must be > 0")
        if self.kind in (FaultKind.FREEZE, FaultKind.LATENCY, FaultKind.BANDWIDTH, FaultKind.PARTITION) \
                and self.duration_s <= 0:
            raise ConfigError(f"{self.kind} fault at {self.at_s:g}s: duration must be > 0")
        if not self.restart and self.kind is not FaultKind.LEARNER_CRASH:
            raise ConfigError(f"{self.kind} fault at {self.at_s:g}s: restart = false applies to learner_crash only")

    @property
    def end_s(self) -> float:
        """When the fault is over (the learner or synchronizer restarted, the link healed)."""
        return self.at_s + self.duration_s

    def describe(self) -> str:
        """One line for the live view and the timeline."""
        extra = {FaultKind.LATENCY: f" +{self.delay_s * 1000:.0f} ms",
                 FaultKind.BANDWIDTH: f" {self.rate_bytes_per_s / 1000:.1f} kB/s"}.get(self.kind, "")
        left = "" if self.restart else " (left down)"
        return f"{self.kind} {self.target}{extra} for {self.duration_s:.1f}s{left}"

    def to_dict(self) -> dict[str, Any]:
        """The entry as a schedule file would hold it (chaos.json keeps the schedule that ran)."""
        entry: dict[str, Any] = {"time": round(self.at_s, 3), "fault": str(self.kind), "target": self.target,
                                 "duration": round(self.duration_s, 3)}
        if self.kind is FaultKind.LATENCY:
            entry["delay_s"] = round(self.delay_s, 4)
        if self.kind is FaultKind.BANDWIDTH:
            entry["rate_bytes_per_s"] = round(self.rate_bytes_per_s)
        if not self.restart:
            entry["restart"] = False
        return entry


def check_targets(faults: list[Fault], learners: int, window_s: float, shards: int = 1) -> None:
    """Every target exists in a run of ``learners`` learners and ``shards`` synchronizer shards, and
    every fault is over within ``window_s``."""
    names = {learner_name(i) for i in range(learners)}
    syncs = sync_names(shards)
    for f in faults:
        if is_sync_target(f.target) and f.target not in syncs:
            raise ConfigError(f"{f.kind} fault at {f.at_s:g}s targets {f.target!r}, which does not exist "
                              f"(this run's synchronizer is {' .. '.join(dict.fromkeys([syncs[0], syncs[-1]]))})")
        if not is_sync_target(f.target) and f.target not in names:
            raise ConfigError(f"{f.kind} fault at {f.at_s:g}s targets {f.target!r}, which does not exist "
                              f"(this run has learner-0 .. learner-{learners - 1})")
        if f.end_s > window_s:
            raise ConfigError(f"{f.kind} fault at {f.at_s:g}s ends at {f.end_s:g}s, after --time {window_s:g}")


def load_schedule(path: str | Path) -> list[Fault]:
    """Read a schedule file; any mistake is one ConfigError naming the file and the entry."""
    path = Path(path)
    data = read_toml(path, "schedule")
    extra = sorted(set(data) - {"fault"})
    if extra:
        raise ConfigError(f"schedule file {path}: unknown top-level key {extra[0]!r} (expected [[fault]] tables)")
    entries = data.get("fault", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"schedule file {path}: 'fault' must be an array of tables ([[fault]])")
    faults = []
    for number, entry in enumerate(entries, 1):
        try:
            faults.append(_entry(entry))
        except ConfigError as err:
            raise ConfigError(f"schedule file {path}, fault {number}: {err}") from None
    return sorted(faults, key=lambda f: f.at_s)


def _entry(entry: dict[str, Any]) -> Fault:
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} (keys: {', '.join(ENTRY_KEYS)})")
    for key in ("time", "fault"):
        if key not in entry:
            raise ConfigError(f"missing key {key!r}")
    kind = parse_kind(str(entry["fault"]), REAL, "ddiloco chaos")
    target = entry.get("target", SYNC_TARGET if kind is FaultKind.SYNC_CRASH else None)
    if not isinstance(target, str):
        raise ConfigError(f"{kind} fault: target must be a learner id such as \"learner-0\", got {target!r}")
    numbers = {}
    for key in ("time", "duration", "delay_s", "rate_bytes_per_s"):
        value = entry.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{kind} fault: {key} must be a number, got {value!r}")
        numbers[key] = float(value)
    restart = entry.get("restart", True)
    if not isinstance(restart, bool):
        raise ConfigError(f"{kind} fault: restart must be true or false, got {restart!r}")
    return Fault(at_s=numbers["time"], kind=kind, target=target, duration_s=numbers["duration"],
                 delay_s=numbers["delay_s"], rate_bytes_per_s=numbers["rate_bytes_per_s"], restart=restart)


FIRST_FAULT_S = 5.0
"""The seeded schedule lets every learner join and contribute before the first fault."""
RECOVER_S = 8.0
"""Quiet seconds after a fault before the next one: the learner restarts and rejoins."""
SYNC_RECOVER_S = 12.0
"""After a synchronizer kill: it reloads its checkpoint and every learner joins again."""


def seeded_schedule(*, window_s: float, learners: int, lease_s: float, fragment_bytes: int,
                    seed: int, shards: int = 1) -> list[Fault]:
    """Faults one after another in [FIRST_FAULT_S, window_s]: every kind once (in a seeded order), then more.

    One fault at a time, each followed by a quiet spell, so at least one learner is always
    healthy and the pause bound (one grace window plus one lease) is the property under test,
    not an outage the schedule made unavoidable. Freezes outlast the lease (the learner must
    rejoin); partitions fall on both sides of it; bandwidth caps let a fragment's contribution
    (``fragment_bytes``) through in 0.5-2 s. A synchronizer sharded ``shards`` ways loses one
    shard, drawn at random, per sync_crash.
    """
    rng = random.Random(f"chaos-schedule-{seed}")
    kinds = list(REAL)
    rng.shuffle(kinds)
    faults: list[Fault] = []
    t = FIRST_FAULT_S
    while True:
        kind = kinds.pop(0) if kinds else rng.choice(REAL)
        fault = _draw(rng, kind, t, learners, lease_s, fragment_bytes, sync_names(shards))
        if fault.end_s > window_s:
            return faults
        faults.append(fault)
        t = fault.end_s + (SYNC_RECOVER_S if kind is FaultKind.SYNC_CRASH else RECOVER_S) + rng.uniform(0, 2)


def _draw(rng: random.Random, kind: FaultKind, at_s: float, learners: int, lease_s: float,
          fragment_bytes: int, syncs: list[str]) -> Fault:
    if kind is FaultKind.SYNC_CRASH:  # an unsharded run draws nothing here: its seeded schedules stay as they were
        target = syncs[0] if len(syncs) == 1 else rng.choice(syncs)
    else:
        target = learner_name(rng.randrange(learners))
    duration = {
        FaultKind.LEARNER_CRASH: rng.uniform(2.0, 6.0),
        FaultKind.FREEZE: rng.uniform(1.3, 1.8) * lease_s,
        FaultKind.SYNC_CRASH: rng.uniform(1.0, 3.0),
        FaultKind.LATENCY: rng.uniform(8.0, 15.0),
        FaultKind.BANDWIDTH: rng.uniform(8.0, 15.0),
        FaultKind.RESET: rng.uniform(0.0, 3.0),
        FaultKind.PARTITION: rng.uniform(0.5, 1.5) * lease_s,
    }[kind]
    return Fault(at_s=round(at_s, 2), kind=kind, target=target, duration_s=round(duration, 2),
                 delay_s=round(rng.uniform(0.05, 0.3), 3) if kind is FaultKind.LATENCY else 0.0,
                 rate_bytes_per_s=round(fragment_bytes / rng.uniform(0.5, 2.0))
                 if kind is FaultKind.BANDWIDTH else 0.0)
