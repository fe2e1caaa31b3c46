"""Issue 57: an honest learner whose steps are faster than ``protocol.min_step_s`` had its work
refused as ``implausible`` (one step per millisecond was the floor; a small model steps faster, and
so do the first steps of a loop that slows down later). Speed is now never a refusal: steps beyond
the clock are clipped (they count for neither the budget nor the merge weight), the work is merged.

The learners here are driven as fast as their core and this process allow, on the real clock.
"""

from __future__ import annotations

import time

from protocol_helpers import deliver, local_step, make_cluster

from ddiloco.core.shared.actions import Refused, Tick
from ddiloco.core.shared.protocol_config import ProtocolConfig

FAST = ProtocolConfig(fragments=3, period=30, quorum=1, lease_s=1e6, grace_max_s=1e-9, space_rounds=False)
"""The default ``min_step_s``; rounds close as soon as a contribution arrives."""
STEPS = 600


def test_learners_stepping_as_fast_as_they_can_have_every_contribution_accepted():
    started = time.perf_counter()
    plan, sync, cores, params = make_cluster(FAST, learners=2)  # both join at 0 on this clock
    answers: list[object] = []
    for s in range(STEPS):
        for core, p in zip(cores, params):
            local_step(p, seed=s)
            now = time.perf_counter() - started
            for send in core.record_step(100, 1e-6, now):
                c = send.encode()
                actions = sync.handle(c, now)
                answers.append(actions[0])
                if isinstance(actions[0], Refused):
                    core.on_refused(c, actions[0].reason, now)
                else:
                    core.on_accepted(c, now)
                deliver(actions, cores, now=now)
            deliver(sync.handle(Tick(), now), cores, now=now)
    refusals = [a for a in answers if isinstance(a, Refused)]
    assert not refusals, refusals[0]
    assert len(answers) >= STEPS // FAST.period  # each learner sent, and each send was answered
    assert min(sync.versions()) > 0  # and merged
    assert sync.status().honest_refused_steps == 0
