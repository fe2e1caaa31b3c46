"""A sharded learner's contributions as W slices: the synchronizer admits them once, whole, or not at all."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from protocol_helpers import SHAPES, local_step, make_cluster, step

from ddiloco.core.shared.actions import Accepted, Broadcast, Refused, RoundClosed, Tick
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import Contribution, RejectReason, Session
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.shared.slices import SliceSpec, fragment_slice
from ddiloco.core.sync_side.slice_assembly import SliceAssembler

SHAPE_OF = dict(SHAPES)
FP32 = ProtocolConfig(fragments=3, period=3, quorum=3, grace_max_s=5.0, lease_s=100.0, overlap=2,
                      space_rounds=False, codec="fp32", downlink_codec="fp32")


def slices_of(c: Contribution, shapes: list[tuple[int, ...]], world: int, codec_name: str = "fp32",
              values: torch.Tensor | None = None) -> list[Contribution]:
    """``c`` cut as the W ranks of a sharded learner would send it: each rank's values of Δ (``values``, or
    ``c``'s decoded payload), encoded on their own."""
    codec = get_codec(codec_name)
    numel = sum(math.prod(s) for s in shapes)
    whole = codec.decode(c.payload, numel) if values is None else values
    out = []
    for rank in range(world):
        spec = fragment_slice(shapes, rank, world)
        part = torch.cat([whole[a:a + n] for a, n in spec.ranges]) if spec.ranges else torch.empty(0)
        out.append(dataclasses.replace(c, slice=spec, payload=codec.encode(part)))
    return out


def fragment_shapes(plan, fragment: int) -> list[tuple[int, ...]]:
    return [SHAPE_OF[n] for n in plan.fragments[fragment].param_names]


def run(sharded: set[str], steps: int = 12, world: int = 2) -> tuple[list[torch.Tensor], dict]:
    """Three learners in lockstep against one synchronizer (quorum 3: every round closes when all are in);
    the learners in ``sharded`` send each contribution as ``world`` slices. Returns Θ and the counters."""
    plan, sync, cores, params = make_cluster(FP32, learners=3)
    now = 0.0
    for s in range(steps):
        now += 1.0
        actions = []
        for m, (core, p) in enumerate(zip(cores, params)):
            local_step(p, seed=1000 * s + m)
            for c in step(core, tokens=100, duration_s=1.0, now=now):
                parts = slices_of(c, fragment_shapes(plan, c.fragment), world) if core.learner_id in sharded else [c]
                for part in parts:
                    got = sync.handle(part, now)
                    assert isinstance(got[0], Accepted), got[0]
                    actions += got[1:]
                core.on_accepted(c, now)
        actions += sync.handle(Tick(), now)
        for a in actions:
            if isinstance(a, Broadcast):
                for core in cores:
                    if core.learner_id in a.recipients:
                        core.on_update(a.update, now)
    status = sync.status()
    assert sum(status.rounds_closed.values()) >= 6
    return [sync.value(i).clone() for i in sync.owned], dict(status.rejections)


def test_a_two_rank_learner_gives_the_global_model_of_an_unsharded_one_bit_for_bit():
    whole, refused_whole = run(sharded=set())
    sliced, refused_sliced = run(sharded={"l1"})
    assert refused_whole == refused_sliced == {}
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)


def test_three_ranks_some_without_rows_also_give_the_same_model():
    whole, _ = run(sharded=set(), steps=6)
    sliced, _ = run(sharded={"l0", "l2"}, steps=6, world=5)  # b1 (8 rows) in 5: ranks 4 holds none
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)


def _first_contributions(config: ProtocolConfig = FP32):
    plan, sync, cores, params = make_cluster(config, learners=3)
    out = []
    for m, (core, p) in enumerate(zip(cores, params)):
        for s in range(1, 4):
            local_step(p, seed=10 * m + s)
            for c in step(core, tokens=100, duration_s=1.0, now=1.0):
                if c.fragment == 1:
                    out.append(c)
    return plan, sync, out


def test_one_slice_is_never_merged_alone_and_expires_with_its_round_counted():
    plan, sync, (c0, c1, c2) = _first_contributions(dataclasses.replace(FP32, quorum=2))
    shapes = fragment_shapes(plan, 1)
    rank0, rank1 = slices_of(c1, shapes, 2)
    before = sync.value(1).clone()
    assert isinstance(sync.handle(rank0, 1.0)[0], Accepted)
    assert sync.pending_tokens() == 0  # held, not in the round
    sync.handle(c0, 1.0)
    actions = sync.handle(c2, 1.0) + sync.handle(Tick(), 100.0)
    (record,) = [a for a in actions if isinstance(a, RoundClosed)]
    assert sorted(m.learner_id for m in record.merged) == ["l0", "l2"]
    status = sync.status()
    assert status.rejections == {"slice_incomplete": 1}
    assert status.refused_steps == {"slice_incomplete": c1.steps}
    assert status.honest_refused_steps == c1.steps

    # The same round without l1 at all moves Θ exactly as this one did: no part of l1's Δ was merged.
    plan2, sync2, (d0, _, d2) = _first_contributions(dataclasses.replace(FP32, quorum=2))
    sync2.handle(d0, 1.0), sync2.handle(d2, 1.0), sync2.handle(Tick(), 100.0)
    assert not torch.equal(sync.value(1), before)
    assert torch.equal(sync.value(1), sync2.value(1))

    late = sync.handle(rank1, 101.0)[0]  # its sibling expired: refused, nothing merged
    assert isinstance(late, Refused) and late.reason is RejectReason.SLICE_INCOMPLETE
    assert sync.pending_tokens() == 0


