"""The learner state machine: schedule, counters, merges with α, gaps, requeues, refusals, waits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from protocol_helpers import deliver, local_step, make_cluster, one_learner_sent, step

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.learner_side.learner_phase import LearnerPhase, LoopMove, UpdateResult
from ddiloco.core.shared.actions import (
    Behind,
    Fail,
    Outage,
    OutagePhase,
    Refused,
    SendHeartbeat,
    SendJoin,
    SendLeave,
    Stale,
    Starved,
)
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.fragments import flatten
from ddiloco.core.shared.messages import FragmentUpdate, GlobalState, Join, RejectReason, Session
from ddiloco.core.shared.protocol_config import ProtocolConfig

BASE = ProtocolConfig(fragments=3, period=3, quorum=1, lease_s=1e6, grace_max_s=1e-9)


def update(core, fragment, version, payload, incarnation=None):
    incarnation = core.session.incarnation if incarnation is None else incarnation
    return FragmentUpdate(fragment, version, "fp32", payload, incarnation)


def test_fragments_fall_due_at_their_offsets_with_counters_since_last_send():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    sent = []
    for s in range(1, 7):
        local_step(params, seed=s)
        for c in step(core, 10, 0.5, now=s):
            sent.append((s, c.fragment, c.steps, c.tokens, c.first_step))
            answer = sync.handle(c, s)
            answer_core(core, c, answer[0], s)
            deliver(answer, [core], now=s)  # each round closes at once: the next send is not held
    offsets = {f.index: f.offset for f in plan.fragments}
    assert [(s, p) for s, p, *_ in sent] == sorted(
        ((s, p) for s in range(1, 7) for p in range(3) if s % 3 == offsets[p]), key=lambda sp: sp[0]
    )
    second = [x for x in sent if x[0] > 3]
    assert all(steps == 3 and tokens == 30 for _, _, steps, tokens, _ in second)


def test_contribution_is_anchor_minus_local_and_update_merges_with_alpha():
    config = dataclasses.replace(BASE, codec="fp32", downlink_codec="fp32", alpha=0.5)
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    p = plan.due(3)[0] if plan.due(3) else 0
    anchor = core.anchor(p).clone()
    contribs = []
    for s in range(1, 4):
        local_step(params, seed=s)
        contribs += step(core, 10, 0.5)
    c = next(c for c in contribs if c.fragment == p)
    local = flatten([params[n] for n in plan.fragments[p].param_names])
    delta = get_codec("fp32").decode(c.payload, anchor.numel())
    assert torch.allclose(delta, anchor - local)
    upd = torch.full_like(anchor, 0.25)
    assert core.on_update(update(core, p, 1, upd.numpy().tobytes()), 1.0) == []
    assert core.updates[UpdateResult.APPLIED] == 1 and core.versions[p] == 1
    merged = flatten([params[n] for n in plan.fragments[p].param_names])
    assert torch.allclose(merged, 0.5 * local + 0.5 * (anchor + upd))
    assert torch.equal(core.anchor(p), anchor + upd)


def test_duplicate_updates_are_ignored_and_a_missed_version_asks_for_full_state():
    plan, sync, (core,), _ = make_cluster(dataclasses.replace(BASE, downlink_codec="fp32"), learners=1)
    payload = torch.zeros(plan.fragments[0].numel).numpy().tobytes()
    assert core.on_update(update(core, 0, 1, payload), 1.0) == []
    assert core.on_update(update(core, 0, 1, payload), 1.0) == []
    assert core.updates == {UpdateResult.APPLIED: 1, UpdateResult.IGNORED: 1}
    (join,) = core.on_update(update(core, 0, 3, payload), 1.0)
    assert isinstance(join, SendJoin) and core.updates[UpdateResult.GAP] == 1
    assert core.versions[0] == 1 and core.rejoining()
    assert core.on_update(update(core, 0, 5, payload), 1.0) == []  # already rejoining: one join


def test_a_stream_made_again_announces_the_versions_held_and_none_without_a_state():
    plan, sync, (core,), params = make_cluster(dataclasses.replace(BASE, downlink_codec="fp32"), learners=1)
    payload = torch.zeros(plan.fragments[0].numel).numpy().tobytes()
    core.on_update(update(core, 0, 1, payload), 1.0)
    assert core.stream_versions(0) == core.versions == [1, 0, 0]  # replay what came after these
    fresh = Learner("x", BASE, plan, params[0])
    assert fresh.stream_versions(0) is None  # nothing held: its join brings the state


def test_updates_of_another_synchronizer_incarnation_are_ignored():
    plan, sync, (core,), _ = make_cluster(dataclasses.replace(BASE, downlink_codec="fp32"), learners=1)
    payload = torch.ones(plan.fragments[0].numel).numpy().tobytes()
    before = core.anchor(0).clone()
    assert core.on_update(update(core, 0, 1, payload, incarnation=core.session.incarnation + 1), 1.0) == []
    assert core.updates == {UpdateResult.IGNORED: 1}
    assert core.versions[0] == 0 and torch.equal(core.anchor(0), before)


def test_requeued_contribution_is_folded_into_the_next_one():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    first = None
    for s in range(1, 4):
        local_step(params, seed=s)
        first = next((c for c in step(core, 10, 1.0) if c.fragment == 0), first)
    assert first is not None
    assert core.on_undelivered(first, 3.5) == []  # the synchronizer was unreachable
    nxt = None
    for s in range(4, 7):
        local_step(params, seed=s)
        nxt = next((c for c in step(core, 10, 1.0, now=2 * BASE.lease_s) if c.fragment == 0), nxt)
    assert nxt.steps == first.steps + 3 and nxt.tokens == first.tokens + 30
    assert nxt.first_step == first.first_step


def _first_send_of_fragment_0(core, params):
    first = None
    for s in range(1, 4):
        local_step(params, seed=s)
        first = next((c for c in step(core, 10, 1.0) if c.fragment == 0), first)
    assert first is not None
    return first


def _next_send_of_fragment_0(core, params, now, steps=3):
    for s in range(steps):
        local_step(params, seed=100 + core.step)
        sent = [c for c in step(core, 10, 1.0, now=now) if c.fragment == 0]
        if sent:
            return sent[0]
    return None


def test_a_contribution_merged_whose_answer_was_lost_is_neither_sent_again_nor_counted_twice():
    """Seen in the every-fault-kind chaos run: a reset cut the answer to a contribution the
    synchronizer had merged; the learner folded it into its next send from the same anchor, which
    was refused as ``repeated`` with the 162 steps since. The next send now waits for the update,
    which says whose work it merged."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    first = _first_send_of_fragment_0(core, params)
    merged = sync.handle(first, 3.0)  # accepted, and the round closes (quorum 1)
    core.on_undelivered(first, 3.5)  # the answer is lost on the way back
    assert _next_send_of_fragment_0(core, params, now=4.0) is None  # it waits for the update
    deliver(merged, [core], 5.0)
    nxt = _next_send_of_fragment_0(core, params, now=5.0, steps=BASE.period)
    assert nxt is not None and nxt.base_version == first.base_version + 1
    assert nxt.first_step == first.last_step + 1 and nxt.steps == core.step - first.last_step
    assert nxt.tokens == 10 * nxt.steps  # the merged contribution's tokens are not claimed again
    assert core.answers_lost == 1
    assert not isinstance(sync.handle(nxt, 6.0)[0], Refused)


