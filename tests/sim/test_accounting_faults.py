"""Failure traces, goodput accounting and the invariant checker, on hand-made inputs."""

from __future__ import annotations

import pytest
import torch

from ddiloco.core.shared.actions import CloseReason, MergedContribution, RoundClosed
from ddiloco.core.shared.messages import Session
from ddiloco.measures.useful_work import Accounting
from ddiloco.sim.faults import FailureTrace
from ddiloco.sim.invariants import InvariantChecker, InvariantViolation


def test_trace_is_seeded_per_learner_and_independent_of_learner_count():
    a = FailureTrace(learners=4, mtbf_s=100.0, downtime_s=10.0, horizon_s=5000.0, seed=3)
    b = FailureTrace(learners=4, mtbf_s=100.0, downtime_s=10.0, horizon_s=5000.0, seed=3)
    c = FailureTrace(learners=4, mtbf_s=100.0, downtime_s=10.0, horizon_s=5000.0, seed=4)
    assert a.all() == b.all() != c.all()
    outages = a.outages[0]
    assert 20 < len(outages) < 80  # ~5000 / 110
    assert all(5.0 <= o.up_s - o.down_s <= 15.0 for o in outages)
    o = outages[0]
    assert a.outage_at(0, (o.down_s + o.up_s) / 2) == o and a.outage_at(0, o.up_s) is None
    assert a.next_down(0, o.down_s - 1e-9) == o.down_s
    assert FailureTrace(learners=2, mtbf_s=0.0, downtime_s=10.0, horizon_s=1e6, seed=0).all() == []


def test_goodput_counts_credited_compute_and_uptime_the_covered_time():
    acc = Accounting([0.0, 0.0])
    for step in range(1, 5):
        acc.add_step(0, step, start_s=step - 1.0, end_s=float(step))
    acc.add_step(1, 1, start_s=0.0, end_s=1.0, busy_s=0.5)
    acc.credit(0, 1, 2, 1.0)  # steps 3-4 of learner 0 were lost
    acc.credit(1, 1, 1, 0.5)  # half of learner 1's fragments merged
    assert acc.goodput(4.0) == pytest.approx((2.0 + 0.25) / 8.0)
    assert acc.uptime(4.0) == pytest.approx(2.0 / 4.0)
    with pytest.raises(ValueError):
        acc.add_step(1, 5, 0.0, 1.0)


def test_a_late_learner_provisions_chip_time_only_from_its_arrival():
    acc = Accounting([0.0, 2.0])  # learner 1 joins the job at 2 s
    for step in range(1, 5):
        acc.add_step(0, step, start_s=step - 1.0, end_s=float(step))
        acc.credit(0, step, step, 1.0)
    for step in range(1, 3):
        acc.add_step(1, step, start_s=step + 1.0, end_s=step + 2.0)
        acc.credit(1, step, step, 1.0)
    assert acc.goodput(4.0) == pytest.approx(6.0 / (4.0 + 2.0))  # all of it useful: 1, not 6/8
    assert acc.goodput(1.0) == pytest.approx(1.0)  # before it arrives, only learner 0 is provisioned


def _round(fragment, version, learners, quorum, reason=CloseReason.GRACE, base=None, seq=0, incarnation=1, alive=1):
    base = version - 1 if base is None else base
    merged = tuple(MergedContribution(name, 1, seq, 10, 1, 1.0, 1, base, 0.0) for name in learners)
    return RoundClosed(fragment, version, merged, quorum, reason, 0.0, 0.0, 0.0, incarnation, alive)


def _checker(seed=0):
    c = InvariantChecker(seed=seed, staleness_max=2, quorum=2, strict_quorum=False,
                         initial_values=[torch.zeros(4), torch.zeros(4)])
    c.on_start(1, [0, 1], [torch.zeros(4), torch.zeros(4)], [0, 0], None)
    return c