def test_the_learner_is_counted_once_however_many_ranks():
    plan, sync, (c0, c1, c2) = _first_contributions()
    for part in slices_of(c1, fragment_shapes(plan, 1), 4):
        assert isinstance(sync.handle(part, 1.0)[0], Accepted)
    assert sync.pending_tokens() == c1.tokens
    assert sync.status().rejections == {}


@pytest.mark.parametrize("field, value", [("tokens", 99), ("steps", 2), ("base_version", 1), ("first_step", 7)])
def test_slices_that_disagree_are_a_members_fault(field: str, value: int):
    plan, sync, (_, c1, _) = _first_contributions()
    rank0, rank1 = slices_of(c1, fragment_shapes(plan, 1), 2)
    sync.handle(rank0, 1.0)
    bad = dataclasses.replace(rank1, **{field: value})
    reply = sync.handle(bad, 1.0)[0]
    assert isinstance(reply, Refused)
    if field == "base_version":  # a version the synchronizer never produced is refused before assembly
        assert reply.reason is RejectReason.FUTURE_VERSION
    else:
        assert reply.reason is RejectReason.SLICE_MISMATCH and f"{field}={value}" in reply.detail
    assert isinstance(sync.handle(rank1, 1.0)[0], Accepted)  # the honest sibling still completes the set
    assert sync.pending_tokens() == c1.tokens


def test_ranks_that_disagree_on_the_layout_are_refused_naming_the_rank():
    plan, sync, (_, c1, _) = _first_contributions()
    rank0, rank1 = slices_of(c1, fragment_shapes(plan, 1), 2)
    assert rank1.slice is not None
    shifted = SliceSpec(1, 2, tuple((a - 1, n) for a, n in rank1.slice.ranges))
    sync.handle(rank0, 1.0)
    reply = sync.handle(dataclasses.replace(rank1, slice=shifted), 1.0)[0]
    assert isinstance(reply, Refused) and reply.reason is RejectReason.SLICE_MISMATCH
    assert "rank 1's range" in reply.detail and "overlaps" in reply.detail
    assert sync.pending_tokens() == 0
    assert sync.status().rejections == {"slice_mismatch": 1}


def test_a_slice_twice_is_a_duplicate_and_a_wrong_size_is_refused():
    plan, sync, (_, c1, _) = _first_contributions()
    rank0, rank1 = slices_of(c1, fragment_shapes(plan, 1), 2)
    sync.handle(rank0, 1.0)
    assert sync.handle(rank0, 1.0)[0].reason is RejectReason.DUPLICATE
    short = dataclasses.replace(rank1, payload=rank1.payload[:-4])
    assert sync.handle(short, 1.0)[0].reason is RejectReason.BAD_SIZE


def test_a_newer_seq_ends_the_older_incomplete_set():
    plan, sync, (_, c1, _) = _first_contributions()
    rank0, _ = slices_of(c1, fragment_shapes(plan, 1), 2)
    sync.handle(rank0, 1.0)
    newer = [dataclasses.replace(p, seq=c1.seq + 1) for p in slices_of(c1, fragment_shapes(plan, 1), 2)]
    for part in newer:
        assert isinstance(sync.handle(part, 1.0)[0], Accepted)
    assert sync.pending_tokens() == c1.tokens
    assert sync.status().rejections == {"slice_incomplete": 1}


@pytest.mark.parametrize("codec_name, bits", [("int8", 8), ("int4", 4)])
def test_a_quantizing_codec_rounds_the_assembled_delta_once_more_within_half_a_step(codec_name: str, bits: int):
    shapes = [(40, 7), (33,), (9, 5)]
    numel = sum(math.prod(s) for s in shapes)
    delta = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    codec = get_codec(codec_name)
    c = Contribution("l1", Session(0, 0), 0, 0, 0, 10, 1, 0.0, 0.0, codec_name, codec.encode(delta))
    whole, ended = None, []
    assembler = SliceAssembler()
    for part in slices_of(c, shapes, 3, codec_name, values=delta):
        whole, ended = assembler.add(part, numel, codec)
    assert whole is not None and ended == [] and whole.slice is None
    step = float(delta.abs().max()) / (2 ** (bits - 1) - 1)  # one quantization step at the largest block scale
    sliced_error = float((codec.decode(whole.payload, numel) - delta).abs().max())
    assert sliced_error <= step  # two roundings of at most half a step each
    assert float((codec.decode(c.payload, numel) - delta).abs().max()) <= step / 2
