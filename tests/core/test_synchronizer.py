"""The synchronizer state machine, driven directly with explicit time."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from protocol_helpers import BASE, closed, contributions_for, deliver, make_cluster, refused

from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    Broadcast,
    Checkpoint,
    Finished,
    LeaseExpired,
    StateDelivered,
    StopLearners,
    Tick,
)
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import Heartbeat, Join, Leave, Progress, Session
from ddiloco.core.sync_side.rounds import RoundPhase
from ddiloco.core.sync_side.run_state import RunLimits, RunPhase
from ddiloco.core.sync_side.synchronizer import Synchronizer


def test_every_request_gets_one_reply_first():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    actions = sync.handle(c, 1.0)
    assert isinstance(actions[0], Accepted) and actions[0].request is c
    beat = Heartbeat("l1", cores[1].session, cores[1].progress)
    assert isinstance(sync.handle(beat, 1.0)[0], Accepted)
    assert isinstance(sync.handle(Join("l9", "boot"), 1.0)[0], Admitted)


def test_round_waits_for_quorum_then_grace_then_closes_with_everyone_who_came():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    c0, c1, c2 = contributions_for(cores, params, fragment=1)
    assert closed(sync.handle(c0, 1.0)) == []  # below quorum K=2
    assert sync.status().round_phases[1] is RoundPhase.COLLECTING
    assert closed(sync.handle(c1, 1.5)) == []  # quorum reached: grace window opens
    assert sync.status().round_phases[1] is RoundPhase.GRACE
    deadline = sync.next_deadline()
    assert deadline is not None and 1.5 < deadline <= 1.5 + BASE.grace_max_s
    assert sync.handle(Tick(), deadline - 1e-6) == []
    actions = sync.handle(c2, deadline - 1e-6)  # the straggler makes it inside the window
    (record,) = closed(actions)
    assert record.reason == "all-live"
    assert {m.learner_id for m in record.merged} == {"l0", "l1", "l2"}
    assert sync.versions()[1] == 1
    assert sync.status().round_phases[1] is RoundPhase.IDLE


def test_grace_expiry_closes_without_the_straggler_whose_late_work_joins_next_round():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    c0, c1, c2 = contributions_for(cores, params, fragment=1)
    sync.handle(c0, 1.0)
    sync.handle(c1, 1.0)
    deadline = sync.next_deadline()
    actions = sync.handle(Tick(), deadline)
    (record,) = closed(actions)
    assert record.reason == "grace" and record.tokens == c0.tokens + c1.tokens
    assert closed(sync.handle(c2, deadline + 1)) == []  # late: pending for version 2, not dropped
    assert sync.pending_tokens() == c2.tokens
    # ... and it does not open round 2 on its own: only contributions from version 1 count
    assert sync.status().round_phases[1] is RoundPhase.COLLECTING
    assert sync.next_deadline() == min(learner.last_seen_s for learner in sync.status().learners) + BASE.lease_s
    deliver(actions, cores)
    (fresh,) = contributions_for(cores[:1], params[:1], fragment=1, seed=7)
    assert fresh.base_version == 1
    assert closed(sync.handle(fresh, deadline + 2)) == []  # K=2 fresh needed
    (fresh1,) = contributions_for(cores[1:2], params[1:2], fragment=1, seed=8)
    assert closed(sync.handle(fresh1, deadline + 3)) == []  # the quorum of fresh work: a grace window
    assert sync.status().round_phases[1] is RoundPhase.GRACE  # l2's late work does not stand in for its fresh work
    (record,) = closed(sync.handle(Tick(), sync.next_deadline()))
    assert record.reason == "grace"
    assert {m.learner_id for m in record.merged} == {"l0", "l1", "l2"}  # the late one rides along


def test_late_work_pending_does_not_close_a_round_before_its_learner_sends_fresh_work():
    """The phase trap: a learner whose every send arrives just after its round closed (its update
    not applied yet) has late work pending in each next round. If that late work counted as its
    learner being in, the next learner's fresh arrival would close every round at once and the
    late learner would stay one version behind for good (what 10 synchronizer restarts left
    behind: 61% of merged contributions late). It must wait, in a grace window, for fresh work."""
    config = dataclasses.replace(BASE, quorum=1)
    plan, sync, cores, params = make_cluster(config, learners=3)
    c0, c1, c2 = contributions_for(cores, params, fragment=1)
    sync.handle(c0, 1.0)
    now = sync.next_deadline()
    closing = sync.handle(Tick(), now)  # K=1: l0 alone, once its grace window ran out
    assert [r.reason for r in closed(closing)] == ["grace"]
    for late in (c1, c2):  # sent before version 1 reached them: pending for version 2
        assert closed(sync.handle(late, now)) == []
    deliver(closing, cores)
    fresh = {core.learner_id: contributions_for([core], [p], fragment=1, seed=20 + m)[0]
             for m, (core, p) in enumerate(zip(cores, params))}
    assert all(c.base_version == 1 for c in fresh.values())
    assert closed(sync.handle(fresh["l0"], now + 1)) == []  # l1 and l2 are in only with late work
    assert sync.status().round_phases[1] is RoundPhase.GRACE
    assert closed(sync.handle(fresh["l1"], now + 1.01)) == []
    (record,) = closed(sync.handle(fresh["l2"], now + 1.02))
    assert record.reason == "all-live"
    assert {(m.learner_id, m.base_version) for m in record.merged} == {("l0", 1), ("l1", 1), ("l2", 1)}


def test_merged_value_follows_token_weighted_rda_and_nesterov():
    config = dataclasses.replace(BASE, quorum=3, codec="fp32", downlink_codec="fp32")
    plan, sync, cores, params = make_cluster(config, learners=3)
    before = sync.value(1).clone()
    contribs = contributions_for(cores, params, fragment=1)
    actions = []
    for c in contribs:
        actions += sync.handle(c, 1.0)
    deltas = [get_codec("fp32").decode(c.payload, before.numel()).double() for c in contribs]
    w = torch.tensor([c.tokens**2 / c.steps for c in contribs], dtype=torch.float64)
    w /= w.sum()
    norms = torch.stack([d.norm() for d in deltas])
    direction = sum(wi * d / d.norm() for wi, d in zip(w, deltas))
    merged = (w @ norms) * direction / direction.norm()
    # first Nesterov step: buf = Δ, d = Δ + μΔ, Θ ← Θ − lr·d
    expected = before.double() - config.outer_lr * (1 + config.outer_momentum) * merged
    assert torch.allclose(sync.value(1).double(), expected, atol=1e-5)
    assert any(isinstance(a, Broadcast) and a.update.version == 1 for a in actions)


def test_learners_reconstruct_the_global_value_bit_for_bit():
    plan, sync, cores, params = make_cluster(dataclasses.replace(BASE, lease_s=1e6), learners=3)
    for rnd in range(3):
        actions = []
        for c in contributions_for(cores, params, fragment=2, seed=rnd):
            actions += sync.handle(c, float(rnd + 1))  # everyone alive came: closes at once
        deliver(actions, cores)
    assert sync.versions()[2] >= 2
    for core in cores:
        assert core.versions[2] == sync.versions()[2]
        assert torch.equal(core.anchor(2), sync.value(2))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda c: dataclasses.replace(c, fragment=99), "unknown_fragment"),
        (lambda c: dataclasses.replace(c, learner_id="ghost"), "unknown_learner"),
        (lambda c: dataclasses.replace(c, session=Session(c.session.incarnation + 1, 1)), "unknown_learner"),
        (lambda c: dataclasses.replace(c, codec="fp32"), "bad_codec"),
        (lambda c: dataclasses.replace(c, payload=c.payload[:-1]), "bad_size"),
        (lambda c: dataclasses.replace(c, base_version=7), "future_version"),
    ],
)
def test_bad_contributions_are_rejected_counted_and_leave_global_state_untouched(mutate, reason):
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    before = [sync.value(p).clone() for p in range(3)]
    actions = sync.handle(mutate(c), 1.0)
    assert refused(actions).reason == reason and len(actions) == 1
    assert sync.status().rejections[reason] == 1
    assert sync.pending_tokens() == 0
    assert all(torch.equal(b, sync.value(p)) for p, b in enumerate(before))


def test_nan_and_absurd_norm_are_rejected():
    config = dataclasses.replace(BASE, codec="fp32")
    plan, sync, cores, params = make_cluster(config, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    n = plan.fragments[1].numel
    nan = torch.zeros(n)
    nan[3] = math.nan
    assert refused(sync.handle(dataclasses.replace(c, payload=nan.numpy().tobytes()), 1.0)).reason == "non_finite"
    huge = torch.full((n,), 1e6)
    assert refused(sync.handle(dataclasses.replace(c, payload=huge.numpy().tobytes()), 1.0)).reason == "norm_bound"
    assert sync.status().rejections == {"non_finite": 1, "norm_bound": 1}
    assert {s.learner_id: s.rejected for s in sync.status().learners}["l0"] == 2


def test_a_fragment_whose_honest_norms_grow_past_the_bound_in_a_warm_up_moves_again():
    """An inner-lr warm-up makes a fragment's first round a few steps at a small rate and the
    next a whole period at a larger one. With the bound learnt from accepted norms alone, every
    contribution after that jump was refused for the rest of the run (the 2.8M-parameter GPU
    run and a 35k CPU run froze a fragment at version 2 while the learners trained it apart)."""
    config = dataclasses.replace(BASE, quorum=4, codec="fp32", downlink_codec="fp32", min_step_s=1e-9,
                                 max_tokens_per_step=10**6, lease_s=1e6)
    plan, sync, cores, params = make_cluster(config, learners=4)
    p = 1
    n = plan.fragments[p].numel
    versions = []
    for rnd, scale in enumerate((0.04, 0.55, 0.55, 0.55, 0.55)):
        cs = contributions_for(cores, params, fragment=p, seed=rnd)
        for m, c in enumerate(cs):
            delta = torch.full((n,), scale * (1 + 0.01 * m) / n**0.5)  # ‖Δ‖ = scale, honest spread
            deliver(sync.handle(dataclasses.replace(c, payload=delta.numpy().tobytes()), 10.0 * (rnd + 1)), cores)
        versions.append(sync.fragment_version(p))
    assert versions[-1] - versions[1] >= 2, versions  # it moves again within two rounds of the jump


def test_duplicates_and_stale_contributions_are_rejected():
    config = dataclasses.replace(BASE, quorum=1, staleness_max=1, staleness_reach=1.0, lease_s=1e6, staleness_leases=0.0)
    plan, sync, cores, params = make_cluster(config, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    sync.handle(c, 1.0)
    assert refused(sync.handle(c, 1.1)).reason == "duplicate"
    sync.handle(Tick(), sync.next_deadline())  # grace expires: version 1
    (d,) = contributions_for(cores[1:2], params[1:2], fragment=1)
    sync.handle(dataclasses.replace(d, base_version=1), 20.0)
    sync.handle(Tick(), sync.next_deadline())  # version 2
    assert sync.versions()[1] == 2
    stale = sync.handle(dataclasses.replace(c, seq=c.seq + 1), 30.0)  # base 0 lags 2 > 1
    assert refused(stale).reason == "stale"
    assert sync.status().rejections == {"duplicate": 1, "stale": 1}


def test_a_session_replaced_by_a_new_registration_is_superseded():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    admitted = sync.handle(Join("l0", "b0"), 2.0)[0]
    assert admitted.state.session.number > c.session.number
    assert refused(sync.handle(c, 2.5)).reason == "superseded"
    assert sync.pending_tokens() == 0


def test_expired_lease_stops_the_wait_and_rejoin_gets_current_state():
    config = dataclasses.replace(BASE, quorum=3)
    plan, sync, cores, params = make_cluster(config, learners=3)
    c0, c1, _ = contributions_for(cores, params, fragment=1)
    for core in cores[:2]:
        sync.handle(Heartbeat(core.learner_id, core.session, core.progress), 5.0)
    sync.handle(c0, 5.0)
    assert closed(sync.handle(c1, 5.0)) == []  # K=3 needs l2
    actions = sync.handle(Tick(), sync.next_deadline())  # l2's lease (renewed last at t=0) runs out at t=10
    assert any(isinstance(a, LeaseExpired) and a.learner_id == "l2" for a in actions)
    assert sync.alive() == ["l0", "l1"]
    (record,) = closed(actions)
    assert record.quorum_required == 2  # K lowered to the live learners
    assert refused(sync.handle(Heartbeat("l2", cores[2].session, cores[2].progress), 11.0)).reason == "unknown_learner"
    admitted = sync.handle(Join("l2", "b2"), 12.0)[0]
    assert admitted.state.versions() == sync.versions() and "l2" in sync.alive()


def test_strict_quorum_waits_for_everyone_even_when_leases_expire():
    config = dataclasses.replace(BASE, quorum=3, strict_quorum=True, blocking=True)
    plan, sync, cores, params = make_cluster(config, learners=3)
    c0, c1, c2 = contributions_for(cores, params, fragment=0)
    sync.handle(c0, 1.0)
    sync.handle(c1, 1.0)
    sync.handle(Tick(), 50.0)  # every lease expired: still no merge
    assert sync.versions()[0] == 0
    session = sync.handle(Join("l2", "b2"), 51.0)[0].state.session
    sync.handle(StateDelivered("l2", session), 51.0)
    actions = sync.handle(dataclasses.replace(c2, session=session), 60.0)  # after steps that fit its new session
    assert [a.reason for a in closed(actions)] == ["quorum"]


def test_checkpoint_round_trip_resumes_identically():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    for c in contributions_for(cores, params, fragment=1):
        sync.handle(c, 1.0)
    sync.handle(Tick(), 100.0)
    state = sync.state_dict(100.0)
    _, fresh, _, _ = make_cluster(BASE, learners=3, incarnation=1)
    fresh.load_state_dict(state)
    assert fresh.versions() == sync.versions()
    assert all(torch.equal(fresh.value(p), sync.value(p)) for p in range(3))
    assert fresh.alive() == []  # learners must register again after a restart
    # ... and their old sessions are refused, whatever their number
    beat = Heartbeat("l0", cores[0].session, cores[0].progress)
    assert refused(fresh.handle(beat, 101.0)).reason == "unknown_learner"


def test_token_budget_stops_learners_then_drains_and_finishes_once_they_left():
    config = dataclasses.replace(BASE, quorum=3, lease_s=1e6)
    plan, sync, cores, params = make_cluster(config, learners=3, limits=RunLimits(tokens=150))
    c0, c1, _ = contributions_for(cores, params, fragment=1)
    actions = sync.handle(c0, 1.0)
    assert not any(isinstance(a, StopLearners) for a in actions) and sync.phase is RunPhase.RUNNING
    actions = sync.handle(c1, 2.0)  # the two progress reports reach 200 >= 150 tokens
    stop = next(a for a in actions if isinstance(a, StopLearners))
    assert set(stop.recipients) == {"l0", "l1", "l2"} and sync.phase is RunPhase.STOPPING
    assert actions[0].stop  # the reply says so too
    out = []
    for core in cores:
        core.on_stop(3.0)
        assert sync.phase is RunPhase.STOPPING  # not over while anyone may still flush
        for a in core.close(3.0):
            message = a.encode() if hasattr(a, "encode") else a.message
            out += sync.handle(message, 3.0)
            assert not refused(out)
    assert isinstance(out[-1], Finished) and sync.phase is RunPhase.FINISHED
    assert sync.pending_tokens() == 0
    # what was pending below quorum (l0 and l1 in fragment 1) was merged once nobody was left
    last = [r for r in closed(out) if r.fragment == 1][-1]
    assert {m.learner_id for m in last.merged} == {"l0", "l1"}
    assert refused(sync.handle(Join("late", "x"), 4.0)).reason == "finished"


def test_progress_is_counted_once_per_boot_however_often_it_is_reported():
    plan, sync, cores, params = make_cluster(BASE, learners=2, limits=RunLimits(tokens=10_000))
    core = cores[0]
    progress = Progress("b0", tokens=500, steps=5)
    for _ in range(3):  # duplicated and re-sent reports
        sync.handle(Heartbeat("l0", core.session, progress), 1.0)
    sync.handle(Heartbeat("l0", core.session, Progress("b0", tokens=300, steps=3)), 1.0)  # reordered, older
    assert sync.status().tokens == 500
    sync.handle(Leave("l0", core.session, Progress("b0", tokens=700, steps=7)), 2.0)
    assert sync.status().tokens == 700


def checkpoints_asked(limits: RunLimits, rounds: int, seconds_per_round: float) -> tuple[Synchronizer, list]:
    """One learner merging a round every ``seconds_per_round``: the synchronizer and the checkpoints it asked for."""
    # A lease past the last round; the sends of fragments folded meanwhile wait for it (in steps of 1 s).
    config = dataclasses.replace(BASE, quorum=1, lease_s=60.0, grace_max_s=1e-9)
    plan, sync, cores, params = make_cluster(config, learners=1, limits=limits)
    checkpoints = []
    for rnd in range(rounds):
        for c in contributions_for(cores, params, fragment=rnd % 3, seed=rnd):
            actions = sync.handle(c, seconds_per_round * (rnd + 1))
            deliver(actions, cores)
            checkpoints += [a for a in actions if isinstance(a, Checkpoint)]
    return sync, checkpoints


def test_checkpoints_are_asked_for_every_n_rounds():
    sync, checkpoints = checkpoints_asked(RunLimits(checkpoint_every_rounds=2), rounds=4, seconds_per_round=10.0)
    assert len(checkpoints) == 2
    # The action carries the small state; the fragments are copied one at a time by the driver.
    assert "fragments" not in checkpoints[-1].state and checkpoints[-1].state["owned"] == list(sync.owned)
    assert [sync.fragment_state(p)["version"] for p in sync.owned] == list(sync.versions())


def test_the_first_checkpoint_by_time_comes_a_period_after_the_run_began():
    """Before, the time limit counted from the last checkpoint, and with none yet it never
    fired: a model whose rounds were slow went without any checkpoint until the round limit."""
    limits = RunLimits(checkpoint_every_rounds=1000, checkpoint_every_s=5.0)
    _, checkpoints = checkpoints_asked(limits, rounds=3, seconds_per_round=3.0)
    assert len(checkpoints) == 1  # at 6 s, the first round past 5 s after the join at 0


def test_a_learner_that_never_leaves_is_drained_after_the_timeout():
    config = dataclasses.replace(BASE, quorum=3, lease_s=1e6)
    limits = RunLimits(tokens=150, drain_timeout_s=20.0)
    plan, sync, cores, params = make_cluster(config, learners=3, limits=limits)
    c0, c1, _ = contributions_for(cores, params, fragment=1)
    sync.handle(c0, 1.0)
    sync.handle(c1, 2.0)
    assert sync.phase is RunPhase.STOPPING and sync.next_deadline() == 22.0
    assert sync.handle(Tick(), 21.9) == []
    actions = sync.handle(Tick(), 22.0)
    assert [r.reason for r in closed(actions)] == ["drain"] and isinstance(actions[-1], Finished)
    assert sync.pending_tokens() == 0


def test_a_round_that_would_follow_too_soon_waits_for_the_spacing():
    # K = 1, H = 6, τ = 2, steps of 1 s: rounds of one fragment at least (6 - 2) s apart.
    config = dataclasses.replace(BASE, quorum=1, period=6, overlap=2, grace_gamma=0.0, lease_s=1e6,
                                 space_rounds=True)
    plan, sync, cores, params = make_cluster(config, learners=2)
    a0, b0 = contributions_for(cores, params, fragment=1)
    (first,) = closed(sync.handle(a0, 10.0))  # K = 1, no grace: closes at once
    assert [m.learner_id for m in first.merged] == ["l0"]
    # l1 got the update before it sent (it is out of phase): its work is fresh for version 1,
    # but a round right after the last one would merge and broadcast the fragment twice in a period.
    fresh = dataclasses.replace(b0, base_version=1)
    assert closed(sync.handle(fresh, 10.5)) == []
    assert sync.status().round_phases[1] is RoundPhase.COLLECTING
    assert sync.next_deadline() == pytest.approx(10.0 + 4 * 1.0)  # the spacing is a deadline
    assert closed(sync.handle(Tick(), 13.9)) == []
    (second,) = closed(sync.handle(Tick(), 14.0))
    assert [m.learner_id for m in second.merged] == ["l1"] and second.version == 2
    assert sync.next_deadline() != pytest.approx(14.0)  # nothing left due now: time goes on


def test_a_learner_that_missed_an_update_still_gets_merged_and_the_next_version_shows_it_the_gap():
    """Late work does not close a round at once, but it must not hold it forever either: with K=2
    and one of two learners sending from a version it missed, the round closes when its grace
    window runs out, with both learners' work, and the new version tells the late one to rejoin.
    (Version 1 merges l0's and l2's work, not l1's: a late Δ of l1's from the anchor of work of
    its own that was merged would carry that work again, and is refused as ``repeated``.)"""
    config = dataclasses.replace(BASE, quorum=2)
    plan, sync, cores, params = make_cluster(config, learners=3)
    c0, c2 = contributions_for([cores[0], cores[2]], [params[0], params[2]], fragment=1)
    first = sync.handle(c0, 1.0) + sync.handle(c2, 1.1)
    if not closed(first):  # the quorum opened a grace window
        first += sync.handle(Tick(), sync.next_deadline())
    assert [r.version for r in closed(first)] == [1]
    deliver(first, [cores[0], cores[2]])  # l1 never gets version 1
    sync.handle(Leave("l2", cores[2].links[0].session, cores[2].progress), 1.5)
    cores, params = cores[:2], params[:2]
    fresh0, late1 = (contributions_for([core], [p], fragment=1, seed=30 + m)[0]
                     for m, (core, p) in enumerate(zip(cores, params)))
    assert (fresh0.base_version, late1.base_version) == (1, 0)
    assert closed(sync.handle(late1, 2.0)) == []
    assert closed(sync.handle(fresh0, 2.1)) == []  # fresh work below the quorum, everyone in: a grace window
    assert sync.status().round_phases[1] is RoundPhase.GRACE
    closing = sync.handle(Tick(), sync.next_deadline())
    (record,) = closed(closing)
    assert record.reason == "all-live" and {m.learner_id for m in record.merged} == {"l0", "l1"}
    (update,) = [a.update for a in closing if isinstance(a, Broadcast)]
    assert update.version == 2
    assert [type(a).__name__ for a in cores[1].on_update(update, 3.0)] == ["SendJoin"]  # the gap, seen


def test_a_delta_from_the_anchor_of_merged_work_is_refused_as_repeated_and_only_its_new_steps_count_lost():
    """A contribution whose reply was lost is folded into the learner's next one, measured from the
    same anchor, sent when the update that would say it was merged did not come within the hold
    (lost too). If the first was merged, the second carries its progress again: refused, the
    global model untouched, the ledger counting only the steps the first did not carry, and the
    learner waits for that update once more; refused so again with no update in between, it joins
    again (the update was lost)."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    (first,) = contributions_for([core], [params], fragment=1)
    assert [r.version for r in closed(sync.handle(first, 1.0))] == [1]  # alone: merged at once
    core.on_undelivered(first, 1.0)  # the reply was lost: the learner folds it into its next send
    (again,) = contributions_for([core], [params], fragment=1, seed=7)
    assert again.base_version == first.base_version and again.first_step == first.first_step
    value = sync.value(1).clone()
    reply = refused(sync.handle(again, 2.0))
    assert reply is not None and reply.reason == "repeated"
    assert sync.versions()[1] == 1 and torch.equal(sync.value(1), value)
    assert sync.status().honest_refused_steps == again.steps - first.steps
    assert core.on_refused(again, reply.reason, 2.0) == [] and core.schedule.held(1, 2.0)
    assert [type(a).__name__ for a in core.on_refused(again, reply.reason, 3.0)] == ["SendJoin"]
