"""The send schedule's alignment: in phase with the round, but never drifting by the round trip."""

from __future__ import annotations

from ddiloco.core.learner_side.send_schedule import SendSchedule
from ddiloco.core.shared.fragments import plan_fragments

PLAN = plan_fragments([("w", (64,))], num_fragments=1, period=12)
HOLD_S = 5.0
RECHECK_S = 1.0


def sent_at(step: int) -> SendSchedule:
    schedule = SendSchedule(PLAN, HOLD_S, RECHECK_S)
    schedule.take(0, step, now=0.0)
    return schedule


def test_on_a_slow_link_the_next_send_is_a_period_after_this_one_not_after_the_update() -> None:
    """Sent at step 12; the round's first contribution took two steps to arrive and its update two
    more to come back, so the synchronizer's round age says 0 steps. Anchored on that alone the
    next send would be due at 28 (16 + 12): every period four steps long too."""
    schedule = sent_at(12)
    schedule.align(0, 16, steps_since_round_began=0)
    assert schedule.next_due[0] == 24


def test_a_learner_that_sent_late_catches_up_with_the_round() -> None:
    """Its send left at 12, but the round had begun five steps before the update came (at 14):
    the next send is due at 12 + 12 − 3, in phase with the others."""
    schedule = sent_at(12)
    schedule.align(0, 14, steps_since_round_began=5)
    assert schedule.next_due[0] == 21


def test_a_learner_with_no_send_in_flight_goes_by_the_round_age() -> None:
    schedule = SendSchedule(PLAN, HOLD_S, RECHECK_S)
    schedule.align(0, 30, steps_since_round_began=3)
    assert schedule.next_due[0] == 39
    schedule.align(0, 40, steps_since_round_began=40)  # missed the round: at least one step
    assert schedule.next_due[0] == 41


def test_a_fragment_whose_call_is_unanswered_is_not_sent_again_even_after_updates() -> None:
    """Issue 29: under a 205 ms latency every update of a round the learner did not reach landed
    the fragment, the next send went out behind the unanswered one, and 265 contributions queued,
    each to be refused as stale. Until its call ends the fragment waits, its steps folding in."""
    schedule = sent_at(12)
    schedule.align(0, 14, steps_since_round_began=0)  # an update of p came (someone else's round) ...
    schedule.landed(0)
    assert schedule.due(100, now=1.0) == []  # ... the call is still out: nothing more is queued behind it
    schedule.count(tokens=10, duration_s=0.1)
    schedule.answered(0, seq=0)  # accepted, refused or undelivered
    assert schedule.due(100, now=HOLD_S) == [0] and schedule.counters[0].steps == 1


def test_an_accepted_send_waits_for_its_update_however_many_steps_pass_until_the_hold_ends() -> None:
    """Steps of 6 ms: two periods pass long before the update comes back, and a Δ sent then,
    measured from the same anchor, carried the last one's progress a second time (a learner alone
    diverged). The next send waits for the update; one that does not come in ``hold_s`` was lost."""
    schedule = sent_at(12)
    schedule.answered(0, seq=0)  # accepted: its update is on its way
    assert schedule.due(10_000, now=HOLD_S - 0.01) == []
    assert schedule.due(10_000, now=HOLD_S) == [0]
    schedule.landed(0)  # or the update came
    assert schedule.due(10_000, now=0.1) == [0]


def test_after_a_repeated_refusal_the_send_waits_once_more_then_the_learner_gives_up_on_the_update() -> None:
    """``repeated``: the synchronizer merged the last send's work, so its update was made before the
    refusal and only its way down the stream is left: the next send waits ``recheck_s`` more, and a
    second such refusal with no update in between means the update was lost."""
    schedule = sent_at(12)
    schedule.answered(0, seq=0)
    assert schedule.due(10_000, now=HOLD_S) == [0]  # the hold ran out ...
    schedule.take(0, 10_000, now=HOLD_S)
    schedule.answered(0, seq=1)  # ... and that send was refused as repeated
    assert schedule.repeated(0, 10_001, now=6.0)
    assert schedule.due(20_000, now=6.0 + RECHECK_S - 0.01) == [] and schedule.due(20_000, now=6.0 + RECHECK_S) == [0]
    assert not schedule.repeated(0, 10_003, now=8.0)  # again, no update in between: lost
    schedule.updated(0)
    assert schedule.repeated(0, 10_004, now=9.0)  # an update came since: a new episode


def test_a_blocking_learner_that_restarts_mid_period_sends_first_what_the_others_wait_on() -> None:
    """Four fragments at steps 12, 3, 6, 9 of a period. Fragments 1 and 2 are merged and the
    others wait on fragment 3 (step 9): a restarted learner at step 0 sends 3 at once, then 0,
    1, 2 at the others' spacing, not 1 first (its own step 3) as the plan would have it."""
    plan = plan_fragments([(f"w{p}", (64,)) for p in range(4)], num_fragments=4, period=12)
    schedule = SendSchedule(plan, HOLD_S, RECHECK_S)
    assert schedule.next_due == [12, 3, 6, 9]
    schedule.in_phase_with([31, 32, 32, 31], step=0)
    assert schedule.next_due == [4, 7, 10, 1]
    unchanged = SendSchedule(plan, HOLD_S, RECHECK_S)
    unchanged.in_phase_with([5, 5, 5, 5], step=0)  # every version equal: the plan is in phase
    assert unchanged.next_due == [12, 3, 6, 9]
