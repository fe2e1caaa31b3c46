"""The synchronizer state machine, driven directly with explicit time."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ddiloco.core.codecs import get_codec
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.messages import Broadcast, LeaseExpired, Rejected, RoundClosed
from protocol_helpers import deliver, local_step, make_cluster

BASE = ProtocolConfig(fragments=3, period=3, quorum=2, grace_max_s=5.0, lease_s=10.0, overlap=2)


def contributions_for(cores, params, fragment, seed=0):
    """Have every learner step until ``fragment`` falls due; return its contributions."""
    out = []
    for m, (core, p) in enumerate(zip(cores, params)):
        while True:
            local_step(p, seed=seed * 100 + m * 10 + core.step)
            due = core.record_step(tokens=100, duration_s=1.0)
            match = [c for c in due if c.fragment == fragment]
            if match:
                out.append(match[0])
                break
    return out


def test_round_waits_for_quorum_then_grace_then_closes_with_everyone_who_came():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    c0, c1, c2 = contributions_for(cores, params, fragment=1)
    assert sync.contribute(c0, now=1.0) == []  # below quorum K=2
    assert sync.contribute(c1, now=1.5) == []  # quorum reached: grace window opens
    deadline = sync.next_deadline()
    assert deadline is not None and 1.5 < deadline <= 1.5 + BASE.grace_max_s
    assert sync.tick(deadline - 1e-6) == []
    actions = sync.contribute(c2, now=deadline - 1e-6)  # the straggler makes it inside the window
    record = next(a for a in actions if isinstance(a, RoundClosed))
    assert record.reason == "all-live"
    assert {m.learner_id for m in record.merged} == {"l0", "l1", "l2"}
    assert sync.versions()[1] == 1


def test_grace_expiry_closes_without_the_straggler_whose_late_work_joins_next_round():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    c0, c1, c2 = contributions_for(cores, params, fragment=1)
    sync.contribute(c0, now=1.0)
    sync.contribute(c1, now=1.0)
    deadline = sync.next_deadline()
    actions = sync.tick(deadline)
    record = next(a for a in actions if isinstance(a, RoundClosed))
    assert record.reason == "grace" and record.tokens == c0.tokens + c1.tokens
    assert sync.contribute(c2, now=deadline + 1) == []  # late: pending for version 2, not dropped
    assert sync.pending_tokens() == c2.tokens
    # ... and it does not open round 2 on its own: only contributions from version 1 count
    assert sync.next_deadline() == min(r.lease_until_s for r in sync.learners.values())
    deliver(actions, cores)
    (fresh,) = contributions_for(cores[:1], params[:1], fragment=1, seed=7)
    assert fresh.base_version == 1
    assert sync.contribute(fresh, now=deadline + 2) == []  # K=2 fresh needed
    (fresh1,) = contributions_for(cores[1:2], params[1:2], fragment=1, seed=8)
    record = next(a for a in sync.contribute(fresh1, now=deadline + 3) if isinstance(a, RoundClosed))
    assert record.reason == "all-live"  # everyone alive has work in it, the late one included
    assert {m.learner_id for m in record.merged} == {"l0", "l1", "l2"}


def test_merged_value_follows_token_weighted_rda_and_nesterov():
    config = dataclasses.replace(BASE, quorum=3, codec="fp32", downlink_codec="fp32")
    plan, sync, cores, params = make_cluster(config, learners=3)
    before = sync.value(1).clone()
    contribs = contributions_for(cores, params, fragment=1)
    actions = []
    for c in contribs:
        actions += sync.contribute(c, now=1.0)
    deltas = [get_codec("fp32").decode(c.payload, before.numel()).double() for c in contribs]
    w = torch.tensor([c.tokens**2 / c.steps for c in contribs], dtype=torch.float64)
    w /= w.sum()
    norms = torch.stack([d.norm() for d in deltas])
    direction = sum(wi * d / d.norm() for wi, d in zip(w, deltas))
    merged = (w @ norms) * direction / direction.norm()
    # first Nesterov step: buf = Δ, d = Δ + μΔ, Θ ← Θ − lr·d
    expected = before.double() - config.outer_lr * (1 + config.outer_momentum) * merged
    assert torch.allclose(sync.value(1).double(), expected, atol=1e-5)
    assert any(isinstance(a, Broadcast) and a.update.version == 1 for a in actions)


def test_learners_reconstruct_the_global_value_bit_for_bit():
    plan, sync, cores, params = make_cluster(dataclasses.replace(BASE, lease_s=1e6), learners=3)
    for rnd in range(3):
        actions = []
        for c in contributions_for(cores, params, fragment=2, seed=rnd):
            actions += sync.contribute(c, now=float(rnd))  # everyone alive came: closes at once
        deliver(actions, cores)
    assert sync.versions()[2] >= 2
    for core in cores:
        assert core.versions[2] == sync.versions()[2]
        assert torch.equal(core.anchor(2), sync.value(2))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda c: dataclasses.replace(c, fragment=99), "unknown_fragment"),
        (lambda c: dataclasses.replace(c, learner_id="ghost"), "unknown_learner"),
        (lambda c: dataclasses.replace(c, codec="fp32"), "bad_codec"),
        (lambda c: dataclasses.replace(c, payload=c.payload[:-1]), "bad_size"),
        (lambda c: dataclasses.replace(c, base_version=7), "future_version"),
    ],
)
def test_bad_contributions_are_rejected_counted_and_leave_global_state_untouched(mutate, reason):
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    before = [sync.value(p).clone() for p in range(3)]
    with pytest.raises(Rejected) as err:
        sync.contribute(mutate(c), now=1.0)
    assert err.value.reason == reason
    assert sync.rejections[reason] == 1
    assert sync.pending_tokens() == 0
    assert all(torch.equal(b, sync.value(p)) for p, b in enumerate(before))


def test_nan_and_absurd_norm_are_rejected():
    config = dataclasses.replace(BASE, codec="fp32")
    plan, sync, cores, params = make_cluster(config, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    n = plan.fragments[1].numel
    nan = torch.zeros(n)
    nan[3] = math.nan
    with pytest.raises(Rejected, match="non_finite"):
        sync.contribute(dataclasses.replace(c, payload=nan.numpy().tobytes()), now=1.0)
    huge = torch.full((n,), 1e6)
    with pytest.raises(Rejected, match="norm_bound"):
        sync.contribute(dataclasses.replace(c, payload=huge.numpy().tobytes()), now=1.0)
    assert sync.rejections == {"non_finite": 1, "norm_bound": 1}
    assert sync.learners["l0"].rejected == 2


def test_duplicates_and_stale_contributions_are_rejected():
    config = dataclasses.replace(BASE, quorum=1, staleness_max=1, lease_s=1e6)
    plan, sync, cores, params = make_cluster(config, learners=3)
    (c,) = contributions_for(cores[:1], params[:1], fragment=1)
    sync.contribute(c, now=1.0)
    with pytest.raises(Rejected, match="duplicate"):
        sync.contribute(c, now=1.1)
    sync.tick(sync.next_deadline())  # grace expires: version 1
    (d,) = contributions_for(cores[1:2], params[1:2], fragment=1)
    sync.contribute(dataclasses.replace(d, base_version=1), now=20.0)
    sync.tick(sync.next_deadline())  # version 2
    assert sync.versions()[1] == 2
    with pytest.raises(Rejected, match="stale"):
        sync.contribute(dataclasses.replace(c, seq=c.seq + 1), now=30.0)  # base 0 lags 2 > 1
    assert sync.rejections == {"duplicate": 1, "stale": 1}


def test_expired_lease_stops_the_wait_and_rejoin_gets_current_state():
    config = dataclasses.replace(BASE, quorum=3)
    plan, sync, cores, params = make_cluster(config, learners=3)
    c0, c1, _ = contributions_for(cores, params, fragment=1)
    for name in ("l0", "l1"):
        sync.heartbeat(name, now=5.0)
    sync.contribute(c0, now=5.0)
    assert sync.contribute(c1, now=5.0) == []  # K=3 needs l2
    actions = sync.tick(sync.next_deadline())  # l2's lease (renewed last at t=0) runs out at t=10
    assert any(isinstance(a, LeaseExpired) and a.learner_id == "l2" for a in actions)
    assert sync.alive() == ["l0", "l1"]
    closed = [a for a in actions if isinstance(a, RoundClosed)]
    assert closed and closed[0].quorum_required == 2  # K lowered to the live learners
    with pytest.raises(Rejected, match="unknown_learner"):
        sync.heartbeat("l2", now=11.0)
    state = sync.register("l2", now=12.0)
    assert state.versions() == sync.versions() and "l2" in sync.alive()


def test_strict_quorum_waits_for_everyone_even_when_leases_expire():
    config = dataclasses.replace(BASE, quorum=3, strict_quorum=True, blocking=True)
    plan, sync, cores, params = make_cluster(config, learners=3)
    c0, c1, c2 = contributions_for(cores, params, fragment=0)
    sync.contribute(c0, now=1.0)
    sync.contribute(c1, now=1.0)
    sync.tick(50.0)  # every lease expired: still no merge
    assert sync.versions()[0] == 0
    sync.register("l2", now=51.0)
    actions = sync.contribute(c2, now=51.0)
    assert [a.reason for a in actions if isinstance(a, RoundClosed)] == ["quorum"]


def test_checkpoint_round_trip_resumes_identically():
    plan, sync, cores, params = make_cluster(BASE, learners=3)
    for c in contributions_for(cores, params, fragment=1):
        sync.contribute(c, now=1.0)
    sync.tick(100.0)
    state = sync.state_dict()
    _, fresh, _, _ = make_cluster(BASE, learners=3)
    fresh.load_state_dict(state)
    assert fresh.versions() == sync.versions()
    assert all(torch.equal(fresh.value(p), sync.value(p)) for p in range(3))
    assert fresh.alive() == []  # learners must register again after a restart