def test_a_folded_contribution_an_update_did_not_merge_stays_in_the_next_one():
    """The update that ends the wait merged other work (the contribution itself was lost): the
    next Δ, measured from that update, still holds the lost work, and its counters still count it."""
    plan, sync, (core,), (params,) = make_cluster(dataclasses.replace(BASE, downlink_codec="fp32"), learners=1)
    first = _first_send_of_fragment_0(core, params)
    core.on_undelivered(first, 3.5)
    zeros = torch.zeros(plan.fragments[0].numel).numpy().tobytes()
    assert core.on_update(update(core, 0, 1, zeros), 4.0) == []  # merged nobody's work of ours
    nxt = _next_send_of_fragment_0(core, params, now=5.0, steps=BASE.period)
    assert nxt is not None and nxt.base_version == 1
    assert nxt.first_step == first.first_step and nxt.steps == first.steps + core.step - first.last_step
    assert core.answers_lost == 0


def test_work_of_an_earlier_session_is_dropped_not_folded():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    old = None
    for s in range(1, 4):
        local_step(params, seed=s)
        old = next((c for c in step(core, 10, 1.0) if c.fragment == 0), old)
    state = sync.handle(Join("l0", "b0"), 4.0)[0].state
    core.on_admitted(sync.state_for(state), 4.0)
    assert not core.is_current(old)
    assert core.on_undelivered(old, 4.5) == [] and core.dropped == 1
    assert core.on_refused(old, RejectReason.SUPERSEDED, 4.5) == []  # about a session we left
    nxt = None
    for s in range(4, 7):
        local_step(params, seed=s)
        nxt = next((c for c in step(core, 10, 1.0) if c.fragment == 0), nxt)
    assert nxt.steps == 3 and nxt.session == state.session


