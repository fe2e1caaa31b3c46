"""Batches a learner trained more than once across its restarts, and batches it skipped.

Issue 26's promise for a restarted learner: it resumes its data at the synchronizer's
``data_position`` (``core/sync_side/data_position.py``), so no batch is trained again beyond one period H
and none is skipped. The evidence is the learner's batch log (``runtime/batch_log.py``): where
each of its processes resumed (the position the synchronizer returned at its join) and the
last batch it trained before it was killed or stopped. From it, per learner:

- ``retrained``: batch trainings of a process that an earlier process of the learner had done
  already (a batch trained three times counts twice);
- ``retrained_beyond_period``: of those, what a process trained again beyond H, the allowance
  each restart has (the spread between the fragments' merged steps). A kill during an upload
  can exceed it honestly: the contribution lost in flight never reached the model, and the
  position then falls back to that fragment's previous round;
- ``skipped``: batches below where the stream got (the furthest batch trained, or the learner's
  last ``data_position`` if that is further) that no process trained: never, unless the position
  ran ahead of the training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ddiloco.runtime.batch_log import ProcessBatches


@dataclass(frozen=True)
class BatchCounts:
    """One learner's stream across its processes, and what :func:`count_batches` found in it."""

    processes: tuple[ProcessBatches, ...]
    data_position: int
    """The learner's position in the synchronizer's last status."""
    trained: int
    """Batch trainings over all its processes."""
    retrained: int
    retrained_beyond_period: int
    skipped: int

    def to_dict(self) -> dict[str, Any]:
        return {"processes": [[p.resumed_at, p.trained_to] for p in self.processes],
                "data_position": self.data_position, "trained": self.trained, "retrained": self.retrained,
                "retrained_beyond_period": self.retrained_beyond_period, "skipped": self.skipped}


def count_batches(processes: Sequence[ProcessBatches], period: int, data_position: int = 0) -> BatchCounts:
    """Count one learner's ``processes`` (in the order they ran) against the allowance ``period`` (H)."""
    covered: list[tuple[int, int]] = []
    """Disjoint, sorted [start, end) ranges some process trained so far."""
    retrained = beyond = 0
    for p in processes:
        again = sum(max(0, min(end, p.trained_to) - max(start, p.resumed_at)) for start, end in covered)
        retrained += again
        beyond += max(0, again - period)
        covered = _union(covered, (p.resumed_at, p.trained_to))
    reached = max([data_position] + [p.trained_to for p in processes])
    skipped = reached - sum(min(end, reached) - start for start, end in covered if start < reached)
    return BatchCounts(processes=tuple(processes), data_position=data_position,
                       trained=sum(p.trained_to - p.resumed_at for p in processes), retrained=retrained,
                       retrained_beyond_period=beyond, skipped=skipped)


def _union(ranges: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    """``ranges`` (disjoint, sorted) with ``new`` added, merged where they touch."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted([*ranges, new]):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
