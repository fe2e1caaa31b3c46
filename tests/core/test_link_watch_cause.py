"""Issue 45: a learner on 127.0.0.1 under CPU contention was told "the link is too slow for this
model and period": its sends waited for a CPU that its steps were waiting for too. Behind now
compares the learner's own step time with its fastest before it blames the link; and (issue 57) a
learner whose synchronizer is on its own host never blames the link, a learner over a network says
it cannot tell a slow link from a busy synchronizer."""

from __future__ import annotations

from protocol_helpers import deliver, join, local_step, make_params, make_sync, step

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import Behind, Refused
from ddiloco.core.shared.protocol_config import ProtocolConfig

BASE = ProtocolConfig(fragments=3, period=3, quorum=1, lease_s=1e6, grace_max_s=1e-9)


def behind_notice(step_s: list[float], held_from: int = 0, on_loopback: bool = False) -> Behind:
    """The one Behind said by a learner whose steps take ``step_s[s]`` seconds each and whose sends
    are answered at once until step ``held_from``, then every other period."""
    plan, sync = make_sync(BASE)
    params = make_params()
    core = Learner("l0", BASE, plan, params, boot="b0", on_loopback=on_loopback)
    join(core, sync)
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


def test_over_a_network_steps_at_their_pace_point_at_the_link_or_the_synchronizers_cpu_and_say_which_is_unknown():
    notice = behind_notice([0.1] * 20 * BASE.period)
    assert not notice.cpu_bound and abs(notice.step_s - 0.1) < 1e-6
    text = notice.describe()
    assert "either its link is too slow for this model and period" in text
    assert "the synchronizer's host is short of CPU" in text and "cannot tell the two apart" in text


def test_on_loopback_the_round_trip_is_the_cpus_and_bandwidth_is_never_named():
    """Issue 57: every real run on one loaded host said "its link is too slow" with steps of 1 ms
    that kept their pace, and sent the user to ``ddiloco bandwidth``: on loopback it is the CPU."""
    notice = behind_notice([0.001] * 20 * BASE.period, on_loopback=True)
    assert notice.on_loopback and not notice.cpu_bound
    text = notice.describe()
    assert "the synchronizer is on this host" in text and "CPU time, not the link" in text
    assert "bandwidth" not in text and "too slow" not in text


def test_steps_that_slowed_with_the_sends_blame_the_cpu_not_the_link():
    fast = 8 * BASE.period
    contended = [0.1] * fast + [0.4] * 12 * BASE.period  # other processes took the cores: steps and sends slow
    notice = behind_notice(contended, held_from=fast)
    assert notice.cpu_bound and abs(notice.step_s / notice.fastest_step_s - 4.0) < 1e-6
    text = notice.describe()
    assert "the CPU is short, not necessarily the link" in text and "too slow for this model" not in text