@pytest.mark.parametrize("reason", ["unknown_learner", "superseded", "stale", "future_version"])
def test_refusals_that_mean_a_lost_state_make_the_learner_join_again(reason):
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    sent = []
    for s in range(1, 4):
        local_step(params, seed=s)
        sent += step(core, 10, 1.0)
    (join,) = core.on_refused(sent[0], RejectReason(reason), 3.0)
    assert isinstance(join, SendJoin) and core.rejoining()
    assert core.on_refused(sent[1], RejectReason(reason), 3.0) == []  # one join is enough
    assert core.between_steps(3.0) is LoopMove.STEP  # it holds a state: it trains on while it rejoins
    assert [s.fragment for s in core.record_step(10, 1.0, 4.0)] == []  # ... but sends nothing from it


def test_stale_refusals_while_updates_arrive_in_order_do_not_make_the_learner_join_again():
    """Issue 29, item 1: on a link whose round trip spans more rounds than the staleness bound,
    every contribution comes back stale although the updates reach the learner in order; a new
    registration would come over the same link as late. The learner says so once and trains on."""
    config = dataclasses.replace(BASE, downlink_codec="fp32")
    plan, sync, core, sent, payload = one_learner_sent(config)
    c = sent[0]
    assert core.on_update(update(core, c.fragment, c.base_version + 1, payload), 3.0) == []  # an update since
    (said,) = core.on_refused(c, RejectReason.STALE, 3.0)
    assert said == Stale(c.fragment, c.base_version, c.base_version + 1, config.period) and not core.rejoining()
    assert core.on_refused(c, RejectReason.STALE, 3.5) == []  # said once
    assert core.phase is LearnerPhase.TRAINING and core.between_steps(3.5) is LoopMove.STEP
    core.on_accepted(sent[1], 4.0)  # work accepted again: a later episode is said again
    assert core.on_refused(c, RejectReason.STALE, 4.5) != []


@pytest.mark.parametrize("reason", ["duplicate", "non_finite", "norm_bound", "bad_size", "implausible"])
def test_refusals_of_one_contribution_drop_it_and_training_goes_on(reason):
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    local_step(params, seed=1)
    sent = step(core, 10, 1.0)
    core.on_accepted(sent[0], 1.0)  # answered: its fragment is held until its update (or the hold ends)
    later = 1.0 + core.schedule.hold_s
    while not any(c.fragment == sent[0].fragment for c in step(core, 10, 1.0, later)):
        pass  # the fragment's next contribution went out: ``sent[0]`` is no longer the newest
    assert core.on_refused(sent[0], RejectReason(reason), 1.0) == []
    assert core.phase is LearnerPhase.TRAINING and core.between_steps(1.0) is LoopMove.STEP


