"""The liveness bounds are defined once (core/shared/liveness.py) and both fault tools take them from there."""

from __future__ import annotations

import ast
import inspect

import pytest

from ddiloco.core.shared.liveness import catch_up_bound_s, pause_bound_s
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.swarm import draw_world, liveness_bound_s


def test_the_bounds_are_the_documented_sums():
    p = ProtocolConfig(lease_s=4.0, period=6, overlap=2, max_wait_s=3.0)
    assert pause_bound_s(p, grace_window_s=0.5) == 4.5
    assert catch_up_bound_s(p, rpc_timeout_s=2.0, slowest_step_s=1.5) == 3 * 4.0 + 2 * 2.0 + (6 + 2 + 2) * 1.5 + 3.0


def test_both_tools_import_the_one_definition():
    import ddiloco.chaos.report as chaos_report
    import ddiloco.sim.swarm as swarm

    for module in (chaos_report, swarm):
        tree = ast.parse(inspect.getsource(module))
        assert any(isinstance(n, ast.ImportFrom) and n.module == "ddiloco.core.shared.liveness" for n in ast.walk(tree)), module


@pytest.mark.parametrize("seed", [0, 7])
def test_simtest_checks_the_catch_up_bound_of_its_world(seed):
    config, _ = draw_world(seed)
    c = config.cluster
    slowest = c.step_time_s * (c.slow_factor if c.slow_fraction else 1.0)
    assert liveness_bound_s(config) == catch_up_bound_s(config.protocol, rpc_timeout_s=c.rpc_timeout_s,
                                                        slowest_step_s=slowest)


def test_chaos_checks_the_pause_bound_with_the_largest_grace_window(tmp_path):
    from ddiloco.chaos.outcome import ChaosOutcome, Sample, ShardCounts
    from ddiloco.chaos.report import build_report

    config = build_config(preset="tiny", overrides=("run.learners=2", "protocol.lease_s=3"))
    samples = [Sample(t_s=t, instance_id="a", phase="running", versions=(t,), alive={}, tokens=0,
                      grace_window_s=grace, longest_pause_s=0.0, shards=(ShardCounts("a", {}, {}),))
               for t, grace in ((0, 0.2), (1, 0.7), (2, 0.1))]
    outcome = ChaosOutcome(completed=True, failure="", records=[], samples=samples, sync_restarts=[],
                           final_status={}, eval_loss=None, wall_s=1.0, status_url="")
    report = build_report(outcome, config, window_s=1, seed=0, baseline=None)
    assert report["pause_bound_s"] == pause_bound_s(config.protocol, 0.7) == 3.7
