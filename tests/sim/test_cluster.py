"""The virtual cluster end to end on the tiny preset: determinism, failures, baselines."""

from __future__ import annotations

import pytest

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual
from ddiloco.sim.snapshot import LearnerState
from ddiloco.workload.workload import Workload


def tiny(*overrides: str, **flags):
    return build_config(preset="tiny", overrides=overrides, **flags)


@pytest.fixture(scope="module")
def baseline():
    config = tiny()
    return run_virtual(config)


@pytest.mark.slow
def test_same_seed_same_weights_other_seed_other_weights(baseline):
    summary, _ = baseline
    again, _ = run_virtual(tiny())
    other, _ = run_virtual(tiny(run__seed=1))
    assert again["weights_sha256"] == summary["weights_sha256"]
    assert other["weights_sha256"] != summary["weights_sha256"]


def test_decoupled_run_trains_and_reports_what_happened(baseline):
    summary, rows = baseline
    assert rows[0]["eval_loss"] > 5.0 > summary["eval_loss"]  # learned something from ln(256)
    assert summary["tokens"] >= tiny().run.tokens
    assert all(v > 0 for v in summary["fragment_versions"])
    assert summary["goodput"] > 0.9 and summary["uptime"] > 0.95  # no failures configured
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0
    assert [r["virtual_time_s"] for r in rows] == sorted(r["virtual_time_s"] for r in rows)


@pytest.mark.slow
def test_failures_cost_goodput_but_the_global_model_keeps_advancing():
    config = tiny(run__learners=4, faults__mtbf_s=30.0, faults__downtime_s=10.0, run__time_s=120.0)
    summary, rows = run_virtual(config)
    assert 0.4 < summary["goodput"] < 0.95
    assert summary["uptime"] > 0.9  # some learner is always training
    assert min(rows[-1]["fragment_versions"]) > 5
    assert any(r["alive"] < 4 for r in rows) or summary["goodput"] < 0.9


@pytest.mark.slow
def test_nonelastic_data_parallel_stalls_on_the_same_failures_where_decoupled_does_not():
    flags = dict(run__learners=4, faults__mtbf_s=30.0, faults__downtime_s=10.0, run__time_s=120.0)
    workload = Workload.build(tiny(**flags))
    results = {}
    for mode in ("decoupled", "dp", "dp-elastic", "diloco"):
        summary, _ = run_virtual(tiny(run__mode=mode, **flags), workload=workload)
        results[mode] = summary
    assert results["dp"]["goodput"] < results["dp-elastic"]["goodput"] < results["decoupled"]["goodput"]
    assert results["diloco"]["goodput"] < results["decoupled"]["goodput"]
    assert results["dp"]["restarts"] > 0
    assert results["dp"]["uptime"] < results["decoupled"]["uptime"]


@pytest.mark.slow
def test_synchronous_diloco_goes_on_after_a_restart_and_waits_only_for_the_restarted_learner():
    """Blocking learners and a quorum of all: a restarted learner must send, first, the fragment
    the others wait on, and nobody may re-send out of phase after a round that waited for it.
    Either mistake left the global model standing still for hundreds of virtual seconds."""
    config = tiny(run__mode="diloco", run__learners=4, faults__mtbf_s=60.0, faults__downtime_s=6.0,
                  run__time_s=240.0)
    summary, _ = run_virtual(config)
    assert summary["events"]["failures"] >= 2 and summary["events"]["rejoins"] >= 2
    assert summary["events"]["longest_pause_s"] < 3 * config.faults.downtime_s


def test_late_learners_join_the_run_under_way_and_it_ends_sooner():
    """Scavenging: two more learners start 15 virtual s into a two-learner job. Until then they
    are *late* and take no step; then they join (fetching the global state) and train, and the
    same token budget is spent sooner than by the two alone."""
    alone, _ = run_virtual(tiny(run__learners=2, faults__mtbf_s=0.0))
    seen = []
    helped, _ = run_virtual(tiny(run__learners=4, cluster__late_learners=2, cluster__late_join_s=15.0,
                                 faults__mtbf_s=0.0), observer=seen.append)
    before = [s for s in seen if s.time_s < 15.0]
    assert before and all(view.state is LearnerState.LATE and view.steps == 0
                          for s in before for view in s.learners[2:])
    assert all(view.steps > 0 for view in before[-1].learners[:2])
    assert all(view.steps > 0 for view in seen[-1].learners)  # the late ones trained too
    assert helped["tokens"] >= tiny().run.tokens
    assert helped["virtual_time_s"] < alone["virtual_time_s"]
    assert helped["goodput"] > 0.9  # chip-time counts from each learner's arrival


def test_slow_hardware_learners_still_count_through_token_weights():
    config = tiny("cluster.slow_fraction=0.5", "cluster.slow_factor=1.5", "protocol.quorum=1")
    summary, _ = run_virtual(config)
    steps = summary["steps_per_learner"]
    assert steps[0] > steps[-1]  # the slow half did fewer steps in the same time
    assert summary["goodput"] > 0.85  # nobody waited for them


def test_sixteen_learners_run():
    config = tiny(run__learners=16, run__tokens=16 * 12 * 8 * 32)
    summary, _ = run_virtual(config)
    assert len(summary["steps_per_learner"]) == 16 and min(summary["steps_per_learner"]) >= 10


def test_mixture_of_experts_variant_trains_on_the_cluster():
    summary, rows = run_virtual(tiny("model.n_experts=4", "model.top_k=2", run__tokens=4 * 24 * 8 * 32))
    assert summary["eval_loss"] < rows[0]["eval_loss"] - 1.0
    assert min(summary["fragment_versions"]) >= 2
