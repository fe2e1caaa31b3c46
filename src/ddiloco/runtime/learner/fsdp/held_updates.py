"""The updates one rank of a sharded learner received and its core has not applied yet.

Each rank follows its own update stream (its slices only), so the ranks receive an update at
different moments, and a rank's core may apply an update only at a step where every rank's core
applies it: the W cores must stay identical. So each rank holds what its stream brought, says at
every step how far it could go (``reach``: the last version of each fragment it holds without a
hole, after its core's), and all apply up to the smallest reach (``fsdp_runtime.py``). A hole
never fills (a stream sends in order and resumes after the last version it delivered), so a rank
that holds a later version without the next one has missed it: a ``gap``, which ends in a rejoin
for every rank at once, as a gap does for an unsharded learner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddiloco.core.shared.messages import FragmentUpdate


@dataclass(frozen=True, slots=True)
class Received:
    """An update of this rank's slices, as its stream brought it, and its values decoded by the
    rank's link helper (the training thread only adds them): decoding was ~70% of the time a sharded
    learner's step spent in ddiloco (py-spy, 21.2M model)."""

    update: FragmentUpdate
    values: torch.Tensor
    release: Callable[[], None] | None = None
    """The values are a view of the link's in slot, which the link may not write again (nor fill
    with the fragment's next update) until this is called: once applied or dropped (:meth:`done`).
    None: the values are the rank's own memory."""

    def done(self) -> None:
        if self.release is not None:
            self.release()

    def own(self) -> "Received":
        """The same update in memory of the rank's own, its slot given back to the link."""
        if self.release is None:
            return self
        mine = dataclasses.replace(self, values=self.values.clone(), release=None)
        self.release()
        return mine


class HeldUpdates:
    """Per fragment, received updates by version (one incarnation of the synchronizer's counts)."""

    def __init__(self, fragments: int) -> None:
        self._held: list[dict[int, Received]] = [{} for _ in range(fragments)]

    def add(self, received: Sequence[Received]) -> None:
        for r in received:
            old = self._held[r.update.fragment].get(r.update.version)
            if old is not None:
                old.done()
            self._held[r.update.fragment][r.update.version] = r

    def reach(self, versions: Sequence[int], incarnation: int) -> list[tuple[int, bool]]:
        """Per fragment, from the core's ``versions``: the last version held without a hole, and
        whether a later one is held (a gap). Updates of another incarnation or already applied go."""
        answer = []
        for p, held in enumerate(self._held):
            for v in [v for v, r in held.items() if v <= versions[p] or r.update.incarnation != incarnation]:
                held.pop(v).done()
            last = versions[p]
            while last + 1 in held:
                last += 1
            answer.append((last, any(v > last + 1 for v in held)))
        return answer

    def take(self, fragment: int, after: int, through: int) -> list[Received]:
        """The updates of ``fragment`` from version ``after + 1`` to ``through``, in order (let go here:
        the caller calls each one's ``done`` once it applied it)."""
        return [self._held[fragment].pop(v) for v in range(after + 1, through + 1)]

    def own(self) -> None:
        """Copy every held update out of the link's slots: a wait for several versions of one fragment
        (a join's catch-up) needs them all at once, and a slot holds one."""
        for held in self._held:
            for v, r in held.items():
                held[v] = r.own()

    def clear(self) -> None:
        for held in self._held:
            for r in held.values():
                r.done()
            held.clear()


def catch_up(values: torch.Tensor, updates: Sequence[Received]) -> torch.Tensor:
    """A slice's value moved through ``updates`` in order: the synchronizer's canonical value is the
    sum of the dequantized updates (``FragmentUpdate``), so this is its slice bit for bit."""
    for r in updates:
        values = values + r.values
        r.done()
    return values
