"""Virtual links: a message costs latency + bits / bandwidth, and every byte is counted."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

HEADER_BYTES = 64
"""Fixed per-message framing (ids, versions, counters) added to every payload."""


@dataclass(slots=True)
class Link:
    """One direction of a learner's connection: messages serialize in FIFO order."""

    bandwidth_bps: float
    latency_s: float
    busy_until_s: float = 0.0

    def send(self, now: float, num_bytes: int) -> float:
        """Queue ``num_bytes`` at ``now``; return the arrival time at the other end."""
        start = max(now, self.busy_until_s)
        self.busy_until_s = start + 8.0 * num_bytes / self.bandwidth_bps
        return self.busy_until_s + self.latency_s


@dataclass(slots=True)
class ByteCounter:
    """Bytes on the wire per (learner, fragment, direction); fragment -1 is control traffic."""

    counts: dict[tuple[str, int, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, learner: str, fragment: int, direction: str, num_bytes: int) -> None:
        self.counts[(learner, fragment, direction)] += num_bytes

    def total(self, direction: str) -> int:
        return sum(n for (_, _, d), n in self.counts.items() if d == direction)

    def by_fragment(self, direction: str) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for (_, frag, d), n in self.counts.items():
            if d == direction:
                out[frag] += n
        return dict(out)
