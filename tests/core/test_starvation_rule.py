"""The link-starvation rule is written once (``core/shared/deadlines.py``): the learner applies it in steps
(``LinkWatch.check`` via ``starved``), the synchronizer in time (``Registry`` via ``starved_after_s``); a learner stepping at a steady pace
is called starved by both at the same step (within one step)."""

from __future__ import annotations

import pytest

from ddiloco.core.learner_side.link_watch import LinkWatch
from ddiloco.core.shared.actions import Starved
from ddiloco.core.shared.deadlines import starved_after_s


@pytest.mark.parametrize("lease_s, period, step_s", [(10.0, 5, 0.01), (1.0, 20, 0.5), (2.0, 3, 1.0)])
def test_the_learner_and_the_synchronizer_call_a_link_starved_at_the_same_step(lease_s, period, step_s):
    watch = LinkWatch(period, fragments=2, lease_s=lease_s, heartbeat_s=lease_s / 4)
    step = 0
    while True:
        step += 1
        now = step * step_s
        watch.answered(0, now, step)  # answered, never accepted
        if any(isinstance(a, Starved) for a in watch.check(step, now, training=True, rejoining=False)):
            break
        assert step < 10_000
    assert now - step_s < starved_after_s(lease_s, period, step_s) <= now + 1e-9
