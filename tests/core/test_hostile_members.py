"""Issue 12's findings against the core: what one buggy or hostile member's message could do.

Each test sends what the probe sent and checks that the run's state did not move.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from protocol_helpers import (
    BASE,
    contributions_for,
    deliver,
    join,
    local_step,
    make_cluster,
    make_params,
    make_sync,
    refused,
    step,
)

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    LearnersForgotten,
    LeaseExpired,
    LinkStarved,
    Refused,
    StateDelivered,
    StopLearners,
    Tick,
)
from ddiloco.core.shared.messages import MAX_ID_CHARS, Heartbeat, Join, Leave, Progress, Session
from ddiloco.core.sync_side.run_state import RunLimits, RunPhase


def a_contribution(cores, params):
    core, p = cores[0], params[0]
    for _ in range(100):
        local_step(p, seed=core.step)
        due = step(core, tokens=100, duration_s=1.0)
        if due:
            return due[0]
    raise AssertionError("no contribution fell due")


def test_a_contribution_without_tokens_cannot_be_built_nor_stepped():
    """Finding 1: tokens = 0 gave a round nothing to weigh, and its merge raised in the timer."""
    plan, sync, cores, params = make_cluster(BASE, learners=2)
    c = a_contribution(cores, params)
    with pytest.raises(ValueError, match="bad counters"):
        dataclasses.replace(c, tokens=0)
    with pytest.raises(ValueError, match="tokens"):
        cores[1].record_step(0, 1.0, 0.0)  # LearnerRuntime.step(tokens=0) ends here


def test_progress_of_a_refused_message_never_moves_the_budget():
    """Finding 2: a heartbeat from an unregistered id claiming 1e9 tokens ended a 1e9-token run."""
    plan, sync, cores, params = make_cluster(BASE, learners=2)
    before = sync.status().tokens
    ghost = Progress("ghost-boot", tokens=10**9, steps=10**9 // 64)
    for message in (Heartbeat("ghost", Session(sync.incarnation, 99), ghost),
                    Leave("ghost", Session(sync.incarnation, 99), ghost),
                    Heartbeat("l0", Session(sync.incarnation + 1, 0), ghost)):  # a stale session of a real id
        (reply,) = [a for a in sync.handle(message, 1.0) if isinstance(a, Refused)]
        assert reply.learner_id == message.learner_id
    assert sync.status().tokens == before


@pytest.mark.parametrize("tokens, steps", [(2**64 - 1, 2**58), (2**49, 2**40), (2**25, 1)])
def test_counts_beyond_any_run_are_malformed(tokens, steps):
    """Finding 3: two heartbeats of 2^64 - 1 tokens overflowed the status reply's int64 for good."""
    with pytest.raises(ValueError):
        Progress("b", tokens=tokens, steps=steps)


@pytest.mark.parametrize("field, value", [("compute_s", 1e300), ("compute_s", -1.0), ("step_time_s", -1e300),
                                          ("step_time_s", float("nan")), ("step_time_s", 1e9),
                                          ("seq", 2**63), ("base_version", 2**63)])
def test_timings_and_indices_out_of_range_are_malformed(field, value):
    """Finding 7 (goodput 1e298, a grace window forced to 0) and the 2^63 sequence number of finding 6."""
    plan, sync, cores, params = make_cluster(BASE, learners=2)
    c = a_contribution(cores, params)
    with pytest.raises(ValueError):
        dataclasses.replace(c, **{field: value})


@pytest.mark.parametrize("learner_id", ["x" * (MAX_ID_CHARS + 1), "has space", "tab\there", "", "ünïcode"])
def test_implausible_ids_are_malformed(learner_id):
    """Findings 4, 5 and 8: megabyte ids filled ledgers, checkpoint headers and reply metadata."""
    with pytest.raises(ValueError, match="learner id"):
        Join(learner_id, "boot")
    with pytest.raises(ValueError, match="boot id"):
        Join("learner-0", learner_id)


