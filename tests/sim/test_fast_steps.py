"""A learner whose steps outrun its round trip merges each step's progress once.

Unpaced, the tiny preset steps every few milliseconds: two periods H pass long before the
update of the last send comes back. The send schedule used to wait at most two periods of
steps for that update, then sent a Δ measured from the same anchor, which carried the last
one's progress a second time (a real run diverged: eval loss 5.48 -> 8.08 with a learner
alone). The virtual cluster's invariants check every round for such a Δ.
"""

from __future__ import annotations

import pytest

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual


@pytest.mark.parametrize("learners", [1, 2])
def test_steps_much_shorter_than_the_round_trip_never_merge_progress_twice(learners: int) -> None:
    config = build_config(preset="tiny", overrides=(
        f"run.learners={learners}", "cluster.step_time_s=0.005", "cluster.latency_s=0.1", "run.time_s=2.0"))
    period = config.protocol.period
    round_trip_steps = 2 * config.cluster.latency_s / config.cluster.step_time_s
    assert round_trip_steps > 2 * period  # the update comes back after more than two periods of steps
    summary, rows = run_virtual(config)  # raises InvariantViolation on a Δ that carries merged progress
    assert min(summary["fragment_versions"]) >= 5
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
