"""Virtual links: a message costs latency + bits / bandwidth, every byte is counted, and the
adversary may lose, duplicate or delay it.

Each learner has a FIFO uplink and downlink to the synchronizer. A message normally arrives
in order; a *delay spike* holds one back so later ones overtake it (reordering); a *loss*
drops it; a *duplicate* delivers it twice; a *partition* drops everything on the learner's
links while it lasts (checked when the message leaves and when it would arrive); a *stall*
lets a learner's uploads start and never finish (:meth:`Network.header`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ddiloco.measures.wire_bytes import ByteLedger, Direction
from ddiloco.settings.fault_kinds import FaultKind

HEADER_BYTES = 64
"""Fixed per-message framing (ids, versions, counters) added to every payload."""


@dataclass(slots=True)
class VirtualLink:
    """One direction of a learner's connection: messages serialize in FIFO order."""

    bandwidth_bps: float
    latency_s: float
    busy_until_s: float = 0.0

    def send(self, now: float, num_bytes: int) -> float:
        """Queue ``num_bytes`` at ``now``; return the arrival time at the other end."""
        start = max(now, self.busy_until_s)
        self.busy_until_s = start + 8.0 * num_bytes / self.bandwidth_bps
        return self.busy_until_s + self.latency_s


@dataclass(frozen=True, slots=True)
class NetFaults:
    """Per-message fault probabilities (``faults.loss``, ``duplicate``, ``reorder``)."""

    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_delay_s: float = 2.0
    until_s: float = float("inf")
    """The adversary stops here (the end of the safety phase of ``ddiloco simtest``)."""


class Network:
    """The links of every learner, with the adversary's per-message faults.

    ``deliveries`` returns the arrival times of one message: none (lost), one, or two
    (duplicated). Draws come from one seeded stream in event order, so a run is reproducible.
    """

    def __init__(self, learners: list[str], *, bandwidth_bps: float, latency_s: float, faults: NetFaults,
                 seed: int, bytes_counter: ByteLedger) -> None:
        self._links = {(name, d): VirtualLink(bandwidth_bps, latency_s) for name in learners for d in Direction}
        self.faults = faults
        self.bytes = bytes_counter
        self.injected: Counter[FaultKind] = Counter()
        self._rng = np.random.default_rng(np.random.SeedSequence([seed, 0x4E37]))
        self._partitioned_until: dict[str, float] = {}
        self._stalled_until: dict[str, float] = {}

    def reset(self, learner: str, now: float) -> None:
        """A restarted process opens fresh connections: nothing queued on its links."""
        for d in Direction:
            self._links[(learner, d)].busy_until_s = now

    def left_at(self, learner: str, direction: Direction) -> float:
        """When the last message queued on ``learner``'s link in ``direction`` has been sent (its
        latency not counted)."""
        return self._links[(learner, direction)].busy_until_s

    def set_latency(self, learner: str, latency_s: float) -> None:
        """One learner's link gets its own one-way latency, both ways (a cross-region learner)."""
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        for d in Direction:
            self._links[(learner, d)].latency_s = latency_s

    def partition(self, learner: str, until_s: float) -> None:
        self._partitioned_until[learner] = max(until_s, self._partitioned_until.get(learner, 0.0))

    def partitioned(self, learner: str, t: float) -> bool:
        return t < self._partitioned_until.get(learner, 0.0)

    def stall(self, learner: str, until_s: float) -> None:
        self._stalled_until[learner] = max(until_s, self._stalled_until.get(learner, 0.0))

    def stalled(self, learner: str, now: float) -> bool:
        """Do ``learner``'s uploads stall after their header now?"""
        return now < self._stalled_until.get(learner, 0.0)

    def header(self, learner: str, fragment: int, now: float) -> float | None:
        """A stalled upload's header, leaving at ``now``: when it arrives (None: lost to a
        partition). Only its bytes travel, beside the link's queue: a black hole swallows the
        body's large packets and lets the small ones pass."""
        self.bytes.add(learner, fragment, Direction.UP, HEADER_BYTES)
        arrival = now + self._links[(learner, Direction.UP)].latency_s
        return None if self.partitioned(learner, now) or self.partitioned(learner, arrival) else arrival

    def deliveries(self, learner: str, direction: Direction, fragment: int, payload_bytes: int,
                   now: float) -> list[float]:
        """Count the bytes, apply the faults; return when (and how often) the message arrives."""
        size = payload_bytes + HEADER_BYTES
        self.bytes.add(learner, fragment, direction, size)
        arrival = self._links[(learner, direction)].send(now, size)
        if self.partitioned(learner, now) or self.partitioned(learner, arrival):
            return []
        f = self.faults
        if now >= f.until_s:
            return [arrival]
        if f.loss and self._rng.random() < f.loss:
            self.injected[FaultKind.LOSS] += 1
            return []
        if f.reorder and self._rng.random() < f.reorder:
            self.injected[FaultKind.REORDER] += 1
            arrival += float(self._rng.uniform(0.0, f.reorder_delay_s))
        times = [arrival]
        if f.duplicate and self._rng.random() < f.duplicate:
            self.injected[FaultKind.DUPLICATE] += 1
            times.append(arrival + float(self._rng.uniform(0.0, max(f.reorder_delay_s, 0.01))))
        return times