def test_honest_ids_and_counts_still_pass():
    Join("learner-0", "3f2a9c1e-boot")
    Join("host-17.rack:3/gpu@node", "b" * MAX_ID_CHARS)
    Progress("b", tokens=2**40, steps=2**20)


# ---- issue 16: what a registered member could still do -------------------------------------

STRICT = dataclasses.replace(BASE, quorum=1, lease_s=1e6, grace_max_s=1e-9, min_step_s=0.01)


def counters(sync, learner_id):
    (learner,) = [s for s in sync.status().learners if s.learner_id == learner_id]
    return learner.accepted, learner.rejected, learner.registrations


def test_token_counts_are_held_to_the_message_bound():
    """Finding 2: tokens were bounded only by steps x 2^24: 2^64 - 1 tokens in 2^40 steps passed."""
    plan, sync, cores, params = make_cluster(BASE, learners=2)
    c = a_contribution(cores, params)
    with pytest.raises(ValueError, match="bad counters"):
        dataclasses.replace(c, tokens=2**64 - 1, steps=2**40)
    with pytest.raises(ValueError, match="bad counters"):
        dataclasses.replace(c, tokens=2**48 + 1, steps=2**30)


def test_a_contribution_claiming_more_work_than_fits_its_time_gains_no_weight_for_it():
    """Finding 2: a member's claimed tokens become its merge weight. Steps beyond one per
    protocol.min_step_s since its process registered count for nothing (issue 57: they were
    refused, and so was an honest learner faster than the floor); a sequence number far ahead is
    implausible (tokens beyond what it declared per step: the next test)."""
    plan, sync, cores, params = make_cluster(STRICT, learners=2)
    c = a_contribution(cores, params)  # 3 steps of 100 tokens (the learners declared none: the cap is 2^24)
    before = counters(sync, "l0")
    reply = refused(sync.handle(dataclasses.replace(c, seq=2**62 - 1), 1.0))  # would lock l0 out as duplicate
    assert reply.reason == "implausible", reply.detail
    assert counters(sync, "l0") == (before[0], before[1] + 1, before[2])
    assert sync.pending_tokens() == 0
    assert sync.status().honest_refused_steps == 0  # a member's refusals, never honest work (core/sync_side/refusals.py)
    greedy = dataclasses.replace(c, steps=10**6, tokens=10**8)  # 1e6 steps of 100 tokens in 1 s
    assert not isinstance(sync.handle(greedy, 1.0)[0], Refused)
    fits = int(1.0 / STRICT.min_step_s) + 1  # what 1 s holds: one step per 10 ms
    assert sync.pending_tokens() == fits * 100  # its weight and tokens: what the clock allows, at its claimed rate
    assert sync.status().claims_clipped["steps"] == 1


def test_declared_tokens_per_step_bound_what_a_learner_may_claim():
    plan, sync = make_sync(STRICT)
    params = make_params()
    core = Learner("small", STRICT, plan, params, boot="b-small", tokens_per_step=100)
    join(core, sync)
    with pytest.raises(ValueError, match="declared"):
        core.record_step(101, 1.0, 1.0)  # a bug in the caller, named at once
    c = a_contribution([core], [params])
    reply = refused(sync.handle(dataclasses.replace(c, tokens=c.steps * 100 + 1), 50.0))
    assert reply.reason == "implausible" and "at most 100 per step" in reply.detail


