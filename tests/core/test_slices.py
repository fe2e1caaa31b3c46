"""A rank's slice of a fragment (core/shared/slices.py), checked against what FSDP2 really places on it.

``fully_shard`` runs here on torch's fake process group: one process plays rank r of W, and FSDP2
cuts each parameter exactly as it would in a W-process job (initialization needs no traffic).
"""

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from ddiloco.core.shared.slices import SliceSpec, check_tiling, fragment_slice, shard_rows

SHAPES = st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5)


class _Params(torch.nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        offset = 0
        for i, shape in enumerate(shapes):
            n = math.prod(shape)
            # Each value is its own index in the flat fragment: a local shard names what it holds.
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.arange(offset, offset + n,
                                                                             dtype=torch.float32).view(shape)))
            offset += n


def _fsdp_local_indices(shapes: list[tuple[int, ...]], rank: int, world: int) -> list[int]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = _Params(shapes)
        fully_shard(model)
        return [int(v) for p in model.parameters() for v in p.to_local().reshape(-1).tolist()]
    finally:
        dist.destroy_process_group()


def _indices(spec: SliceSpec) -> list[int]:
    return [i for start, length in spec.ranges for i in range(start, start + length)]


@settings(max_examples=25, deadline=None)
@given(shapes=SHAPES, world=st.integers(1, 5))
def test_slice_is_what_fully_shard_places_on_each_rank(shapes: list[tuple[int, ...]], world: int) -> None:
    for rank in range(world):
        assert _indices(fragment_slice(shapes, rank, world)) == _fsdp_local_indices(shapes, rank, world)


@settings(max_examples=200, deadline=None)
@given(shapes=SHAPES, world=st.integers(1, 9))
def test_the_ranks_slices_tile_the_fragment(shapes: list[tuple[int, ...]], world: int) -> None:
    slices = [fragment_slice(shapes, rank, world) for rank in range(world)]
    numel = sum(math.prod(s) for s in shapes)
    assert check_tiling(slices, numel) is None
    assert check_tiling(list(reversed(slices)), numel) is None
    assert sum(s.numel for s in slices) == numel


def test_shard_rows_follows_torch_chunk() -> None:
    for rows in range(0, 12):
        for world in range(1, 6):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            got = [shard_rows(rows, r, world) for r in range(world)]
            expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
            assert [g for g in got if g[1] > g[0]] == expected


def test_adjacent_ranges_are_one() -> None:
    # world 1: the whole fragment in one range, whatever the parameters.
    assert fragment_slice([(3, 4), (5,), (2, 2)], 0, 1).ranges == ((0, 21),)
    # 7 rows in 3: 3, 3, 1; 3 rows: 1 each.
    assert fragment_slice([(7, 2), (3,)], 2, 3).ranges == ((12, 2), (16, 1))


@pytest.mark.parametrize("slices, numel, problem", [
    ([SliceSpec(0, 2, ((0, 4),)), SliceSpec(1, 2, ((3, 5),))], 8, "rank 1's range at 3 overlaps index 4"),
    ([SliceSpec(0, 2, ((0, 4),)), SliceSpec(1, 2, ((5, 3),))], 8, "rank 1's range at 5 leaves a gap before index 4"),
    ([SliceSpec(0, 2, ((0, 4),)), SliceSpec(1, 2, ((4, 3),))], 8, "the slices cover 7 of 8 values"),
    ([SliceSpec(0, 2, ((0, 4),)), SliceSpec(0, 2, ((4, 4),))], 8, "ranks [0, 0] of world 2"),
    ([SliceSpec(0, 2, ((0, 4),)), SliceSpec(1, 3, ((4, 4),))], 8, "slices name worlds [2, 3]"),
])
def test_tiling_names_what_is_wrong(slices: list[SliceSpec], numel: int, problem: str) -> None:
    assert check_tiling(slices, numel) == problem


@pytest.mark.parametrize("rank, world, ranges", [
    (2, 2, ()), (0, 0, ()), (0, 2, ((3, 0),)), (0, 2, ((4, 2), (1, 1))), (0, 2, ((0, 2), (2, 1))),
])
def test_a_bad_slice_is_refused_when_made(rank: int, world: int, ranges: tuple) -> None:
    with pytest.raises(ValueError):
        SliceSpec(rank, world, ranges)


def test_a_zero_dimensional_parameter_has_no_slice() -> None:
    with pytest.raises(ValueError, match="0-dimensional"):
        fragment_slice([(3,), ()], 0, 2)
