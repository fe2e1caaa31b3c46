"""Exactly-once data up to one period: where a learner's data resumes (``core/sync_side/data_position.py``).

The synchronizer keeps, per learner id, the batch up to which every fragment's merged
contributions cover the learner's steps; a new process of that learner resumes there and
numbers its steps from it, with a sharded synchronizer at the minimum over the shards."""

from __future__ import annotations

import dataclasses

from protocol_helpers import deliver, join, local_step, make_cluster, make_params, make_sync, step

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    LogRound,
    MergedContribution,
    RoundClosed,
    SendJoin,
    StateDelivered,
)
from ddiloco.core.shared.messages import Heartbeat, RejectReason
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side import data_position
from ddiloco.core.sync_side.data_position import DataPositions

BASE = ProtocolConfig(fragments=3, period=3, quorum=1, lease_s=1e6, grace_max_s=1e-9)


def train(core, syncs, params, steps, *, first=1, drop_shard=None, logged=None):
    """``steps`` inner steps; each contribution goes to its shard (or is lost, for ``drop_shard``);
    returns, per fragment, the last step the merged rounds covered, and the first steps sent
    (``logged``: gets the rounds' round-log records)."""
    reached: dict[int, int] = {}
    sent: list[int] = []
    config = core.config
    for s in range(first, first + steps):
        local_step(params, seed=s)
        for c in step(core, 10, 0.5, now=float(s)):
            sent.append(c.first_step)
            shard = config.shard_of(c.fragment)
            if shard == drop_shard:
                core.on_undelivered(c, float(s), shard=shard)
                continue
            actions = syncs[shard].handle(c, float(s))
            assert isinstance(actions[0], Accepted), actions[0]
            core.on_accepted(c, float(s), shard=shard)
            if logged is not None:
                logged += [a for a in actions if isinstance(a, LogRound)]
            for rec in (a for a in actions if isinstance(a, RoundClosed)):
                reached[rec.fragment] = max([reached.get(rec.fragment, 0)] + [m.first_step + m.steps - 1
                                                                             for m in rec.merged])
            deliver(actions, [core], now=float(s))
    return reached, sent


def join_shards(core, syncs, now=0.0):
    """A fresh learner joins every shard; returns each shard's admission."""
    replies = []
    for send in core.start(now):
        assert isinstance(send, SendJoin)
        reply = syncs[send.shard].handle(send.message, now)[0]
        assert isinstance(reply, Admitted), reply
        core.on_admitted(syncs[send.shard].state_for(reply.state), now, shard=send.shard)
        syncs[send.shard].handle(StateDelivered(core.learner_id, reply.state.session), now)
        replies.append(reply)
    return replies


def test_position_is_the_least_step_every_fragment_merged_and_a_new_process_resumes_there():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    reached, _ = train(core, [sync], params, 8)
    assert set(reached) == {0, 1, 2} and len(set(reached.values())) > 1  # the fragments reached different steps
    position = min(reached.values())
    assert 0 < position <= core.step and max(reached.values()) - position <= BASE.period
    (status,) = sync.status().learners
    assert status.data_position == position

    again = Learner("l0", BASE, plan, make_params(1), boot="b0-second")
    (admitted,) = [a for a in join(again, sync, now=9.0) if isinstance(a, Admitted)]
    assert admitted.state.data_position == position
    assert again.next_batch == position  # before its first step: the batch it trains first
    _, first_steps = train(again, [sync], make_params(1), 4, first=9)
    assert first_steps and min(first_steps) == position + 1  # numbered across restarts by its data stream
    assert again.next_batch == position + again.step


def test_positions_survive_a_checkpoint_and_a_rejoin_gets_its_position_back():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    reached, _ = train(core, [sync], params, 7)
    position = min(reached.values())
    _, restored = make_sync(BASE, incarnation=7)
    restored.load_state_dict(sync.state_dict())
    assert [lr.data_position for lr in restored.status().learners] == [position]
    again = Learner("l0", BASE, plan, make_params(2), boot="b0-after-restore")
    (admitted,) = [a for a in join(again, restored, now=1.0) if isinstance(a, Admitted)]
    assert admitted.state.data_position == position == again.next_batch


