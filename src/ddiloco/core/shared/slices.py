"""Which part of a fragment's flat vector one rank of a sharded (FSDP2) learner holds.

A fragment travels as one flat vector: its parameters back to back, each flattened in row-major
order (``core/shared/fragments.py``). FSDP2 (``torch.distributed.fsdp.fully_shard``) places every
parameter as ``Shard(0)`` on a 1-D mesh of W ranks: rank r holds rows ``torch.chunk(rows, W)[r]``,
chunks of ⌈rows/W⌉ rows, so the last ranks hold fewer rows or none. Those rows are one contiguous
range of the flat vector, so a rank's *slice* of a fragment is one range per parameter, and it
follows from the parameter shapes and (rank, world) alone: no rank needs to ask another, and the
synchronizer needs no shapes — a contribution carries its ranges (:class:`SliceSpec`), and the W
slices of one contribution must tile the fragment exactly (:func:`check_tiling`), which also
catches ranks that disagree on the layout.

I/O-free and torch-free; ``tests/core/test_slices.py`` checks it against real ``fully_shard`` locals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_WORLD = 2**16
"""Ranks one learner may have (far beyond any job; bounds what a slice may claim)."""
MAX_RANGES = 2**16
"""Ranges one slice may carry (one per parameter of a fragment, adjacent ones merged)."""


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows rank ``rank`` of ``world`` holds under ``Shard(0)`` (``torch.chunk``)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}")
    chunk = -(-rows // world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """The part of one fragment a rank holds: ``ranges`` of ``(start, length)`` in the flat vector,
    sorted, non-empty, neither overlapping nor touching (adjacent ranges are one)."""

    rank: int
    world: int
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not (1 <= self.world <= MAX_WORLD and 0 <= self.rank < self.world):
            raise ValueError(f"slice rank {self.rank} of world {self.world}")
        if len(self.ranges) > MAX_RANGES:
            raise ValueError(f"slice of {len(self.ranges)} ranges (at most {MAX_RANGES})")
        end = -1
        for start, length in self.ranges:
            if length < 1 or start <= end:
                raise ValueError(f"slice ranges must be sorted, non-empty and apart: {(start, length)} after "
                                 f"end {end}")
            end = start + length

    @property
    def numel(self) -> int:
        """How many values the slice holds (the length of its payload's vector)."""
        return sum(length for _, length in self.ranges)

    @property
    def end(self) -> int:
        """One past its last index (0 for an empty slice)."""
        return self.ranges[-1][0] + self.ranges[-1][1] if self.ranges else 0


def fragment_slice(shapes: Sequence[Sequence[int]], rank: int, world: int) -> SliceSpec:
    """Rank ``rank``'s slice of a fragment whose parameters (in fragment order) have ``shapes``."""
    ranges: list[tuple[int, int]] = []
    offset = 0
    for shape in shapes:
        if not shape:
            raise ValueError("a 0-dimensional parameter has no rows to shard (FSDP2 refuses them too)")
        row = math.prod(shape[1:])
        start, stop = shard_rows(shape[0], rank, world)
        if stop > start and row:
            first, length = offset + start * row, (stop - start) * row
            if ranges and ranges[-1][0] + ranges[-1][1] == first:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
            else:
                ranges.append((first, length))
        offset += shape[0] * row
    return SliceSpec(rank, world, tuple(ranges))


def check_tiling(slices: Sequence[SliceSpec], numel: int) -> str | None:
    """Why the ``slices`` (one per rank, any order) do not cover ``[0, numel)`` exactly once (None: they do)."""
    worlds = {s.world for s in slices}
    if len(worlds) != 1:
        return f"slices name worlds {sorted(worlds)}"
    world = worlds.pop()
    ranks = sorted(s.rank for s in slices)
    if ranks != list(range(world)):
        return f"ranks {ranks} of world {world}"
    pieces = sorted((start, length, s.rank) for s in slices for start, length in s.ranges)
    covered = 0
    for start, length, rank in pieces:
        if start != covered:
            what = "overlaps" if start < covered else "leaves a gap before"
            return f"rank {rank}'s range at {start} {what} index {covered}"
        covered = start + length
    if covered != numel:
        return f"the slices cover {covered} of {numel} values"
    return None
