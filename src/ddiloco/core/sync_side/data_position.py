"""How far each learner's data stream has reached the global model (its ``data_position``).

A learner numbers its inner steps by the batches of its own data stream: step k trains batch
k - 1, and a contribution covers the steps ``first_step .. last_step``. When a round merges,
the synchronizer notes, per learner id and fragment, the last step the merged contributions
covered. A learner's position is the minimum of that over the fragments (over every shard's
fragments, which the learner takes as the minimum of its shards' answers): every batch below
it reached every fragment of the global model. A learner that starts again resumes its data
there, so what reached the model is trained again for at most the spread between its
fragments (about one period H: fragments are sent H steps apart, staggered), and nothing that
did not reach it is skipped.

Only the furthest step counts, not whether the covered steps are contiguous: steps whose
contribution was dropped (measured from anchors the learner no longer held) never reach the
model whatever the learner does next, and a hole would otherwise hold the position back for
the rest of the run.

Positions outlive the registry's record of a learner (a learner forgotten after a long outage
still resumes where it was); at most ``MAX_LEARNERS_KEPT`` ids are kept, the ones merged least
recently dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Sequence

from ddiloco.core.shared.actions import MergedContribution

MAX_LEARNERS_KEPT = 65_536
"""Learner ids whose position a synchronizer remembers (a few integers each)."""


def reached_by(contributions: Iterable[MergedContribution]) -> tuple[tuple[str, int], ...]:
    """Per merged contribution, its learner and the last step it covered (what a round log records)."""
    return tuple((c.learner_id, c.first_step + c.steps - 1) for c in contributions)


class DataPositions:
    """Per learner id and owned fragment, the last step that merged contributions covered."""

    def __init__(self, fragments: Sequence[int]) -> None:
        self.fragments = tuple(fragments)
        self._reached: OrderedDict[str, dict[int, int]] = OrderedDict()

    def merged(self, fragment: int, contributions: Iterable[MergedContribution]) -> None:
        """A round of ``fragment`` merged these contributions."""
        self.reached(fragment, reached_by(contributions))

    def reached(self, fragment: int, steps: Iterable[tuple[str, int]]) -> None:
        """A round of ``fragment`` (merged now, or replayed from the round log) covered, per learner
        id, its steps up to the one given."""
        for learner_id, step in steps:
            reached = self._reached.setdefault(learner_id, {})
            reached[fragment] = max(reached.get(fragment, 0), step)
            self._reached.move_to_end(learner_id)
        while len(self._reached) > MAX_LEARNERS_KEPT:
            self._reached.popitem(last=False)

    def position(self, learner_id: str) -> int:
        """The batch at which ``learner_id``'s data resumes: all before it reached every owned fragment."""
        reached = self._reached.get(learner_id, {})
        return min((reached.get(p, 0) for p in self.fragments), default=0)

    def state_dict(self) -> dict[str, dict[str, int]]:
        return {name: {str(p): step for p, step in reached.items()} for name, reached in self._reached.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint from before positions were kept holds none: all 0)."""
        self._reached = OrderedDict((str(name), {int(p): int(step) for p, step in reached.items()})
                                    for name, reached in state.items())
