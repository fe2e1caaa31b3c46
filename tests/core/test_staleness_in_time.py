"""Issue 42: honest work held seconds by a link fault is not refused, however many versions the
run merged meanwhile (``core/shared/staleness.py``, :class:`StalenessBound`).

The chaos case: a tiny unpaced run merges 17-20 versions a second per fragment, so a fault that
holds a learner's work 1-3 s makes it 17-69 versions late, past the bound of 16 versions (reach 4 then), and the
every-fault-kind chaos run refused 1,755 and 2,489 honest steps (docs/chaos.md). Here l1 keeps a
fragment's rounds going 20 a second while l0's contribution is held; the clock is the argument
each event comes with, as in every core test.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from protocol_helpers import BASE, closed, contributions_for, deliver, make_cluster, refused

from ddiloco.core.shared.actions import Tick
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.staleness import StalenessBound, SupersededTimes, staleness_limit, staleness_weight
from ddiloco.core.sync_side.merge import token_weight

FAST = dataclasses.replace(BASE, quorum=1, lease_s=5.0, grace_max_s=1e-3)
"""The chaos run's lease; one learner's fresh work closes a round (a grace window of at most 1 ms)."""
ROUND_S = 0.05
"""20 versions a second of fragment 1."""


def held(config, hold_s: float):
    """l0's contribution of fragment 1, measured from version 0, arrives ``hold_s`` after it was
    sent while l1 kept the fragment's rounds going every ``ROUND_S``: the synchronizer, the
    contribution, its reply and the versions it lags."""
    plan, sync, cores, params = make_cluster(config, learners=2)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    assert c.base_version == 0
    now, rnd = 0.0, 0
    while now + ROUND_S < hold_s:
        rnd += 1
        now = rnd * ROUND_S
        (d,) = contributions_for(cores[1:], params[1:], fragment=1, seed=rnd)
        actions = sync.handle(d, now)
        assert refused(actions) is None
        if not closed(actions):
            actions += sync.handle(Tick(), sync.next_deadline())
        assert closed(actions), "l1's fresh work alone closes the round"
        deliver(actions, cores[1:])  # l1 follows the model; l0's link holds everything meanwhile
    lag = sync.fragment_version(1) - c.base_version
    return sync, c, sync.handle(c, hold_s), lag, cores, params


def test_work_held_two_seconds_while_the_run_merges_twenty_versions_a_second_is_merged():
    sync, c, reply, lag, cores, params = held(FAST, hold_s=2.0)
    assert lag > staleness_limit(FAST.staleness_max, FAST.staleness_reach) * 2  # 39 versions late: 2.4x the reach
    assert refused(reply) is None
    status = sync.status()
    assert status.rejections == {} and status.honest_refused_steps == 0
    assert sync.pending_tokens() == c.tokens
    (d,) = contributions_for(cores[1:], params[1:], fragment=1, seed=1000)  # l1's next fresh work closes the round
    (record,) = closed(sync.handle(d, 2.0 + ROUND_S) + sync.handle(Tick(), 2.0 + ROUND_S + 1e-3))
    assert sorted((m.learner_id, m.base_version) for m in record.merged) == [("l0", 0), ("l1", lag)]


def test_a_learner_late_beyond_the_reach_for_longer_than_the_bound_in_time_has_a_link_too_long():
    """The bound in time is for a delay: a learner held by a fault is late for the fault's length.
    One whose work lags beyond the reach for longer than the bound (a lease) is on a link too long
    for the period, and merging such work left the model worse than without it at 4x and 8x
    staleness_max (docs/design.md, *One learner on a long link*): refused from then on, said why,
    although each contribution's base was superseded well inside the bound (its round trip)."""
    plan, sync, cores, params = make_cluster(FAST, learners=2)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    verdicts = []
    for rnd in range(1, 161):  # 8 s of rounds, 20 a second, l1's fresh work closing each
        now = rnd * ROUND_S
        (d,) = contributions_for(cores[1:], params[1:], fragment=1, seed=rnd)
        actions = sync.handle(d, now)
        if not closed(actions):
            actions += sync.handle(Tick(), sync.next_deadline())
        deliver(actions, cores[1:])
        if rnd % 10 == 0 and rnd >= 30:  # every half second from 1.5 s, l0's work arrives 20 versions late
            far = dataclasses.replace(c, seq=c.seq + rnd, base_version=sync.fragment_version(1) - 20)
            verdicts.append((now, refused(sync.handle(far, now))))
    first = verdicts[0][0]
    assert all(r is None for t, r in verdicts if t - first < FAST.lease_s)  # a delay, as far as a lease tells
    late = [r for t, r in verdicts if t - first >= FAST.lease_s]
    assert late and all(r is not None and r.reason == "stale" and "a link too long for this period" in r.detail
                        for r in late)
    assert sync.status().honest_refused_steps == len(late) * c.steps


