"""Every field of every protocol message survives the wire (``runtime/wire.py``), both ways.

Each message below sets every field of its dataclass to a value other than the field's
default, so a field added to ``core/shared/messages.py`` fails here until the test sets it, and then
until ``wire.py`` carries it both ways (the recipe in docs/design.md, "How to add a wire field").
"""

from __future__ import annotations

import dataclasses

import pytest

from ddiloco.core.shared.messages import (
    Contribution,
    FragmentUpdate,
    Heartbeat,
    Join,
    Leave,
    MergedRef,
    Progress,
    Session,
)
from ddiloco.core.shared.slices import SliceSpec
from ddiloco.runtime import wire
from ddiloco.runtime.proto import ddiloco_pb2 as pb

SESSION = Session(incarnation=0xBEEF, number=7)
PROGRESS = Progress("boot-2", tokens=4096, steps=3)


def contribution_round_trip(c: Contribution) -> Contribution:
    chunks = list(wire.contribution_chunks(c))
    header = pb.ContributionChunk.FromString(chunks[0].SerializeToString()).header
    return wire.contribution_from_pb(header, b"".join(chunk.data for chunk in chunks))


def update_round_trip(update: FragmentUpdate) -> FragmentUpdate | None:
    assembler, result = wire.UpdateAssembler(), None
    for chunk in wire.update_chunks(update):
        result = assembler.add(pb.Update.FromString(chunk))
    return result


MESSAGES = [
    (Join("learner-1", "boot-1", tokens_per_step=512), lambda m: wire.join_from_pb(wire.join_to_pb(m))),
    (Heartbeat("learner-1", SESSION, PROGRESS), lambda m: wire.heartbeat_from_pb(wire.heartbeat_to_pb(m))),
    (Leave("learner-1", SESSION, PROGRESS), lambda m: wire.leave_from_pb(wire.leave_to_pb(m))),
    (Contribution("learner-1", SESSION, fragment=2, base_version=5, seq=9, tokens=2048, steps=2, compute_s=1.5,
                  step_time_s=0.75, codec="int4", payload=bytes(range(256)) * 5000, first_step=11, progress=PROGRESS,
                  slice=SliceSpec(1, 3, ((4, 8), (20, 3)))),
     contribution_round_trip),
    (FragmentUpdate(fragment=3, version=6, codec="int4", payload=bytes(range(256)) * 9000, incarnation=0xBEEF,
                    round_age_s=0.25, merged=(MergedRef("learner-1", 7, 9), MergedRef("learner-2", 3, 0))),
     update_round_trip),  # several chunks: the merged list travels on the first
]


@pytest.mark.parametrize("message, round_trip", MESSAGES, ids=[type(m).__name__ for m, _ in MESSAGES])
def test_every_field_of_a_message_comes_back_from_the_wire(message, round_trip):
    for field in dataclasses.fields(message):
        assert getattr(message, field.name) != field.default, f"set {type(message).__name__}.{field.name} here"
    assert round_trip(message) == message


def test_a_slice_whose_starts_and_lengths_differ_in_number_is_a_wire_error():
    c = MESSAGES[3][0]
    header = wire.contribution_header(c)
    header.slice.lengths.append(5)
    with pytest.raises(wire.WireError, match="3 lengths"):
        wire.contribution_from_pb(header, c.payload)
    header.slice.starts.append(40)
    header.slice.rank = 3
    with pytest.raises(wire.WireError, match="rank 3 of world 3"):
        wire.contribution_from_pb(header, c.payload)


def test_a_state_received_is_held_once_not_twice_while_its_tensors_are_built() -> None:
    """A joining learner's peak: the chunks of a state and its values used to coexist until the last
    fragment was built (about twice the state). Each chunk now goes as it is copied: the peak of
    building the values is the state once, plus one fragment. (Allocations counted by tracemalloc,
    which sees numpy's buffers and protobuf's bytes alike; no timing.)"""
    import tracemalloc

    import numpy as np
    import torch

    from ddiloco.core.shared.messages import FragmentValue

    fragments = [FragmentValue(p, 3, torch.arange(2_000_000, dtype=torch.float32) + p) for p in range(3)]
    state_bytes = sum(4 * f.values.numel() for f in fragments)
    tracemalloc.start()
    try:
        assembler = wire.StateAssembler()
        for frag in fragments:
            for chunk in wire.fragment_chunks(frag):
                assembler.add(pb.StateChunk.FromString(chunk.SerializeToString()))
        tracemalloc.reset_peak()
        held, _ = tracemalloc.get_traced_memory()
        state = assembler.state()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held >= state_bytes  # the chunks
    assert peak - held < 1.1 * state_bytes / len(fragments)  # the values take the chunks' place, but one fragment
    for got, sent in zip(state.fragments, fragments):
        assert got.version == 3 and np.array_equal(got.values.numpy(), sent.values.numpy())