def test_one_heartbeat_claiming_2_to_the_48_tokens_does_not_end_the_run():
    """Finding 3: a registered member's heartbeat claimed 2^48 tokens of progress, the budget
    counted them and the run went to stopping. Claims are counted only as far as time allows."""
    config = dataclasses.replace(STRICT, max_tokens_per_step=100)  # the run's batch: no claim counts more per step
    plan, sync, cores, params = make_cluster(config, learners=2, limits=RunLimits(tokens=10**6))
    greedy = Progress("b0", tokens=2**48, steps=2**24)
    actions = sync.handle(Heartbeat("l0", cores[0].session, greedy), 10.0)
    assert not any(isinstance(a, StopLearners) for a in actions)
    status = sync.status()
    assert status.phase is RunPhase.RUNNING and status.progress_clipped == 1
    assert status.tokens == (int(10.0 / config.min_step_s) + 1) * 100  # what 10 s can hold: one 100-token step per 10 ms
    # The same claim again adds nothing.
    sync.handle(Heartbeat("l0", cores[0].session, greedy), 10.5)
    assert sync.status().tokens == status.tokens


def test_the_budget_counts_honest_progress_in_full_however_late_and_close_together_reports_arrive():
    """Reports delayed on a slow link arrive back to back: the bound is on totals since the
    learner's origin, so two reports a millisecond apart can carry seconds of work between them."""
    plan, sync, cores, params = make_cluster(STRICT, learners=1, limits=RunLimits(tokens=1000))
    for t, tokens in ((1.0, 300), (1.001, 600), (1.002, 1000)):  # 10 steps of 100 tokens in 1.002 s
        actions = sync.handle(Heartbeat("l0", cores[0].session, Progress("b0", tokens, tokens // 100)), t)
    assert sync.status().tokens == 1000 and sync.status().progress_clipped == 0
    assert any(isinstance(a, StopLearners) for a in actions)


def test_a_replacing_contribution_whose_sums_leave_the_bounds_is_refused_before_anything_changes():
    """Finding 4: the replacement's counters were added, and only then validated: the ValueError
    escaped after last_seq and the accepted count had moved."""
    config = dataclasses.replace(BASE, quorum=2, min_step_s=1e-9, space_rounds=False)
    plan, sync, cores, params = make_cluster(config, learners=2)
    c = a_contribution(cores, params)
    big = dataclasses.replace(c, steps=2**47, tokens=2**47)
    assert not isinstance(sync.handle(big, 1e6)[0], Refused)  # pending: the quorum is 2
    before = counters(sync, "l0")
    again = dataclasses.replace(big, seq=c.seq + 1, steps=2**47 + 1, tokens=2**47 + 1)
    reply = refused(sync.handle(again, 2e6))
    assert reply.reason == "implausible" and "replaces" in reply.detail
    assert counters(sync, "l0") == (before[0], before[1] + 1, before[2])
    assert sync.pending_tokens() == big.tokens
    assert not isinstance(sync.handle(dataclasses.replace(c, seq=c.seq + 1), 2e6)[0], Refused)  # seq not consumed


def test_refusals_never_name_another_session():
    """Finding 5: ``superseded`` answered "replaced by INC/N": the victim's session, for the asking."""
    plan, sync, cores, params = make_cluster(BASE, learners=1)
    old = cores[0].session
    new = sync.handle(Join("l0", "b0"), 1.0)[0].state.session
    reply = refused(sync.handle(Heartbeat("l0", old, Progress("b0")), 1.0))
    assert reply.reason == "superseded" and str(new) not in reply.detail and str(new.number) not in reply.detail


def test_session_numbers_grow_but_cannot_be_guessed_from_the_previous_one():
    plan, sync = make_sync(BASE, session_salt=12345)
    sessions = [sync.handle(Join(f"x{i}", "b"), 0.0)[0].state.session for i in range(50)]
    numbers = [s.number for s in sessions]
    assert numbers == sorted(numbers) and len(set(numbers)) == 50
    steps = {b - a for a, b in zip(numbers, numbers[1:])}
    assert len(steps) > 40  # not a counter: the next number is not the last one plus a constant
    _, other = make_sync(BASE, session_salt=54321)
    assert other.handle(Join("x0", "b"), 0.0)[0].state.session.number != numbers[0]


def test_a_later_process_of_the_same_id_replaces_the_earlier_for_good():
    """Finding 7: an orphaned worker and its restart took one id back from each other about 104
    times in 11 s. The later boot keeps the id; the earlier is refused as replaced, its joins too,
    also after a restart of the synchronizer from a checkpoint."""
    plan, sync, cores, params = make_cluster(STRICT, learners=1)
    orphan = cores[0]
    c = a_contribution(cores, params)
    restart = Learner("l0", STRICT, plan, make_params(), boot="b0-restarted")
    join(restart, sync, now=1.0)
    assert refused(sync.handle(c, 2.0)).reason == "replaced"
    assert refused(sync.handle(Heartbeat("l0", orphan.session, orphan.progress), 2.0)).reason == "replaced"
    assert refused(sync.handle(Join("l0", "b0"), 3.0)).reason == "replaced"
    assert sync.session_problem("l0", restart.session) is None
    _, resumed = make_sync(STRICT, incarnation=7)
    resumed.load_state_dict(sync.state_dict(4.0))
    assert refused(resumed.handle(Join("l0", "b0"), 0.0)).reason == "replaced"
    assert isinstance(resumed.handle(Join("l0", "b0-restarted"), 0.0)[0], Admitted)


def test_a_leave_in_another_session_changes_nothing_of_the_learner():
    """Finding 5: twenty Leave calls under learner-0's id raised its registrations from 1 to 21."""
    plan, sync, cores, params = make_cluster(STRICT, learners=1)
    before = counters(sync, "l0")
    for n in range(20):
        reply = refused(sync.handle(Leave("l0", Session(sync.incarnation, n), Progress("forged")), 1.0))
        assert reply.reason in ("superseded", "unknown_learner", "replaced")
    assert counters(sync, "l0")[2] == before[2] and sync.session_problem("l0", cores[0].session) is None


def test_registrations_beyond_the_cap_are_refused_and_dead_learners_are_forgotten():
    config = dataclasses.replace(BASE, forget_after_s=100.0, lease_s=10.0)
    plan, sync = make_sync(config, limits=RunLimits(learners=1))  # four leases at most
    for i in range(4):
        assert isinstance(sync.handle(Join(f"x{i}", "b"), 0.0)[0], Admitted)
    assert refused(sync.handle(Join("x4", "b"), 0.0)).reason == "registry_full"
    assert isinstance(sync.handle(Join("x0", "b"), 0.0)[0], Admitted)  # a member again: always
    sync.handle(Tick(), 1000.0)  # every lease ran out (nobody heard the state arrive: it waited, then ran)
    assert sync.status().learners and not any(s.alive for s in sync.status().learners)
    actions = sync.handle(Tick(), 1200.0)
    assert any(isinstance(a, LearnersForgotten) and set(a.learner_ids) == {"x0", "x1", "x2", "x3"} for a in actions)
    status = sync.status()
    assert status.learners == () and status.learners_forgotten == 4
    assert isinstance(sync.handle(Join("x4", "b"), 1200.0)[0], Admitted)


def test_a_learner_of_the_run_restarting_into_a_registry_full_of_abandoned_joins_takes_an_idle_lease():
    """Issue 53: a flood of joins abandoned once the state arrived holds every lease for a lease each.
    A learner whose work was accepted before takes the lease of the oldest registration never heard
    from since its join; a stranger waits; a registration that was heard from keeps its lease."""
    plan, sync, cores, params = make_cluster(BASE, learners=1, limits=RunLimits(learners=1))  # four leases
    c = a_contribution(cores, params)
    assert isinstance(sync.handle(c, 1.0)[0], Accepted)
    sync.handle(Tick(), 100.0)  # l0's process died: its lease ran out
    for i in range(8):  # joins abandoned before their state arrived: more dead records than the registry keeps
        gone = sync.handle(Join(f"gone-{i}", "g"), 100.5 + i / 10)[0]
        sync.handle(StateDelivered(f"gone-{i}", gone.state.session, False), 100.5 + i / 10)
        sync.handle(Tick(), 100.5 + i / 10)
    assert "l0" in {s.learner_id for s in sync.status(101.5).learners}  # strangers are forgotten first
    sessions = []
    for i, t in enumerate((101.0, 102.0, 103.0)):
        admitted = sync.handle(Join(f"flood-{i}", f"f{i}"), t)[0]
        assert isinstance(admitted, Admitted)
        sessions.append(admitted.state.session)
        sync.handle(StateDelivered(f"flood-{i}", admitted.state.session, True), t)  # and never heard of again
    heard = sync.handle(Join("stranger", "s"), 104.0)[0]
    sync.handle(StateDelivered("stranger", heard.state.session, True), 104.0)
    assert isinstance(sync.handle(Heartbeat("stranger", heard.state.session, Progress("s")), 104.5)[0], Accepted)
    status = sync.status(105.0)
    assert (status.idle_registrations, status.oldest_idle_registration_s) == (3, 4.0)
    assert refused(sync.handle(Join("flood-9", "f9"), 105.0)).reason == "registry_full"

    actions = sync.handle(Join("l0", "b0-restarted"), 106.0)
    assert isinstance(actions[0], Admitted) and [a.learner_id for a in actions if isinstance(a, LeaseExpired)] == \
        ["flood-0"]
    assert sync.session_problem("flood-0", sessions[0]) is not None  # its lease ended now
    alive = {s.learner_id for s in sync.status(106.0).learners if s.alive}
    assert alive == {"l0", "flood-1", "flood-2", "stranger"} and sync.status(106.0).idle_registrations == 2


def test_data_shards_are_the_cores_decision_and_stay_with_the_id():
    plan, sync = make_sync(BASE, limits=RunLimits(learners=3))
    shards = {name: sync.handle(Join(name, "b"), 0.0)[0].data_shard for name in ("learner-2", "island", "learner-7")}
    assert shards == {"learner-2": 2, "island": 0, "learner-7": 1}  # its number, else the first free
    assert sync.data_shard("learner-2") == 2 and sync.handle(Join("learner-2", "b2"), 1.0)[0].data_shard == 2


def test_the_lease_waits_while_the_state_is_on_its_way_and_runs_from_its_arrival():
    """Issue 20, item 0: at 2 and 1 Mbit/s the full state took longer than the lease; the lease
    ran out during the join, the learner registered again, for ever."""
    config = dataclasses.replace(BASE, min_link_bytes_per_s=1.0)  # the state may take minutes to arrive
    plan, sync = make_sync(config)
    admitted = sync.handle(Join("slow", "b"), 0.0)[0]
    assert sync.admission_s() > 100 and sync.status().learners[0].joining
    sync.handle(Tick(), 3 * BASE.lease_s)  # longer than a lease: still admitted
    assert sync.session_problem("slow", admitted.state.session) is None
    sync.handle(StateDelivered("slow", admitted.state.session), 40.0)
    sync.handle(Tick(), 40.0 + BASE.lease_s - 0.5)
    assert sync.session_problem("slow", admitted.state.session) is None
    sync.handle(Tick(), 40.0 + BASE.lease_s)
    assert sync.session_problem("slow", admitted.state.session) is not None
    failed = sync.handle(Join("lost", "b"), 50.0)[0]
    sync.handle(StateDelivered("lost", failed.state.session, ok=False), 51.0)
    sync.handle(Tick(), 51.0)
    assert sync.session_problem("lost", failed.state.session) is not None  # the transfer broke: no lease to wait out


def test_a_live_learner_whose_work_never_arrives_is_reported_link_starved():
    config = dataclasses.replace(BASE, lease_s=10.0, space_rounds=False)
    plan, sync, cores, params = make_cluster(config, learners=1)
    t, starved = 0.0, []
    while t < 100.0 and not starved:
        t += 1.0
        actions = sync.handle(Heartbeat("l0", cores[0].session, Progress("b0")), t)  # alive, nothing accepted
        starved += [a for a in actions + sync.handle(Tick(), t) if isinstance(a, LinkStarved)]
    (report,) = starved
    assert report.learner_id == "l0" and t >= 2 * config.lease_s
    status = sync.status(t)
    assert status.learners[0].link_starved and status.link_starved_episodes == 1
    c = a_contribution(cores, params)
    assert not isinstance(sync.handle(c, t + 1)[0], Refused)
    assert not sync.status(t + 1).learners[0].link_starved and sync.status(t + 1).learners[0].accepted_per_min == 1


def test_contributions_delayed_and_arriving_back_to_back_are_still_plausible():
    """Found by the registration burst (bench_sync_abuse.py): a contribution held up behind busy
    uploads, and the next one right after it, used to be refused as implausible (each was
    measured against the time since the previous one arrived)."""
    config = dataclasses.replace(STRICT, quorum=2, space_rounds=False)
    plan, sync, cores, params = make_cluster(config, learners=2)
    first = a_contribution(cores, params)
    fragment = first.fragment
    # The learner's call timed out (its next send of the fragment waits for an answer), yet the
    # contribution was on its way and reaches the synchronizer late.
    cores[0].on_undelivered(first, 0.0)
    after_hold = 2 * config.lease_s  # the next send waits for an update of the first for a lease; none comes
    while True:
        local_step(params[0], seed=cores[0].step)
        due = step(cores[0], tokens=100, duration_s=1.0, now=after_hold)
        for c in due:
            if c.fragment != fragment:
                cores[0].on_undelivered(c, 0.0)
        if any(c.fragment == fragment for c in due):
            second = next(c for c in due if c.fragment == fragment)
            break
    for c, now in ((first, 10.0), (second, 10.0001)):  # both held up, then delivered a tenth of a ms apart
        assert not isinstance(sync.handle(c, now)[0], Refused)


def test_a_member_sending_at_nine_tenths_of_the_norm_bound_cannot_make_the_model_grow_round_after_round():
    """Finding 2: the bound was relative to the fragment's current value, so ten contributions at
    0.9 x the bound (with a weight of about 2^88) grew a fragment's norm from 18 to 1.4e8. Now the
    bound follows what most learners sent and the weight is capped.

    Three honest learners and one member: the lower medians behind both defences assume most
    learners are honest. (With one honest learner of two, the member is half the membership and
    steers max_weight_ratio / (1 + max_weight_ratio) of every round; this test used to run that
    case and passed only because the cap's correction, subtracted in float32 from a sum that held
    a weight 10^11 times the honest one, left rounding noise where the honest Δ had been.)"""
    config = dataclasses.replace(BASE, quorum=4, codec="fp32", downlink_codec="fp32", space_rounds=False,
                                 min_step_s=1e-9, max_tokens_per_step=10**6, lease_s=1e6)
    plan, sync, cores, params = make_cluster(config, learners=4)
    p = 1
    numel = plan.fragments[p].numel
    start = float(sync.value(p).norm())
    for rnd in range(10):
        *honest, hostile = contributions_for(cores, params, fragment=p, seed=rnd)
        honest_norm = max(float(torch.frombuffer(bytearray(h.payload), dtype=torch.float32).norm()) for h in honest)
        bound = config.delta_norm_ratio_max * max(honest_norm, 1e-6)
        pushed = torch.full((numel,), 0.9 * bound / numel**0.5)
        forged = dataclasses.replace(hostile, payload=pushed.numpy().tobytes(), tokens=10**9, steps=10**3)
        t = 10.0 * (rnd + 1)
        for c in (*honest, forged):
            actions = sync.handle(c, t)
            deliver(actions, cores)
            assert not isinstance(actions[0], Refused) or c is forged
    assert float(sync.value(p).norm()) < 3 * start, (start, float(sync.value(p).norm()))
    assert sync.status().weights_capped >= 1
