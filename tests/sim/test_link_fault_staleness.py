"""Issue 42 in the simulator: a link fault that holds a learner's work for seconds, on a run that
merges many versions a second, refuses none of it (``core/shared/staleness.py``).

The shape of the every-fault-kind chaos run (docs/chaos.md, "The CI version"): steps of 10 ms,
H = 6, a round of a fragment every ~60 ms, and for two virtual seconds a one-way latency of 1 s
on learner-1's link, both ways (the chaos proxy's latency fault at ten times its delay): what it
sends then arrives tens of versions late, past the bound of 16 versions. The virtual cluster is
deterministic; the invariants (merged work within the staleness bounds among them) are checked
as it runs.
"""

from __future__ import annotations

import pytest

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.harness import Recorder
from ddiloco.sim.virtual_cluster import VirtualCluster
from ddiloco.workload.workload import Workload

FAULT_S = (1.0, 3.0)
LATENCY_S = 1.0


def run_with_a_held_link(*overrides: str) -> tuple[dict, int]:
    """The run's result, and the most versions learner-1's merged work lagged."""
    config = build_config(preset="tiny", overrides=(
        "cluster.step_time_s=0.01", "run.learners=2", "run.seed=3", "run.tokens=0", "run.time_s=4",
        "faults.mtbf_s=0", *overrides))
    workload = Workload.build(config, None)
    cluster = VirtualCluster(workload, Recorder(config, workload))
    lags: list[int] = []
    on_round = cluster.on_round

    def watch(record, value):
        lags.extend(record.version - 1 - m.base_version for m in record.merged if m.learner_id == "learner-1")
        on_round(record, value)

    cluster.on_round = watch  # type: ignore[method-assign]
    cluster.start()
    normal = config.cluster.latency_s
    for until_s, latency_s in ((FAULT_S[0], LATENCY_S), (FAULT_S[1], normal), (float("inf"), normal)):
        while cluster.running() and cluster.queue.now < until_s:
            cluster.step_event()
        cluster.network.set_latency("learner-1", latency_s)
    return cluster.finish(), max(lags, default=0)


@pytest.mark.slow
def test_work_held_seconds_by_a_link_fault_on_a_fast_run_is_merged_not_refused():
    before, _ = run_with_a_held_link("protocol.staleness_leases=0")  # the bound in versions alone
    assert before["honest_refused_steps"] > 0 and before["rejections"].get("stale", 0) > 0
    result, most_late = run_with_a_held_link()
    assert most_late > 16  # merged from further behind than the bound in versions reaches
    assert result["rejections"] == {} and result["honest_refused_steps"] == 0