def test_a_duplicate_of_the_newest_contribution_means_someone_spoke_for_us_and_the_learner_joins_again():
    """Issue 16, finding 5: a contribution with a far sequence number under a learner's id locked
    it out of the fragment as ``duplicate`` for the rest of the run. A refusal of our newest
    sequence number as already received is impossible unless someone else sent it: a new session
    (numbers from 0, unknown to them) shuts them out."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    local_step(params, seed=1)
    (newest, *_) = step(core, 10, 1.0)
    (join,) = core.on_refused(newest, RejectReason.DUPLICATE, 1.0)
    assert isinstance(join, SendJoin) and core.rejoining() and core.between_steps(1.0) is LoopMove.STEP


def test_replaced_by_a_later_process_of_the_same_id_the_learner_stops_for_good():
    """Issue 16, finding 7: an orphaned worker and its restart took one id back from each other
    about 104 times in 11 s. The earlier process must stop, not register again."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    local_step(params, seed=1)
    (sent, *_) = step(core, 10, 1.0)
    (fail,) = core.on_refused(sent, RejectReason.REPLACED, 1.0)
    assert isinstance(fail, Fail) and fail.reason is RejectReason.REPLACED
    assert core.phase is LearnerPhase.FAILED and core.should_stop and core.tick(100.0) == []


def test_once_the_learner_has_failed_what_was_queued_is_dropped_and_counted():
    """The driver used to skip queued uploads after a fatal error without telling the core,
    so ``contributions_dropped`` missed them."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    local_step(params, seed=1)
    sends = step(core, 10, 1.0)
    assert sends and core.still_to_send(sends[0])
    (fail,) = core.on_refused(sends[0], RejectReason.REPLACED, 1.0)
    assert isinstance(fail, Fail)
    assert [core.still_to_send(s) for s in sends] == [False] * len(sends) and core.dropped == len(sends)


def test_a_wrong_token_is_fatal_and_a_finished_run_stops_the_learner():
    plan, sync, (core,), _ = make_cluster(BASE, learners=1)
    (fail,) = core.on_refused(Join("l0", "b0"), RejectReason.UNAUTHENTICATED, 1.0)
    assert isinstance(fail, Fail) and core.phase is LearnerPhase.FAILED and core.between_steps(1.0) is LoopMove.END
    plan, sync, (other,), _ = make_cluster(BASE, learners=1)
    assert other.on_refused(Join("l0", "b0"), RejectReason.FINISHED, 1.0) == []
    assert other.phase is LearnerPhase.STOPPED and other.should_stop


def test_once_the_run_is_finished_nothing_queued_goes_out():
    """On a 500 kbit/s link a learner kept uploading its queue after the run ended, each
    upload refused in turn for 15 s: a finished refusal drops what is still queued."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    sends = []
    for i in range(BASE.period * 2):
        local_step(params, seed=i)
        sends += core.record_step(10, 1.0, float(i))
    assert len(sends) >= 2 and core.still_to_send(sends[-1])
    assert core.on_refused(sends[0].encode(), RejectReason.FINISHED, 5.0) == []
    assert not any(core.still_to_send(s) for s in sends[1:])


def test_the_first_heartbeat_goes_as_soon_as_the_state_is_adopted():
    """On a slow link the last of the state arrives long after the synchronizer sent it: the
    learner says at once that it holds it, rather than a heartbeat interval later."""
    plan, sync, _, (params,) = make_cluster(BASE, learners=1)
    core = Learner("late", BASE, plan, params, boot="b-late")
    (join,) = core.start(0.0)
    admitted = sync.handle(join.message, 0.0)[0]
    core.on_admitted(sync.state_for(admitted.state), 40.0)
    (beat,) = core.tick(40.0)
    assert isinstance(beat, SendHeartbeat) and beat.message.session == admitted.state.session


def test_heartbeats_come_every_interval_and_a_lost_lease_means_joining_again():
    config = dataclasses.replace(BASE, lease_s=9.0, heartbeat_s=5.0)  # interval: min(5, 9/3) = 3
    plan, sync, (core,), _ = make_cluster(config, learners=1)  # its first heartbeat went at once (the helper)
    assert core.next_deadline() == 3.0
    assert core.tick(2.9) == []
    (beat,) = core.tick(3.0)
    assert isinstance(beat, SendHeartbeat) and beat.message.session == core.session
    assert core.next_deadline() == 6.0
    (join,) = core.on_refused(beat.message, RejectReason.UNKNOWN_LEARNER, 3.1)
    assert isinstance(join, SendJoin) and core.next_deadline() is None  # no heartbeats while joining


