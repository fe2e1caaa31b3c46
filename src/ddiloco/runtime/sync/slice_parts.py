"""What one rank of a sharded (FSDP2) learner receives: its own slice of the state and of every update.

A request that names a part (``RankSlice``: rank r of W) gets each fragment cut to rank r's slice —
the ``Shard(0)`` rows of each parameter, computed here from the served layout's shapes
(``core/shared/slices.py``), the same ranges the learner computes from its model, so nothing but
(r, W) travels. The state's fp32 values are cut to those ranges; an update's encoded payload to
the bytes they need (``core/shared/slice_cut.py``). No rank receives another's slice or a whole
fragment, and the learner's uplink and downlink are both spread over its ranks.

The learner stays one voice: only rank 0 joins (its join names its part and declares W); the other
ranks' state fetches and update streams must name the session that join opened and the same W.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import FragmentUpdate, FragmentValue
from ddiloco.core.shared.slice_cut import cut_payload
from ddiloco.core.shared.slices import MAX_WORLD, SliceSpec, fragment_slice
from ddiloco.runtime.layout import ModelLayout
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.wire import WireError

Part = tuple[int, int]
"""(rank, world): the rank of a sharded learner a transfer is for."""


def part_of(msg: pb.JoinRequest | pb.UpdatesRequest | pb.FetchStateRequest) -> Part | None:
    """The part a request names (None: the whole state or update), or WireError for one that cannot be."""
    if not msg.HasField("part"):
        return None
    rank, world = msg.part.rank, msg.part.world
    if not (1 <= world <= MAX_WORLD and rank < world):
        raise WireError(f"part: rank {rank} of world {world}")
    return rank, world


class SliceParts:
    """Cuts fragments to parts, by the served layout (each rank's slice computed once)."""

    def __init__(self, layout: ModelLayout, block_size: int) -> None:
        self._shapes = [[layout.shapes[n] for n in f.param_names] for f in layout.plan.fragments]
        self._numel = [f.numel for f in layout.plan.fragments]
        self._block_size = block_size
        self.spec = lru_cache(maxsize=1024)(self._spec)
        self.worlds: dict[str, int] = {}
        """Each sharded learner's W, as its rank 0 declared it in its latest join."""

    def _spec(self, fragment: int, part: Part) -> SliceSpec:
        return fragment_slice(self._shapes[fragment], part[0], part[1])

    def check_world(self, learner: str, part: Part | None) -> None:
        """WireError unless ``part`` is of the W the learner's rank 0 joined with."""
        if part is not None and self.worlds.get(learner) != part[1]:
            raise WireError(f"part: rank {part[0]} of world {part[1]}, but {learner!r} joined with world "
                            f"{self.worlds.get(learner, 'none (not sharded)')}")

    def value(self, frag: FragmentValue, part: Part) -> FragmentValue:
        """The fragment's value at the part's ranges, back to back."""
        assert frag.values is not None
        ranges = self.spec(frag.fragment, part).ranges
        flat = frag.values.flatten()
        values = torch.cat([flat[a:a + n] for a, n in ranges]) if ranges else torch.empty(0)
        return FragmentValue(frag.fragment, frag.version, values)

    def update(self, update: FragmentUpdate, part: Part) -> FragmentUpdate:
        """The update with its payload cut to the bytes the part's ranges need."""
        codec = get_codec(update.codec, block_size=self._block_size)
        cut = cut_payload(codec, update.payload, self._numel[update.fragment], self.spec(update.fragment, part))
        return dataclasses.replace(update, payload=cut)