def test_a_restart_moves_positions_as_the_rounds_it_replays_from_its_log_did():
    """Issue 56's soak: positions came back from the checkpoint alone, so after a synchronizer's
    restart a learner resumed as far back as the checkpoint and trained every batch merged since
    then again (11 batches beyond a period in 3 of 160 restarts)."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    train(core, [sync], params, 4)
    checkpoint = sync.state_dict()
    logged: list[LogRound] = []
    train(core, [sync], params, 9, first=5, logged=logged)
    (live,) = [lr.data_position for lr in sync.status().learners]
    _, restored = make_sync(BASE, incarnation=7)
    restored.load_state_dict(checkpoint)
    (at_checkpoint,) = [lr.data_position for lr in restored.status().learners]
    assert all(restored.replay_round(r.update, plain=r.plain, reached=r.reached) for r in logged)
    assert at_checkpoint < live and [lr.data_position for lr in restored.status().learners] == [live]
    again = Learner("l0", BASE, plan, make_params(2), boot="b0-after-the-restart")
    (admitted,) = [a for a in join(again, restored, now=20.0) if isinstance(a, Admitted)]
    assert admitted.state.data_position == live == again.next_batch


def test_a_running_learner_that_joins_again_keeps_numbering_its_own_stream():
    """Only a new process resumes at the synchronizer's position; one that merely registered
    again (its lease ran out) goes on from where it is, skipping nothing."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    train(core, [sync], params, 7)
    before = core.next_batch
    _, restarted = make_sync(BASE, incarnation=9)  # a synchronizer that lost everything
    actions = core.on_refused(Heartbeat(core.learner_id, core.session, core.progress), RejectReason.UNKNOWN_LEARNER, 8.0)
    (send,) = [a for a in actions if isinstance(a, SendJoin)]
    reply = restarted.handle(send.message, 8.0)[0]
    assert reply.state.data_position == 0
    core.on_admitted(restarted.state_for(reply.state), 8.0)
    assert core.next_batch == before == core.step


def test_with_shards_the_position_is_the_minimum_over_shards():
    config = dataclasses.replace(BASE, shards=2)
    plan, s0 = make_sync(config, shard=0)
    _, s1 = make_sync(config, shard=1)
    params = make_params()
    core = Learner("l0", config, plan, params, boot="first")
    join_shards(core, [s0, s1])
    reached, _ = train(core, [s0, s1], params, 6)
    reached |= train(core, [s0, s1], params, 6, first=7, drop_shard=1)[0]
    by_shard = [min(reached.get(p, 0) for p in s.owned) for s in (s0, s1)]
    assert [s.status().learners[0].data_position for s in (s0, s1)] == by_shard
    assert by_shard[0] > by_shard[1] > 0  # shard 1 heard nothing of the last six steps

    again = Learner("l0", config, plan, make_params(3), boot="second")
    replies = join_shards(again, [s0, s1], now=20.0)
    assert sorted(r.state.data_position for r in replies) == sorted(by_shard)
    assert again.next_batch == min(by_shard)


def test_positions_keep_the_furthest_step_per_fragment_and_a_bounded_number_of_ids():
    def mc(name, first, steps):
        return MergedContribution(name, 1, 0, 10 * steps, steps, 0.0, first, 0, 0.0)

    pos = DataPositions((0, 1))
    pos.merged(0, [mc("a", 1, 3), mc("b", 1, 2)])
    assert pos.position("a") == 0  # fragment 1 has merged nothing of it yet
    pos.merged(1, [mc("a", 4, 3), mc("a", 1, 3)])  # a late one covering less does not move it back
    assert pos.position("a") == 3 and pos.position("nobody") == 0
    copy = DataPositions((0, 1))
    copy.load_state_dict(pos.state_dict())
    assert copy.position("a") == 3 and copy.position("b") == 0
    saved, data_position.MAX_LEARNERS_KEPT = data_position.MAX_LEARNERS_KEPT, 2
    try:
        pos.merged(0, [mc("c", 1, 1)])
        assert set(pos.state_dict()) == {"a", "c"}  # "b" was merged least recently
    finally:
        data_position.MAX_LEARNERS_KEPT = saved
