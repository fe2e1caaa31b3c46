"""Small learners wired to a synchronizer over a perfect in-memory link, for core tests."""

from __future__ import annotations

import numpy as np
import torch

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.shared.actions import (
    Admitted,
    Broadcast,
    Refused,
    RoundClosed,
    SendHeartbeat,
    SendJoin,
    StateDelivered,
)
from ddiloco.core.shared.fragments import flatten, plan_fragments
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.accumulate import RoundAccumulator
from ddiloco.core.sync_side.synchronizer import Synchronizer

SHAPES = [("embed", (16, 4)), ("w1", (8, 8)), ("w2", (8, 8)), ("b1", (8,)), ("b2", (8,)), ("w3", (4, 8))]


def merged(acc: RoundAccumulator) -> torch.Tensor:
    """A round's merged Δ as its close computes it (the sum times the rule's factor), as a new tensor."""
    total, factor, _ = acc.accumulated()
    return torch.from_numpy(total * np.float32(factor))


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES}


def make_sync(config: ProtocolConfig, **kwargs) -> tuple:
    plan = plan_fragments(SHAPES, num_fragments=config.fragments, period=config.period, embedding_names=["embed"])
    init = make_params()
    sync = Synchronizer(
        config,
        [flatten([init[n] for n in f.param_names]) for f in plan.fragments],
        embedding_fragments=[f.index for f in plan.fragments if f.is_embedding],
        **kwargs,
    )
    return plan, sync


def join(core: Learner, sync: Synchronizer, now: float = 0.0) -> list:
    """Start a fresh learner: its join goes through the synchronizer, it adopts the reply (the
    synchronizer hears that the state arrived) and sends its first heartbeat."""
    (send,) = [a for a in core.start(now) if isinstance(a, SendJoin)]
    actions = sync.handle(send.message, now)
    reply = actions[0]
    assert isinstance(reply, Admitted), reply
    core.on_admitted(sync.state_for(reply.state), now, stop=reply.stop)
    sync.handle(StateDelivered(core.learner_id, reply.state.session), now)
    for beat in core.tick(now):
        assert isinstance(beat, SendHeartbeat)
        sync.handle(beat.message, now)
    return actions


def make_cluster(config: ProtocolConfig, learners: int = 3, **kwargs):
    plan, sync = make_sync(config, **kwargs)
    params = [make_params() for _ in range(learners)]
    cores = [Learner(f"l{m}", config, plan, params[m], boot=f"b{m}") for m in range(learners)]
    for core in cores:
        join(core, sync)
    return plan, sync, cores, params


def local_step(params: dict[str, torch.Tensor], seed: int, scale: float = 0.01) -> None:
    """Stand-in for an inner optimizer step: move every parameter a little."""
    g = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.add_(torch.randn(p.shape, generator=g), alpha=scale)


def step(core: Learner, tokens: int, duration_s: float, now: float = 0.0) -> list:
    """One inner step's accounting; returns the encoded contributions that fell due."""
    return [send.encode() for send in core.record_step(tokens, duration_s, now)]


def deliver(actions, cores, now: float = 0.0) -> int:
    """Apply every Broadcast to its recipients; return how many updates were applied."""
    by_name = {c.learner_id: c for c in cores}
    applied = 0
    for a in actions:
        if isinstance(a, Broadcast):
            for name in a.recipients:
                if name in by_name:
                    by_name[name].on_update(a.update, now)
                    applied += 1
    return applied


def refused(actions) -> Refused | None:
    """The reply refusing the request, if the first action is one."""
    return actions[0] if actions and isinstance(actions[0], Refused) else None


BASE = ProtocolConfig(fragments=3, period=3, quorum=2, grace_max_s=5.0, lease_s=10.0, overlap=2, space_rounds=False)


def contributions_for(cores, params, fragment, seed=0):
    """Have every learner step until ``fragment`` falls due; return its contributions.

    The other fragments' contributions are never delivered (the learner is told so, and folds
    them into its next ones, sent once the wait for their updates is over: the learner's clock
    is its steps of 1 s); the learner is told its call for ``fragment`` was answered (a learner
    holds a fragment's next send while the last one is unanswered)."""
    out = []
    for m, (core, p) in enumerate(zip(cores, params)):
        for _ in range(100):
            local_step(p, seed=seed * 100 + m * 10 + core.step)
            now = float(core.step)
            due = step(core, tokens=100, duration_s=1.0, now=now)
            for c in due:
                if c.fragment != fragment:
                    core.on_undelivered(c, now)
            match = [c for c in due if c.fragment == fragment]
            if match:
                core.on_accepted(match[0], 0.0)
                out.append(match[0])
                break
        else:
            raise AssertionError(f"fragment {fragment} never fell due for {core.learner_id}")
    return out


def closed(actions):
    return [a for a in actions if isinstance(a, RoundClosed)]


def one_learner_sent(config):
    """One learner after three steps: the synchronizer, the learner, what it sent, and a zero
    update's payload for the fragment of its first send."""
    plan, sync, (core,), (params,) = make_cluster(config, learners=1)
    sent = []
    for s in range(1, 4):
        local_step(params, seed=s)
        sent += step(core, 10, 1.0)
    return plan, sync, core, sent, torch.zeros(plan.fragments[sent[0].fragment].numel).numpy().tobytes()