def test_an_undelivered_join_is_retried_with_backoff():
    plan, sync, _, (params,) = make_cluster(BASE, learners=1)
    core = Learner("x", BASE, plan, params, boot="bx")
    (join,) = core.start(0.0)
    assert core.on_undelivered(join.message, 1.0) == []
    assert core.next_deadline() == pytest.approx(1.2)
    (again,) = core.tick(1.2)
    assert isinstance(again, SendJoin)
    core.on_undelivered(again.message, 2.0)
    assert core.next_deadline() == pytest.approx(2.4)  # doubled


def test_blocking_learner_waits_for_the_fragment_it_sent():
    config = dataclasses.replace(BASE, fragments=1, period=2, blocking=True, alpha=0.0)
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    local_step(params, seed=1)
    assert step(core, 10, 1.0) == [] and core.between_steps(1.0) is LoopMove.STEP
    local_step(params, seed=2)
    (c,) = step(core, 10, 1.0, now=2.0)
    assert core.between_steps(2.0) is LoopMove.WAIT and core.between_steps(1e9) is LoopMove.WAIT
    deliver(sync.handle(c, 2.0), [core])
    assert core.between_steps(2.0) is LoopMove.STEP and core.versions[0] == 1


def test_max_wait_holds_a_learner_tau_steps_after_sending_then_lets_it_train_on():
    config = dataclasses.replace(BASE, fragments=1, period=4, overlap=2, max_wait_s=5.0, heartbeat_s=100.0)
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    sends = []
    for s in range(1, 7):
        assert core.between_steps(float(s)) is LoopMove.STEP
        local_step(params, seed=s)
        sends += core.record_step(10, 1.0, float(s))
    assert [x.header.first_step for x in sends] == [1]  # sent at step 4 (offset 0 → step 4)
    assert core.between_steps(6.0) is LoopMove.WAIT  # step 6 = 4 + τ without the update: wait
    assert core.next_deadline() == pytest.approx(11.0)
    assert core.between_steps(10.9) is LoopMove.WAIT
    assert core.between_steps(11.0) is LoopMove.STEP  # waited max_wait_s: train on
    core.tick(11.0)
    assert core.next_deadline() is None or core.next_deadline() > 11.0  # nothing left due at 11 s


def test_stop_then_close_flushes_everything_unsent_and_leaves():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    local_step(params, seed=1)
    step(core, 10, 1.0)
    core.on_stop(1.5)
    assert core.should_stop and core.between_steps(1.5) is LoopMove.CLOSE
    actions = core.close(2.0)
    assert isinstance(actions[-1], SendLeave)
    flushed = [a.header for a in actions[:-1]]
    assert sorted(c.fragment for c in flushed) == [p for p in range(3) if p not in plan.due(1)]
    assert all(c.steps == 1 for c in flushed) and core.phase is LearnerPhase.STOPPED
    # a step the loop finishes after the close counts for nothing, and the loop is over
    assert core.record_step(16, 1.0, 2.5) == [] and core.step == 1 and core.between_steps(2.5) is LoopMove.END


