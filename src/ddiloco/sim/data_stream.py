"""What each learner's data stream did across its restarts: batches trained again, skipped, merged twice.

A learner process resumes its data at the synchronizer's ``data_position`` (``core/sync_side/data_position.py``):
the batches before it reached every fragment of the global model. Counted here, from what the
run did rather than from what the protocol meant to do:

- ``batches_retrained``: batches a restarted process trained that an earlier process of the same
  learner had trained already (the stream went back from its furthest batch to the position);
- ``batches_skipped``: batches no process trained although a later one trained beyond them (the
  position ran ahead of the training: never, unless something is wrong);
- ``batches_merged_twice``: per learner, the most batches whose steps one fragment merged twice
  (from the merged contributions' step ranges): the work that reached the global model and was
  trained again, which the position bounds by about one period H per restart.
"""

from __future__ import annotations

from collections import defaultdict


class DataStreams:
    def __init__(self, learners: int) -> None:
        self._furthest = [0] * learners
        """Per learner, one past the furthest batch any of its processes trained."""
        self.retrained = [0] * learners
        self.skipped = [0] * learners
        self.resumes: list[tuple[int, int, int]] = []
        """(learner, batch it resumed at, furthest batch trained before) of every process after the first."""
        self._merged: defaultdict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)

    def resumed(self, m: int, batch: int) -> None:
        """A process of learner ``m`` trains batch ``batch`` first."""
        furthest = self._furthest[m]
        if furthest or batch:
            self.resumes.append((m, batch, furthest))
        self.retrained[m] += max(0, furthest - batch)
        self.skipped[m] += max(0, batch - furthest)

    def trained(self, m: int, batch: int) -> None:
        self._furthest[m] = max(self._furthest[m], batch + 1)

    def merged(self, m: int, fragment: int, first_step: int, last_step: int) -> None:
        """A round of ``fragment`` merged learner ``m``'s steps ``first_step..last_step`` (batches one lower)."""
        self._merged[(m, fragment)].append((first_step, last_step))

    def merged_twice(self, m: int) -> int:
        """The most steps of learner ``m`` one fragment merged more than once."""
        most = 0
        for (learner, _), spans in self._merged.items():
            if learner == m:
                most = max(most, _overlap(spans))
        return most

    def figures(self) -> dict[str, int]:
        learners = range(len(self._furthest))
        return {"batches_retrained": sum(self.retrained), "batches_skipped": sum(self.skipped),
                "batches_merged_twice": sum(self.merged_twice(m) for m in learners)}


def _overlap(spans: list[tuple[int, int]]) -> int:
    """Steps covered by more than one of the inclusive ranges ``spans`` (counted once each)."""
    events = sorted([(first, 1) for first, _ in spans] + [(last + 1, -1) for _, last in spans])
    depth, since, twice = 0, 0, 0
    for at, change in events:
        if depth >= 2:
            twice += at - since
        depth += change
        since = at
    return twice