class _Holder:
    """Just what on_anchor reads of a learner core."""

    def __init__(self, version, anchor):
        self.learner_id = "a"
        self.session = Session(1, 1)
        self.versions = [version, version]
        self._anchor = anchor

    def session_of(self, fragment):
        return self.session

    def anchor(self, fragment):
        return self._anchor


def test_invariant_checker_catches_a_merge_below_quorum_and_a_skipped_version():
    checker = _checker(seed=7)
    checker.on_round(_round(0, 1, ["a", "b"], quorum=2), torch.zeros(4))
    with pytest.raises(InvariantViolation, match="quorum.*seed 7"):
        checker.on_round(_round(0, 2, ["a"], quorum=2, seq=1), torch.zeros(4))
    with pytest.raises(InvariantViolation, match="version 3 after 0"):
        _checker().on_round(_round(0, 3, ["a"], quorum=1), torch.zeros(4))
    checker2 = _checker()
    checker2.on_round(_round(1, 1, ["a"], quorum=1), torch.ones(4))
    checker2.on_anchor(_Holder(1, torch.ones(4)), 1)  # matches the global value
    with pytest.raises(InvariantViolation, match="differs"):
        checker2.on_anchor(_Holder(1, torch.full((4,), 2.0)), 1)
    with pytest.raises(InvariantViolation, match="never produced"):
        checker2.on_anchor(_Holder(5, torch.ones(4)), 1)


def test_invariant_checker_catches_double_merges_stale_merges_and_a_restart_past_its_checkpoint():
    checker = _checker()
    checker.on_round(_round(0, 1, ["a"], quorum=1), torch.zeros(4))
    with pytest.raises(InvariantViolation, match="merged twice"):
        checker.on_round(_round(0, 2, ["a"], quorum=1), torch.zeros(4))  # same (learner, session, seq)
    stale = _checker()
    for v in range(1, 4):
        stale.on_round(_round(0, v, ["a"], quorum=1, seq=v), torch.zeros(4))
    with pytest.raises(InvariantViolation, match="staleness"):
        stale.on_round(_round(0, 4, ["b"], quorum=1, base=0, reason=CloseReason.ALL_LIVE), torch.zeros(4))  # 3 behind
    with pytest.raises(InvariantViolation, match="checkpoint and log knew"):
        _checker().on_start(2, [0, 1], [torch.zeros(4), torch.zeros(4)], [3, 1], [2, 1])


def test_invariant_checker_catches_a_version_that_goes_back_or_changes_across_a_crash():
    checker = _checker()
    checker.on_start(1, [0], [torch.zeros(4)], [0], None)
    for v in (1, 2):
        checker.on_round(_round(0, v, ["a"], quorum=1, seq=v), torch.full((4,), float(v)))
    with pytest.raises(InvariantViolation, match="went back from version 2 to 1"):
        checker.on_start(2, [0], [torch.ones(4)], [1], [1])  # restored an older checkpoint, no log
    with pytest.raises(InvariantViolation, match="another value"):
        checker.on_start(3, [0], [torch.zeros(4)], [2], [2])  # version 2, but not the value merged
    checker.on_start(4, [0], [torch.full((4,), 2.0)], [2], [2])  # what the round log restores


def test_invariant_checker_computes_the_quorum_itself():
    # The synchronizer claims a quorum of 1, but K = 2 with 3 learners alive requires 2.
    with pytest.raises(InvariantViolation, match="requires 2"):
        _checker().on_round(_round(0, 1, ["a"], quorum=1, alive=3), torch.zeros(4))
    _checker().on_round(_round(0, 1, ["a"], quorum=1, alive=1), torch.zeros(4))  # one alive: one is enough
    with pytest.raises(InvariantViolation, match="requires 3"):  # "all live" closed without one of them
        _checker().on_round(_round(0, 1, ["a", "b"], quorum=2, reason=CloseReason.ALL_LIVE, alive=3), torch.zeros(4))
