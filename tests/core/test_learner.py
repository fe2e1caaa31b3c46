"""The learner state machine: schedule, counters, merges with α, gaps and requeues."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddiloco.core.codecs import get_codec
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.fragments import flatten
from ddiloco.core.learner import UpdateResult
from ddiloco.core.messages import FragmentUpdate
from protocol_helpers import deliver, local_step, make_cluster

BASE = ProtocolConfig(fragments=3, period=3, quorum=1, lease_s=1e6, grace_max_s=1e-9)


def test_fragments_fall_due_at_their_offsets_with_counters_since_last_send():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    sent = []
    for step in range(1, 7):
        local_step(params, seed=step)
        sent += [(step, c.fragment, c.steps, c.tokens, c.first_step) for c in core.record_step(10, 0.5)]
    offsets = {f.index: f.offset for f in plan.fragments}
    assert [(s, p) for s, p, *_ in sent] == sorted(
        ((s, p) for s in range(1, 7) for p in range(3) if s % 3 == offsets[p]), key=lambda sp: sp[0]
    )
    second = [x for x in sent if x[0] > 3]
    assert all(steps == 3 and tokens == 30 for _, _, steps, tokens, _ in second)


def test_contribution_is_anchor_minus_local_and_update_merges_with_alpha():
    config = dataclasses.replace(BASE, codec="fp32", downlink_codec="fp32", alpha=0.5)
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    p = plan.due(3)[0] if plan.due(3) else 0
    anchor = core.anchor(p).clone()
    contribs = []
    for step in range(1, 4):
        local_step(params, seed=step)
        contribs += core.record_step(10, 0.5)
    c = next(c for c in contribs if c.fragment == p)
    local = flatten([params[n] for n in plan.fragments[p].param_names])
    delta = get_codec("fp32").decode(c.payload, anchor.numel())
    assert torch.allclose(delta, anchor - local)
    update = torch.full_like(anchor, 0.25)
    result = core.apply_update(FragmentUpdate(p, 1, "fp32", update.numpy().tobytes()))
    assert result is UpdateResult.APPLIED and core.versions[p] == 1
    merged = flatten([params[n] for n in plan.fragments[p].param_names])
    assert torch.allclose(merged, 0.5 * local + 0.5 * (anchor + update))
    assert torch.equal(core.anchor(p), anchor + update)


def test_duplicate_updates_are_ignored_and_a_missed_version_asks_for_full_state():
    plan, sync, (core,), _ = make_cluster(dataclasses.replace(BASE, downlink_codec="fp32"), learners=1)
    n = plan.fragments[0].numel
    payload = torch.zeros(n).numpy().tobytes()
    assert core.apply_update(FragmentUpdate(0, 1, "fp32", payload)) is UpdateResult.APPLIED
    assert core.apply_update(FragmentUpdate(0, 1, "fp32", payload)) is UpdateResult.IGNORED
    assert core.apply_update(FragmentUpdate(0, 3, "fp32", payload)) is UpdateResult.GAP
    assert core.versions[0] == 1


def test_requeued_contribution_is_folded_into_the_next_one():
    plan, sync, (core,), (params,) = make_cluster(BASE, learners=1)
    first = None
    for step in range(1, 4):
        local_step(params, seed=step)
        for c in core.record_step(10, 1.0):
            if c.fragment == 0:
                first = c
    assert first is not None
    core.requeue(first)  # the synchronizer was unreachable
    nxt = None
    for step in range(4, 7):
        local_step(params, seed=step)
        for c in core.record_step(10, 1.0):
            if c.fragment == 0:
                nxt = c
    assert nxt.steps == first.steps + 3 and nxt.tokens == first.tokens + 30
    assert nxt.first_step == first.first_step


def test_blocking_learner_waits_for_the_fragment_it_sent():
    config = dataclasses.replace(BASE, fragments=1, period=2, blocking=True, alpha=0.0)
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    local_step(params, seed=1)
    assert core.record_step(10, 1.0) == [] and core.can_step()
    local_step(params, seed=2)
    (c,) = core.record_step(10, 1.0)
    assert not core.can_step()
    deliver(sync.contribute(c, now=1.0), [core])
    assert core.can_step() and core.versions[0] == 1


def test_stepping_before_joining_is_an_error():
    plan, sync, cores, params = make_cluster(BASE, learners=1)
    from ddiloco.core.learner import Learner

    fresh = Learner("x", BASE, plan, params[0])
    with pytest.raises(RuntimeError):
        fresh.record_step(1, 1.0)