def test_the_last_flush_leaves_out_a_fragment_whose_update_has_not_come():
    """Measured from the same anchor as the send still awaiting its update, the flush would carry that
    send's work a second time once both are merged (a far learner's flush did, in issue 42's runs)."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    sent = []
    while not sent:
        local_step(params, seed=core.step)
        sent = step(core, 10, 1.0)
    (first,) = sent[:1]
    core.on_accepted(first, 1.0)  # accepted: its update is on its way
    for _ in range(3):
        step(core, 10, 1.1)
    core.on_stop(1.2)
    flushed = [a.header.fragment for a in core.close(1.3) if not isinstance(a, SendLeave)]
    assert first.fragment not in flushed and core.steps_unsent >= 3  # its three steps since (others may wait too)


def test_an_admission_older_than_the_session_held_is_ignored():
    plan, sync, (core,), _ = make_cluster(BASE, learners=1)
    held = core.session
    old = GlobalState(sync.global_state().fragments, held.incarnation, Session(held.incarnation, held.number - 1))
    assert core.on_admitted(old, 1.0) == [] and core.session == held


def test_stepping_before_joining_is_an_error():
    plan, sync, cores, params = make_cluster(BASE, learners=1)
    fresh = Learner("x", BASE, plan, params[0])
    with pytest.raises(RuntimeError):
        fresh.record_step(1, 1.0, 0.0)
    assert fresh.between_steps(0.0) is LoopMove.WAIT


def starved_notices(core, params, steps: int, step_s: float, start_s: float = 0.0) -> list[Starved]:
    """Train ``steps`` steps of ``step_s`` each while the link carries none of the learner's work
    but its heartbeats are answered (no outage); what it said about being starved."""
    said = []
    for s in range(1, steps + 1):
        now = start_s + s * step_s
        local_step(params, seed=s)
        for c in step(core, 10, step_s, now):
            core.on_undelivered(c, now)
        for action in core.tick(now):
            said += [action] if isinstance(action, Starved) else []
            if isinstance(action, SendHeartbeat):
                core.on_accepted(action.message, now)
    return said


def test_a_learner_whose_work_does_not_arrive_for_three_periods_says_so_once():
    """Issue 20, item 0: the learners trained at full speed while nothing merged, and nothing told the user."""
    config = dataclasses.replace(BASE, lease_s=2.0)  # two leases (4 s) pass before three periods (9 s)
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    (notice,) = starved_notices(core, params, 3 * BASE.period + 1, step_s=1.0)
    assert notice.steps == 3 * BASE.period and core.watch.starved
    local_step(params, seed=99)
    while not (due := step(core, 10, 1.0, 50.0)):
        pass
    core.on_accepted(due[0], 50.0)
    assert not core.watch.starved and not [a for a in core.tick(51.0) if isinstance(a, Starved)]


def test_a_learner_that_steps_in_milliseconds_is_not_starved_before_two_leases():
    """Three periods of 10 ms steps pass before the first round trip can: not a starved link
    (a real learner said so 0.9 s after its first join). Starved needs two leases too, as the
    synchronizer's registry does."""
    config = dataclasses.replace(BASE, lease_s=2.0)
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    assert starved_notices(core, params, 300, step_s=0.01) == []  # 3 s: 100 periods, under two leases
    assert [n.steps for n in starved_notices(core, params, 200, step_s=0.01, start_s=3.0)]  # past 4 s: starved


def test_a_learner_whose_link_carries_half_its_sends_says_so_once():
    """Issue 20: at 500 kbit/s a fifth of the learners' work was merged, their sends waiting for
    the one before, and the run said nothing (it was not starved: some work arrived)."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    said, in_flight = [], []
    for s in range(1, 20 * BASE.period):
        local_step(params, seed=s)
        in_flight += step(core, 10, 1.0, float(s))
        if s % (2 * BASE.period) == 0:  # the link answers every other period: a send waits for the one before
            for c in in_flight:
                answer = sync.handle(c, float(s))
                answer_core(core, c, answer[0], float(s))
                deliver(answer, [core], now=float(s))
            in_flight = []
        said += [a for a in core.tick(float(s)) if isinstance(a, Behind)]
    (notice,) = said
    assert notice.steps_per_send >= 1.5 * BASE.period and notice.share <= 2 / 3 and core.watch.behind


def test_a_learner_whose_link_keeps_up_is_not_behind():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    for s in range(1, 20 * BASE.period):
        local_step(params, seed=s)
        for c in step(core, 10, 1.0, float(s)):
            answer = sync.handle(c, float(s))
            answer_core(core, c, answer[0], float(s))
            deliver(answer, [core], now=float(s))  # answered at once
        assert not [a for a in core.tick(float(s)) if isinstance(a, Behind)] and not core.watch.behind


def answer_core(core, request, reply, now):
    if isinstance(reply, Refused):
        return core.on_refused(request, reply.reason, now)
    return core.on_accepted(request, now)


def test_an_outage_is_said_when_it_begins_summarized_at_intervals_and_said_when_it_ends():
    """Issue 29, items 2 and 3: with the synchronizer down a learner logged every undelivered call
    (about 170 lines a second), and once it was back, the contributions that carried the folded
    steps made it warn that its link was too slow. One action per change of state and a summary
    every OUTAGE_SUMMARY_S; the outage's folds are not a slow link, nor is it starved."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    said, now = [], 0.0
    for s in range(1, 301):  # 30 s of steps of 0.1 s, nothing answered
        now = s / 10
        local_step(params, seed=s)
        for c in step(core, 10, 0.1, now):
            said += core.on_undelivered(c, now)
        for action in core.tick(now):
            said += [action] if not isinstance(action, SendHeartbeat) else core.on_undelivered(action.message, now)
    phases = [a.phase for a in said if isinstance(a, Outage)]
    assert phases == [OutagePhase.BEGAN, OutagePhase.ONGOING, OutagePhase.ONGOING]  # at 5 s, then 15 s and 25 s
    assert not [a for a in said if not isinstance(a, Outage)]  # neither starved nor behind
    # each fragment sent once, then held for an update of it (a lease here longer than the outage)
    assert said[-1].folded == len(plan.fragments) and said[-1].for_s == pytest.approx(25.0, abs=0.2)
    said = []
    for s in range(301, 301 + 40 * BASE.period):  # back: everything is answered
        now = s / 10
        local_step(params, seed=s)
        for request in [*step(core, 10, 0.1, now), *(a.message for a in core.tick(now) if isinstance(a, SendHeartbeat))]:
            answer = sync.handle(request, now)
            said += answer_core(core, request, answer[0], now)
            deliver(answer, [core], now=now)
    ended = [a for a in said if isinstance(a, Outage)]
    # said at the first answer: a heartbeat (each fragment's send still waits for the update of its last)
    assert [a.phase for a in ended] == [OutagePhase.ENDED]
    assert 30.0 <= ended[0].for_s <= 30.0 + BASE.heartbeat_interval_s + 0.2
    assert not [a for a in said if isinstance(a, (Behind, Starved))]


