"""Issue 45: a learner on 127.0.0.1 under CPU contention was told "the link is too slow for this
model and period": its sends waited for a CPU that its steps were waiting for too. Behind now
compares the learner's own step time with its fastest before it blames the link."""

from __future__ import annotations

from protocol_helpers import deliver, local_step, make_cluster, step

from ddiloco.core.shared.actions import Behind, Refused
from ddiloco.core.shared.protocol_config import ProtocolConfig

BASE = ProtocolConfig(fragments=3, period=3, quorum=1, lease_s=1e6, grace_max_s=1e-9)


def behind_notice(step_s: list[float], held_from: int = 0) -> Behind:
    """The one Behind said by a learner whose steps take ``step_s[s]`` seconds each and whose sends
    are answered at once until step ``held_from``, then every other period."""
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    said, in_flight, now = [], [], 0.0
    for s in range(1, len(step_s)):
        now += step_s[s]
        local_step(params, seed=s)
        in_flight += step(core, 10, step_s[s], now)
        if s < held_from or s % (2 * BASE.period) == 0:  # a send waits for the one before: two periods
            for c in in_flight:
                (reply, *_) = answer = sync.handle(c, now)
                if isinstance(reply, Refused):
                    core.on_refused(c, reply.reason, now)
                else:
                    core.on_accepted(c, now)
                deliver(answer, [core], now=now)
            in_flight = []
        said += [a for a in core.tick(now) if isinstance(a, Behind)]
    (notice,) = said
    return notice


def test_a_slow_link_with_steps_at_their_pace_is_the_links_fault():
    notice = behind_notice([0.1] * 20 * BASE.period)
    assert not notice.cpu_bound and abs(notice.step_s - 0.1) < 1e-6
    assert "its steps keep their pace, so its link is too slow for this model and period" in notice.describe()


def test_steps_that_slowed_with_the_sends_blame_the_cpu_not_the_link():
    fast = 8 * BASE.period
    contended = [0.1] * fast + [0.4] * 12 * BASE.period  # other processes took the cores: steps and sends slow
    notice = behind_notice(contended, held_from=fast)
    assert notice.cpu_bound and abs(notice.step_s / notice.fastest_step_s - 4.0) < 1e-6
    text = notice.describe()
    assert "the CPU is short, not necessarily the link" in text and "too slow for this model" not in text
