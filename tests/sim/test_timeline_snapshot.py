"""The run's timeline and the read-only snapshots of the tiny preset's main job (seed 0)."""

from __future__ import annotations

import pytest

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual
from ddiloco.sim.faults import FailureTrace
from ddiloco.sim.snapshot import ClusterSnapshot, LearnerState
from ddiloco.sim.timeline import Happening, Timeline

CONFIG = build_config(preset="tiny", main_job=True)


@pytest.fixture(scope="module")
def watched() -> tuple[dict, list[ClusterSnapshot]]:
    snapshots: list[ClusterSnapshot] = []
    summary, _ = run_virtual(CONFIG, observer=snapshots.append)
    return summary, snapshots


def trace_until(end_s: float) -> list:
    """The seeded outages that began before the run ended (a trace's prefix does not depend on its horizon)."""
    f = CONFIG.faults
    trace = FailureTrace(learners=CONFIG.run.learners, mtbf_s=f.mtbf_s, downtime_s=f.downtime_s, horizon_s=10 * end_s,
                         seed=CONFIG.run.seed)
    return [o for o in trace.all() if o.down_s < end_s]


def test_the_main_job_has_failures_and_one_slow_learner_in_four(watched):
    summary, snapshots = watched
    assert CONFIG.faults.mtbf_s > 0 and CONFIG.cluster.slow_fraction == 0.25
    assert summary["events"]["slow_learners"] == [3]
    assert [learner.slow for learner in snapshots[-1].learners] == [False, False, False, True]


def test_summary_counts_match_the_failure_trace(watched):
    summary, snapshots = watched
    outages = trace_until(summary["virtual_time_s"])
    events = summary["events"]
    assert len(outages) >= CONFIG.run.learners  # seed 0: each learner fails once or twice
    assert events["failures"] == len(outages) == summary["faults"]["learner_crash"]
    # every outage of this seed ends before the run does, and each restarted learner rejoins
    assert all(o.up_s < summary["virtual_time_s"] for o in outages)
    assert events["rejoins"] == len(outages)
    for m, learner in enumerate(snapshots[-1].learners):
        assert learner.failures == sum(o.learner == m for o in outages)


def test_snapshots_report_each_learners_state(watched):
    summary, snapshots = watched
    assert [s.time_s for s in snapshots] == sorted(s.time_s for s in snapshots)
    assert {learner.state for learner in snapshots[0].learners} == {LearnerState.JOINING}
    assert {learner.state for learner in snapshots[-1].learners} == {LearnerState.STOPPED}
    seen_down = 0
    for outage in trace_until(summary["virtual_time_s"]):
        during = [s for s in snapshots if outage.down_s < s.time_s < outage.up_s]
        assert all(s.learners[outage.learner].state is LearnerState.DOWN for s in during)
        seen_down += bool(during)
    assert seen_down > 0
    assert any(learner.state is LearnerState.TRAINING for s in snapshots for learner in s.learners)
    assert snapshots[-1].versions == tuple(summary["fragment_versions"])
    assert snapshots[-1].failures == summary["events"]["failures"]
    assert snapshots[-1].merges == summary["events"]["merges"]


def test_watching_does_not_change_the_weights(watched):
    summary, _ = watched
    unwatched, _ = run_virtual(CONFIG)
    assert unwatched["weights_sha256"] == summary["weights_sha256"]
    assert unwatched["events"] == summary["events"]


def test_longest_pause_is_the_longest_gap_between_merges_up_to_the_end():
    timeline = Timeline()
    for t in (3.0, 4.0, 12.0, 13.0):
        timeline.add(t, Happening.MERGE)
    timeline.add(5.0, Happening.FAILURE, 1)
    timeline.add(9.0, Happening.REJOINED, 1)
    events = timeline.summarize(end_s=15.0, slow_learners=())
    assert (events.longest_pause_s, events.longest_pause_from_s) == (8.0, 4.0)
    assert (events.failures, events.rejoins, events.merges) == (1, 1, 4)
    assert timeline.summarize(end_s=30.0, slow_learners=()).longest_pause_s == 17.0  # a stall at the end counts
    nothing = Timeline().summarize(end_s=7.0, slow_learners=(2,))
    assert (nothing.longest_pause_s, nothing.longest_pause_from_s, nothing.slow_learners) == (7.0, 0.0, (2,))


def test_outages_pair_each_failure_with_its_restart():
    timeline = Timeline()
    timeline.add(2.0, Happening.FAILURE, 1)
    timeline.add(3.0, Happening.FAILURE, 0)
    timeline.add(6.0, Happening.RESTART, 1)
    timeline.add(6.5, Happening.REJOINED, 1)
    timeline.add(9.0, Happening.FAILURE, 1)
    events = timeline.summarize(end_s=10.0, slow_learners=(0,))
    assert events.outages == ((1, 2.0, 6.0), (0, 3.0, None), (1, 9.0, None))  # None: still down at the end
    assert events.rejoined_at == ((1, 6.5),)
    assert events.counters() == {"failures": 3, "rejoins": 1, "merges": 0}
    assert events.to_dict()["outages"] == [[1, 2.0, 6.0], [0, 3.0, None], [1, 9.0, None]]


def test_the_summary_lists_the_outages_the_run_met(watched):
    summary, _ = watched
    outages = trace_until(summary["virtual_time_s"])
    assert summary["events"]["outages"] == [[o.learner, round(o.down_s, 3), round(o.up_s, 3)] for o in outages]
    assert sorted(m for m, _ in summary["events"]["rejoined_at"]) == sorted(o.learner for o in outages)
