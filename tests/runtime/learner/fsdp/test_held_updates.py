"""A sharded learner's rank holds each update in its link's in slot until every rank can apply it.

The slot is the link's: while the rank holds it, its helper may not write the fragment's next
update there, and once the rank let it go its memory is given back (no process's resident set
counts it between updates). Every way an update leaves the rank's hands lets its slot go: applied,
stale, replaced, cleared, or copied out for a join's catch-up, which needs several versions of one
fragment at once.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

from ddiloco.core.shared.messages import FragmentUpdate
from ddiloco.runtime.learner.fsdp.held_updates import HeldUpdates, Received, catch_up
from ddiloco.runtime.learner.slots import Slot, SlotArea, SlotLayout


def rss_shmem_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


def test_a_slot_given_back_frees_its_memory_and_reads_zeros() -> None:
    slots = SlotArea(SlotLayout((64,), (32 << 20,)))
    seq = slots.write(Slot.IN, 0, np.full(8 << 20, 1.5, dtype=np.float32))
    assert float(slots.view(Slot.IN, 0, seq).view(np.float32)[-1]) == 1.5
    before = rss_shmem_kb()
    slots.give_back(Slot.IN, 0)
    assert before - rss_shmem_kb() >= 30 << 10  # the 32 MiB slot's pages left this process
    assert not slots.view(Slot.IN, 0, seq)[mmap.PAGESIZE:-mmap.PAGESIZE].any()  # its whole pages read as zeros


class Slots:
    """Releases counted per update version (what a rank's link would do with its in slot)."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def received(self, fragment: int, version: int, value: float, incarnation: int = 1) -> Received:
        update = FragmentUpdate(fragment, version, "fp32", b"", incarnation)
        return Received(update, torch.full((4,), value), release=lambda: self.released.append(version))


def test_an_applied_update_lets_its_slot_go_and_only_then() -> None:
    slots, held = Slots(), HeldUpdates(1)
    held.add([slots.received(0, 1, 0.5)])
    assert held.reach([0], 1) == [(1, False)] and slots.released == []
    (r,) = held.take(0, 0, 1)
    assert slots.released == []  # taken, not yet applied: the values are still the slot's
    r.done()
    assert slots.released == [1]


def test_stale_replaced_and_cleared_updates_let_their_slots_go() -> None:
    slots, held = Slots(), HeldUpdates(2)
    held.add([slots.received(0, 1, 0.5), slots.received(1, 1, 0.5, incarnation=7)])
    held.reach([0, 0], 1)  # fragment 1's update is another synchronizer's: dropped
    assert slots.released == [1]
    held.add([slots.received(0, 1, 0.25)])  # the same version again (a resubscribed stream)
    assert slots.released == [1, 1]
    held.clear()
    assert slots.released == [1, 1, 1]


def test_a_catch_up_copies_held_updates_out_of_their_slots_and_sums_them() -> None:
    slots, held = Slots(), HeldUpdates(1)
    held.add([slots.received(0, 1, 0.5)])
    held.own()
    assert slots.released == [1]  # the slot is free for version 2, which the catch-up needs too
    held.add([slots.received(0, 2, 0.25)])
    values = catch_up(torch.zeros(4), held.take(0, 0, 2))
    assert torch.equal(values, torch.full((4,), 0.75))
    assert slots.released == [1, 2]
