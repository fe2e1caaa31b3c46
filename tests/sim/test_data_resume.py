"""A crashed learner of the virtual cluster resumes its data at its data_position, as
``ddiloco learner`` does: what reached the global model is trained again for at most about one
period, and no batch is skipped (``core/sync_side/data_position.py``, ``sim/data_stream.py``)."""

from __future__ import annotations

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.harness import Recorder
from ddiloco.sim.synthetic import SyntheticWorkload
from ddiloco.sim.virtual_cluster import VirtualCluster


def test_a_crashed_learner_resumes_at_its_data_position_and_retrains_at_most_a_period():
    config = build_config(preset="tiny", overrides=(), run__learners=4, faults__mtbf_s=60.0, faults__downtime_s=5.0,
                          run__time_s=300.0, run__seed=3)
    workload = SyntheticWorkload(config)
    cluster = VirtualCluster(workload, Recorder(config, workload))  # type: ignore[arg-type]
    first_states: list[tuple[int, int, int]] = []
    on_ready = cluster.on_ready

    def ready(m: int, rejoined: bool) -> None:
        node = cluster.learners[m]
        if node.core.step == 0:  # a process's first state: where its data resumes, and where the synchronizer says
            positions = [lr.data_position for sync in cluster.syncs for lr in sync.core.status().learners
                         if lr.learner_id == node.name]
            first_states.append((m, node.core.next_batch, min(positions)))
        on_ready(m, rejoined)

    cluster.on_ready = ready  # type: ignore[method-assign]
    summary = cluster.run()
    period = cluster.protocol.period
    events = summary["events"]
    resumes = cluster.streams.resumes
    assert summary["finished"] and 10 <= len(resumes) <= events["failures"]  # a process may die before its first step
    assert all(batch == position for _, batch, position in first_states)  # where the synchronizer said
    assert [(m, b) for m, b, _ in first_states if b] == [(m, b) for m, b, _ in resumes if b]
    assert all(batch <= furthest for _, batch, furthest in resumes) and events["batches_skipped"] == 0
    assert sum(1 for _, batch, _ in resumes if batch > 0) >= len(resumes) - 2  # not from batch 0 again
    assert events["batches_retrained"] == sum(furthest - batch for _, batch, furthest in resumes) > 0
    # What reached the model and was trained again: about a period per restart (fragments are sent
    # H steps apart; a fragment whose rounds stall under heavy churn holds the position back longer).
    for m in range(config.run.learners):
        restarts = sum(1 for learner, _, _ in resumes if learner == m)
        assert cluster.streams.merged_twice(m) <= period * restarts