def test_a_member_sending_old_based_work_within_the_time_bound_cannot_steer_the_model():
    """The time bound lets in old-based Δ from anyone, a hostile member too: what holds it is what
    holds fresh work (any payload could be sent from the current version at full weight). Its
    weight is scaled down by its lag, and a norm no change of scale explains is still refused."""
    config = dataclasses.replace(FAST, codec="fp32", downlink_codec="fp32")
    sync, c, reply, lag, cores, params = held(config, hold_s=2.0)
    assert refused(reply) is None and lag == 39
    (entry,) = [e for key, e in sync._fragments[1].accumulator._entries.items() if key[0] == "l0"]
    assert entry.weight == pytest.approx(token_weight(c.tokens, c.steps) * staleness_weight(lag, config.staleness_max))
    assert staleness_weight(lag, config.staleness_max) == pytest.approx(5 / 40)
    n = len(c.payload) // 4
    huge = torch.full((n,), 1e6 / n**0.5)  # ‖Δ‖ = 10^6: far beyond ten times the bound
    steer = dataclasses.replace(c, seq=c.seq + 1, payload=huge.numpy().tobytes())
    assert refused(sync.handle(steer, 2.01)).reason == "norm_bound"


def test_the_bound_in_versions_alone_refused_that_work_as_stale():
    """What the code before this bound did (``staleness_leases=0``): the same work thrown away."""
    sync, c, reply, lag, cores, params = held(dataclasses.replace(FAST, staleness_leases=0.0), hold_s=2.0)
    assert refused(reply).reason == "stale" and refused(reply).detail == "base version 0 lags 39 by more than 12"
    assert sync.status().honest_refused_steps == c.steps


def test_work_whose_base_was_superseded_longer_ago_than_the_bound_is_refused_with_both_bounds_named():
    config = dataclasses.replace(FAST, staleness_leases=0.2)  # 1 s
    sync, c, reply, lag, cores, params = held(config, hold_s=2.0)
    assert refused(reply).reason == "stale"
    detail = refused(reply).detail
    assert f"by more than {staleness_limit(config.staleness_max, config.staleness_reach)}" in detail
    assert "superseded more than 1 s ago (bound 1 s)" in detail


def test_a_version_superseded_before_the_synchronizer_started_has_no_time_and_only_the_version_bound_applies():
    times = SupersededTimes()
    times.superseded(7, 10.0, keep_s=5.0)  # the first close this process saw: version 7 ended
    times.superseded(8, 12.0, keep_s=5.0)
    assert times.age_s(7, 13.0) == pytest.approx(3.0) and times.age_s(8, 13.0) == pytest.approx(1.0)
    assert times.age_s(6, 13.0) is None  # restored from the checkpoint: another process's clock
    times.superseded(9, 16.0, keep_s=5.0)  # version 7 ended 6 s ago: forgotten, past any bound
    assert times.age_s(7, 16.0) == math.inf and times.age_s(9, 16.0) == 0.0
    assert times.age_s(6, 16.0) is None and times.age_s(10, 16.0) is None  # not yet superseded
    bound = StalenessBound(versions=16, seconds=5.0)
    assert bound.merges(16, None) and not bound.merges(17, None)
    assert bound.merges(40, 4.9) and not bound.merges(40, 5.0)
    assert not StalenessBound(versions=16, seconds=0.0).merges(17, 0.0)  # 0: the bound in versions alone


def test_the_time_bound_follows_the_lease_and_a_negative_one_is_a_config_error():
    assert StalenessBound.of(FAST) == StalenessBound(versions=12, seconds=5.0)  # reach 3 x staleness_max 4
    assert StalenessBound.of(dataclasses.replace(FAST, staleness_leases=2.0)).seconds == 10.0
    with pytest.raises(ConfigError, match="protocol.staleness_leases must be >= 0, got -1"):
        dataclasses.replace(FAST, staleness_leases=-1.0).validate()
