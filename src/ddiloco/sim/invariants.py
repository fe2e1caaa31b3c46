"""Invariants the virtual cluster checks all along a run (STYLE.md: simulation testing).

- a round never merges below the quorum required when it closed (except the final drain);
- versions of a fragment only increase, by one per round;
- every token accepted is merged exactly once, or still pending;
- a learner's anchor is always, bit for bit, a value the synchronizer produced at that version.

A violation raises :class:`InvariantViolation` naming the seed that reproduces it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from ddiloco.core.messages import Contribution, RoundClosed

if TYPE_CHECKING:
    from ddiloco.core.synchronizer import Synchronizer


class InvariantViolation(AssertionError):
    pass


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


class InvariantChecker:
    def __init__(self, *, seed: int) -> None:
        self.seed = seed
        self.tokens_accepted = 0
        self.tokens_merged = 0
        self._versions: dict[int, int] = {}
        self._values: dict[tuple[int, int], str] = {}

    def _fail(self, message: str) -> None:
        raise InvariantViolation(f"{message} (reproduce with seed {self.seed})")

    def on_accepted(self, c: Contribution) -> None:
        self.tokens_accepted += c.tokens

    def on_round(self, record: RoundClosed, sync: "Synchronizer") -> None:
        contributors = {m.learner_id for m in record.merged}
        if record.reason != "drain" and len(contributors) < record.quorum_required:
            self._fail(f"fragment {record.fragment} v{record.version} merged {len(contributors)} "
                       f"< quorum {record.quorum_required}")
        previous = self._versions.get(record.fragment, 0)
        if record.version != previous + 1:
            self._fail(f"fragment {record.fragment}: version {record.version} after {previous}")
        self._versions[record.fragment] = record.version
        self.tokens_merged += record.tokens
        self._values[(record.fragment, record.version)] = _digest(sync.value(record.fragment))

    def on_anchor(self, learner: str, fragment: int, version: int, anchor: torch.Tensor) -> None:
        if version == 0:
            return  # the initial value: every learner and the synchronizer build it from the seed
        expected = self._values.get((fragment, version))
        if expected is None:
            self._fail(f"{learner} holds fragment {fragment} v{version}, which was never produced")
        elif _digest(anchor) != expected:
            self._fail(f"{learner}'s anchor for fragment {fragment} v{version} differs from the global value")

    def at_end(self, sync: "Synchronizer") -> None:
        if self.tokens_accepted != self.tokens_merged + sync.pending_tokens():
            self._fail(f"tokens accepted {self.tokens_accepted} != merged {self.tokens_merged} "
                       f"+ pending {sync.pending_tokens()}")
