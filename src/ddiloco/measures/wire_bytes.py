"""Bytes on the wire, counted the same way by the virtual cluster and the gRPC runtime.

Each driver counts bytes per learner, fragment and direction into a :class:`ByteLedger`; a
message's framing is the driver's to add (the runtime's 5-byte gRPC prefix, the simulator's
nominal header). Data parallel's bytes per step are defined here too.
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any


class Direction(enum.StrEnum):
    UP = "up"
    """Learner to synchronizer."""
    DOWN = "down"


@dataclass(slots=True)
class ByteLedger:
    """Bytes on the wire per (learner, fragment, direction); fragment -1 is control traffic."""

    counts: Counter[tuple[str, int, str]] = field(default_factory=Counter)

    def add(self, learner: str, fragment: int, direction: Direction, num_bytes: int) -> None:
        self.counts[(learner, fragment, str(direction))] += num_bytes

    def total(self, direction: Direction) -> int:
        return sum(n for (_, _, d), n in self.counts.items() if d == direction)

    def by(self, index: int, direction: Direction) -> dict[Any, int]:
        """Totals by learner (``index`` 0) or by fragment (1) in one direction."""
        out: dict[Any, int] = defaultdict(int)
        for key, n in self.counts.items():
            if key[2] == direction:
                out[key[index]] += n
        return dict(out)

    def rename(self, learner: str, to: str) -> None:
        """Fold a learner's counts into another key (a learner the registry forgot)."""
        for key in [k for k in self.counts if k[0] == learner]:
            self.counts[(to, *key[1:])] += self.counts.pop(key)

    def state_dict(self) -> list[list[Any]]:
        return [[learner, fragment, direction, n] for (learner, fragment, direction), n in self.counts.items()]

    def load_state_dict(self, rows: list[list[Any]]) -> None:
        self.counts = Counter({(str(a), int(b), str(c)): int(n) for a, b, c, n in rows})


BF16_BYTES = 2
"""Data parallel all-reduces its gradients in bf16."""


def all_reduce_bytes(numel: int, world: int) -> float:
    """Bytes one rank sends (and receives) per step in a ring all-reduce of ``numel`` bf16 values
    among ``world`` ranks; nothing for a world of one."""
    return 2 * (world - 1) / world * numel * BF16_BYTES if world > 1 else 0.0
