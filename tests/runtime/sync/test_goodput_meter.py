"""Issue 45: a fault-free ``ddiloco run --runtime processes`` read goodput 41% and uptime 50%.

The synchronizer counted every learner's chip-time from the first join to the moment its
status was read, the wait for the last evaluation and the final checkpoint included (uptime
fell from 0.98 to 0.50 between the last two rows); a resumed synchronizer with no learners yet
read goodput 0%. These drive :class:`GoodputMeter` with a clock of their own."""

from __future__ import annotations

import pytest

from ddiloco.runtime.sync.metrics import GoodputMeter


def busy_run() -> GoodputMeter:
    """Two learners, joined at t=0 and t=2, each credited with all its work until t=10, when the budget is spent."""
    meter = GoodputMeter(learners=2)
    meter.joined("a", 0.0)
    meter.joined("b", 2.0)
    meter.joined("a", 5.0)  # a rejoin: its chip-time still counts from its first join
    for t in range(1, 11):
        meter.credit(1.0, 1.0, float(t))
        if t > 2:
            meter.credit(1.0, 1.0, float(t))
    meter.finished(10.0)
    return meter


def test_chip_time_runs_from_each_learners_join_to_the_runs_end_not_to_the_status_read():
    meter = busy_run()
    for now in (10.0, 25.0, 1000.0):  # the final evaluation, the checkpoint: after the run's end
        goodput, uptime, wall_s = meter.measured(now)
        assert (goodput, uptime, wall_s) == (1.0, 1.0, 10.0)


def test_an_idle_learner_still_counts():
    meter = GoodputMeter(learners=2)
    meter.joined("a", 0.0)
    meter.joined("b", 0.0)
    for t in range(1, 11):
        meter.credit(1.0, 1.0, float(t))  # only a's work reaches the model
    goodput, uptime, _ = meter.measured(10.0)
    assert goodput == pytest.approx(0.5) and uptime == 1.0


def test_a_resumed_synchronizer_reports_the_runs_goodput_before_any_learner_rejoins():
    before = busy_run()
    state = before.state_dict(30.0)
    resumed = GoodputMeter(learners=2)
    resumed.load_state_dict(state)
    goodput, uptime, wall_s = resumed.measured(500.0)  # no learner yet: was 0.0
    assert (goodput, uptime, wall_s) == (1.0, 1.0, 0.0)
    resumed.joined("a", 500.0)
    resumed.joined("b", 500.0)
    goodput, _, _ = resumed.measured(510.0)  # 2 x 10 idle chip seconds after 18 busy ones
    assert goodput == pytest.approx(18 / 38)
