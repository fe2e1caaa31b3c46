"""Each rank of a sharded learner receives its own slice of the state and of every update, never
another rank's nor a whole fragment (``runtime/sync/slice_parts.py``), under the session its rank 0
opened; an unsharded learner of the same run still receives everything whole."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Join, RejectReason, Session
from ddiloco.core.shared.slice_cut import cut_payload, decode_cut
from ddiloco.core.shared.slices import fragment_slice
from ddiloco.runtime.client import CallRefused, SyncClient
from ddiloco.runtime.sync.service import SyncService
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import wait_for


def tiny() -> object:
    return build_config(preset="tiny", overrides=("run.learners=2",))


def specs(sync: SyncService, world: int) -> list[list]:
    """Per rank, its slice of each fragment, from the served shapes (what a rank computes from its model)."""
    layout = sync.layout
    return [[fragment_slice([layout.shapes[n] for n in f.param_names], r, world) for f in layout.plan.fragments]
            for r in range(world)]


def cut(values: torch.Tensor, spec) -> torch.Tensor:
    return torch.cat([values[a:a + n] for a, n in spec.ranges])


def first_update(client: SyncClient, learner: str, session: Session, fragments: int,
                 part: tuple[int, int] | None = None) -> FragmentUpdate:
    """The first update the learner's (rank's) stream replays, read on a thread with a deadline."""
    stream = client.updates(learner, [0] * fragments, session, part)
    got: list[FragmentUpdate] = []
    reader = threading.Thread(target=lambda: got.append(next(iter(stream))), daemon=True)
    reader.start()
    reader.join(60)
    stream.cancel()
    assert got, "no update came"
    return got[0]


@pytest.mark.slow
def test_each_rank_receives_its_own_slice_of_the_state_and_of_each_update_and_nothing_more(inproc_sync):
    s = inproc_sync(tiny())
    sync, address = s.service, f"127.0.0.1:{s.port}"
    numel = [f.numel for f in sync.layout.plan.fragments]
    ranks = specs(sync, 2)
    whole, plain = SyncClient(address), SyncClient(address)
    rank0, rank1 = SyncClient(address), SyncClient(address)
    everything = whole.fetch_state()

    joined = rank0.join(Join("sharded", "boot-s"), part=(0, 2))  # rank 0 speaks for the learner
    session = joined.state.session
    assert session is not None
    fetched = rank1.fetch_state(learner_id="sharded", session=session, part=(1, 2))
    for r, state in ((0, joined.state), (1, fetched)):
        for frag, spec, full in zip(state.fragments, ranks[r], everything.fragments):
            assert frag.values.numel() == spec.numel < numel[frag.fragment]  # never a whole fragment
            assert torch.equal(frag.values, cut(full.values, spec))  # its own ranges, no one else's

    # A round merged from an unsharded learner and the sharded one's two slices.
    other = plain.join(Join("plain", "boot-p")).state.session
    int4 = get_codec("int4")
    delta = torch.linspace(-1e-3, 1e-3, numel[0])
    base = dict(fragment=0, base_version=0, seq=0, tokens=256, steps=1, compute_s=0.01, step_time_s=0.01,
                codec="int4")
    for r, client in ((0, rank0), (1, rank1)):  # the slices first: a round closing early cannot split them
        spec = ranks[r][0]
        client.contribute(Contribution(learner_id="sharded", session=session, payload=int4.encode(cut(delta, spec)),
                                       slice=spec, **base))
    plain.contribute(Contribution(learner_id="plain", session=other, payload=int4.encode(delta), **base))
    wait_for(lambda: sync.view.versions[0] >= 1, "the round of fragment 0 to close")

    update = first_update(plain, "plain", other, len(numel))
    downlink = get_codec(update.codec, block_size=sync.protocol.block_size)
    assert len(update.payload) == downlink.encoded_size(numel[0])  # the unsharded learner: whole
    values = downlink.decode(update.payload, numel[0])
    for r, client in ((0, rank0), (1, rank1)):
        mine = first_update(client, "sharded", session, len(numel), (r, 2))
        assert (mine.fragment, mine.version) == (update.fragment, update.version)
        assert mine.payload == cut_payload(downlink, update.payload, numel[0], ranks[r][0])
        assert len(mine.payload) < 0.6 * len(update.payload)
        assert torch.equal(decode_cut(downlink, mine.payload, numel[0], ranks[r][0]), cut(values, ranks[r][0]))


def test_a_rank_s_transfer_needs_the_session_and_the_world_its_rank_0_joined_with(inproc_sync):
    s = inproc_sync(tiny())
    address = f"127.0.0.1:{s.port}"
    rank0, rank1 = SyncClient(address), SyncClient(address)
    session = rank0.join(Join("sharded", "boot-s"), part=(0, 2)).state.session
    assert session is not None
    stale = dataclasses.replace(session, number=session.number + 1)
    with pytest.raises(CallRefused) as info:
        rank1.fetch_state(learner_id="sharded", session=stale, part=(1, 2))
    assert info.value.reason is RejectReason.UNKNOWN_LEARNER
    for part in ((1, 3), (2, 2)):  # another world than rank 0 declared; a rank outside its world
        with pytest.raises(CallRefused) as info:
            rank1.fetch_state(learner_id="sharded", session=session, part=part)
        assert info.value.reason is RejectReason.MALFORMED
