"""Issue 25, second finding: claimed compute and step times steered the grace window and goodput.

A contribution claiming ``compute_s = 1e7`` with ``step_time_s = 3600`` was accepted as it came:
status reported a goodput of 1.267e5 and the grace window followed the claimed step time. Now
both times are clipped to what the clock allows since the learner's session began, counted,
and only the clipped times reach the round, the grace window and goodput.
"""

from __future__ import annotations

import dataclasses

import pytest
from protocol_helpers import BASE, contributions_for, make_cluster

from ddiloco.core.shared.actions import Refused, RoundClosed
from ddiloco.core.sync_side.claims import ClaimLimits, ClipReason, plausible_timing
from ddiloco.runtime.sync.metrics import GoodputMeter

CONFIG = dataclasses.replace(BASE, quorum=3, grace_max_s=30.0, lease_s=1e6, min_step_s=0.01)
NOW = 10.0
"""Every learner joined at 0 and steps once a second: its contributions arrive at 10 s."""


def run_round(forge: dict[str, float]) -> tuple:
    """One round of fragment 1 from two honest learners and a member whose contribution carries
    ``forge``; returns the synchronizer, the member's contribution as sent and the round's record."""
    plan, sync, cores, params = make_cluster(CONFIG, learners=3)
    honest0, honest1, member = contributions_for(cores, params, fragment=1)
    member = dataclasses.replace(member, **forge)
    records = []
    for c in (honest0, honest1, member):
        actions = sync.handle(c, NOW)
        assert not isinstance(actions[0], Refused), actions[0]
        records += [a for a in actions if isinstance(a, RoundClosed)]
    (record,) = records  # every live learner contributed: the round closes at once
    return sync, member, record


def test_claimed_compute_and_step_time_beyond_the_clock_are_clipped_counted_and_steer_nothing():
    sync, member, record = run_round({"compute_s": 1e7, "step_time_s": 3600.0})
    status = sync.status(NOW)
    assert status.claims_clipped == {str(ClipReason.COMPUTE): 1, str(ClipReason.STEP_TIME): 1}
    (merged,) = [mc for mc in record.merged if mc.learner_id == "l2"]
    assert merged.compute_s <= NOW  # no more compute than wall time since it joined
    (l2,) = [lr for lr in status.learners if lr.learner_id == "l2"]
    assert l2.step_time_s <= NOW / member.steps  # at most the wall time per step it claimed
    honest_sync, _, _ = run_round({})
    assert honest_sync.status(NOW).claims_clipped == {}  # honest claims are never clipped
    assert sync.grace_length_s() == honest_sync.grace_length_s()  # the window is what the honest learners set

    goodput = GoodputMeter(learners=2)
    for mc in record.merged:
        goodput.credit(mc.compute_s, 1.0, mc.arrived_s)
    assert goodput.goodput(NOW) <= 1.0


def test_a_step_time_claimed_faster_than_the_run_allows_is_raised_to_min_step_s():
    """A step time of ~0 made the grace window 0 (every round closed without waiting for stragglers);
    the window can now shrink no further than ``protocol.min_step_s`` allows."""
    sync, _, _ = run_round({"step_time_s": 1e-9})
    status = sync.status(NOW)
    assert status.claims_clipped == {str(ClipReason.STEP_TIME): 1}
    (l2,) = [lr for lr in status.learners if lr.learner_id == "l2"]
    assert l2.step_time_s == CONFIG.min_step_s


@pytest.mark.parametrize("elapsed, compute_before, steps, claimed, kept", [
    (10.0, 0.0, 3, (3.0, 1.0), (3.0, 1.0)),  # honest: kept as claimed
    (10.0, 8.0, 3, (3.0, 1.0), (2.0, 1.0)),  # compute beyond what is left of the session's wall time
    (10.0, 0.0, 10, (3.0, 5.0), (3.0, 1.0)),  # 10 steps in 10 s: at most 1 s each
    (10.0, 0.0, 3, (3.0, 0.0), (3.0, 0.0)),  # 0: not measured yet, no claim
])
def test_plausible_timing(elapsed, compute_before, steps, claimed, kept):
    """``steps``: in the session so far, this contribution's included."""
    plan, sync, cores, params = make_cluster(CONFIG, learners=1)
    (c,) = contributions_for(cores, params, fragment=1)
    c = dataclasses.replace(c, compute_s=claimed[0], step_time_s=claimed[1])
    plausible, clipped = plausible_timing(c, ClaimLimits(CONFIG.min_step_s), since_s=0.0, now=elapsed,
                                          steps_before=steps - c.steps, compute_before=compute_before)
    assert (plausible.compute_s, plausible.step_time_s) == kept
    assert bool(clipped) == (kept != claimed)


def test_goodput_is_never_reported_above_one():
    """More learners than ``run.learners`` may hold leases, each credited up to its wall time."""
    goodput = GoodputMeter(learners=2)
    for _ in range(8):
        goodput.credit(10.0, 1.0, 10.0)
    assert goodput.goodput(10.0) == 1.0
