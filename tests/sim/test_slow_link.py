"""Issue 20, item 0, in the simulator: a link slower than the lease for the full state still merges.

On real 2 and 1 Mbit/s links the full fp32 state took longer to arrive than the lease lasted:
the lease ran out during the join, the learner registered again, and every contribution was
refused, while the learners trained at full speed and nothing merged. The same shape here:
the tiny preset's state (136 kB) takes 2.7 virtual seconds on a 400 kbit/s link, the lease
is 2 s.
"""

from __future__ import annotations

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual


def test_a_join_slower_than_the_lease_cannot_expire_its_own_lease_and_the_run_merges():
    config = build_config(preset="tiny", overrides=(
        "cluster.bandwidth_bps=4e5", "protocol.lease_s=2.0", "protocol.heartbeat_s=0.5", "run.learners=2"))
    state_bits = 8 * 4 * 33952
    assert state_bits / config.cluster.bandwidth_bps > config.protocol.lease_s  # the state outlasts a lease
    summary, rows = run_virtual(config)
    assert summary["rejections"] == {}  # no lease ran out under a learner: nothing refused, no rejoin
    assert summary["events"]["rejoins"] == 0
    assert min(summary["fragment_versions"]) >= 10 and summary["eval_loss"] < rows[0]["eval_loss"]