def test_the_first_seconds_of_an_outage_are_not_a_starved_link():
    """A real learner warned that its link was too slow 4 s into a synchronizer's restart: its last
    heartbeat had been answered after its last accepted contribution, and the outage is declared
    only after OUTAGE_AFTER_S. Calls unanswered for more than a lease mean nobody answers."""
    config = dataclasses.replace(BASE, lease_s=1.0)  # two leases (2 s) and three periods pass well before 5 s
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    local_step(params, seed=0)
    step(core, 10, 0.1, 0.1)  # a step after the join (nothing falls due yet) ...
    heartbeat = [a for a in core.tick(0.9) if isinstance(a, SendHeartbeat)]
    assert heartbeat
    core.on_accepted(heartbeat[0].message, 0.9)  # ... and a heartbeat answered after the last acceptance
    said = []
    for s in range(1, 48):  # 4.7 s of 0.1 s steps: the synchronizer is gone
        now = 0.9 + s / 10
        local_step(params, seed=s)
        for c in step(core, 10, 0.1, now):
            said += core.on_undelivered(c, now)
        for action in core.tick(now):
            said += [action] if not isinstance(action, SendHeartbeat) else core.on_undelivered(action.message, now)
    assert not [a for a in said if isinstance(a, Starved)], said
    assert not [a for a in said if isinstance(a, Outage)]  # not declared yet either: under OUTAGE_AFTER_S


@pytest.mark.parametrize(("reason", "folded"), [(RejectReason.BUSY, True), (RejectReason.TIMED_OUT, True),
                                                 (RejectReason.IMPLAUSIBLE, False)])
def test_a_contribution_refused_for_the_synchronizer_s_load_is_folded_into_the_next_one(reason, folded):
    """``busy`` and ``timed_out`` say nothing about the contribution (no place for its upload, or its
    stream stalled): its work goes into the fragment's next contribution, sent when due. A refusal
    of its content drops it."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    first = _first_send_of_fragment_0(core, params)
    assert core.on_refused(first, reason, 3.5) == []
    nxt = None
    for s in range(4, 7):
        local_step(params, seed=s)
        nxt = next((c for c in step(core, 10, 1.0, now=4.0) if c.fragment == 0), nxt)
    assert nxt is not None  # not held for an update: nothing of the refused one can be merged
    assert (nxt.steps, nxt.tokens) == ((first.steps + 3, first.tokens + 30) if folded else (3, 30))
    assert nxt.first_step == (first.first_step if folded else first.first_step + first.steps)
