"""Issue 53 in the simulator: the adversary's flood of abandoned joins (``faults.join_flood``) against
a run whose learners crash and restart. Every other join is abandoned once its state arrived, so
the flood holds every lease the registry grants, all the time.

Before the fix a learner restarting during the flood was refused (``registry_full``) until the flood
ended, and the flood's registrations counted as live learners: rounds waited for them to contribute
and never closed early. Now the run's learners take an idle registration's lease and the rounds wait
only for learners that were heard from: the run makes the decisions it makes without the flood."""

from __future__ import annotations

import pytest
import torch

from ddiloco.settings.config_sources import build_config
from ddiloco.settings.fault_kinds import FaultKind
from ddiloco.sim.harness import Recorder
from ddiloco.sim.synthetic import SyntheticWorkload
from ddiloco.sim.virtual_cluster import VirtualCluster

RUN = ("run.learners=2", "run.seed=1", "run.tokens=0", "run.time_s=60", "faults.mtbf_s=25", "faults.downtime_s=4",
       "faults.join_flood_s=500", "faults.join_flood_per_s=20")


def run(*overrides: str) -> tuple[dict, VirtualCluster]:
    torch.set_num_threads(1)
    config = build_config(preset="tiny", overrides=(*RUN, *overrides))
    workload = SyntheticWorkload(config)
    cluster = VirtualCluster(workload, Recorder(config, workload))  # type: ignore[arg-type]
    cluster.start()
    while cluster.running():
        cluster.step_event()
    return cluster.finish(), cluster


@pytest.mark.parametrize("quorum", [1, 2])
def test_learners_restarting_during_a_flood_of_abandoned_joins_rejoin_and_merge_as_without_it(quorum):
    calm, _ = run(f"protocol.quorum={quorum}", "faults.join_flood=0")
    flooded, cluster = run(f"protocol.quorum={quorum}", "faults.join_flood=1")
    (window,) = cluster.windows
    assert window.kind is FaultKind.JOIN_FLOOD and window.start_s < 5.0 and window.end_s > 60.0  # the whole run
    assert cluster.fate.flood_joins > 500 and flooded["rejections"]["registry_full"] > 0
    events, calm_events = flooded["events"], calm["events"]
    assert events["failures"] >= 2 and events["outages"] == calm_events["outages"]
    assert events["rejoined_at"] == calm_events["rejoined_at"]  # each at once, as without the flood
    assert (events["merges"], events["longest_pause_s"]) == (calm_events["merges"], calm_events["longest_pause_s"])
    assert flooded["fragment_versions"] == calm["fragment_versions"]
    assert flooded["honest_refused_steps"] == 0
