"""What the synchronizer's status says about budgets and rates (issue 29): every budget with
what is left of it, and rates that fall to 0 with the learner that made them."""

from __future__ import annotations

import dataclasses

import pytest
from protocol_helpers import BASE, contributions_for, make_cluster, refused

from ddiloco.core.shared.actions import Tick
from ddiloco.core.shared.messages import Heartbeat, Leave, Progress, Session
from ddiloco.core.sync_side.claims import ClaimLimits
from ddiloco.core.sync_side.learner_record import ACCEPT_TIMES, LearnerRecord
from ddiloco.core.sync_side.run_state import RunLimits, RunPhase, RunState


def by_id(status):
    return {lr.learner_id: lr for lr in status.learners}


@pytest.mark.parametrize("ending", ["leave", "lease"])
def test_a_gone_learners_rate_is_zero_at_once(ending):
    """It showed its last minute's count (``per min 256``) for a minute after its lease expired."""
    config = dataclasses.replace(BASE, quorum=3, lease_s=10.0)
    _, sync, cores, params = make_cluster(config, learners=3)
    c0, c1, _ = contributions_for(cores, params, fragment=1)
    assert not refused(sync.handle(c0, 1.0)) and not refused(sync.handle(c1, 1.0))
    assert by_id(sync.status(2.0))["l0"].accepted_per_min == 1
    if ending == "leave":
        sync.handle(Leave("l0", cores[0].session, cores[0].progress), 3.0)
    else:  # l1 and l2 keep beating; l0 falls silent
        for t in range(2, 13):
            for core in cores[1:]:
                sync.handle(Heartbeat(core.learner_id, core.session, core.progress), float(t))
            sync.handle(Tick(), float(t))
    learners = by_id(sync.status(19.0))
    assert not learners["l0"].alive and learners["l0"].accepted_per_min == 0
    assert learners["l1"].accepted_per_min == 1  # alive: its minute still counts


def test_a_rate_beyond_the_kept_acceptances_is_scaled_not_capped():
    """Only the last ACCEPT_TIMES acceptances are kept: a faster learner read exactly that many."""
    rec = LearnerRecord(Session(0, 1))
    rec.accept_times.extend(i * 0.1 for i in range(2 * ACCEPT_TIMES))  # 600 a minute for 51 s
    assert rec.accepted_per_min(2 * ACCEPT_TIMES * 0.1) == pytest.approx(600, rel=0.01)
    rec.alive = False
    assert rec.accepted_per_min(2 * ACCEPT_TIMES * 0.1) == 0


def test_a_time_budget_shows_with_the_time_left():
    """Status said ``token_budget: 0`` and nothing about a ``--time`` budget."""
    sync = make_cluster(BASE, learners=2, limits=RunLimits(time_s=100.0))[1]  # joined at 0
    status = sync.status(30.0)
    assert (status.time_budget_s, status.elapsed_s, status.time_left_s) == (100.0, 30.0, 70.0)
    assert (status.token_budget, status.tokens_left) == (0, 0)
    sync.handle(Tick(), 100.0)
    assert sync.phase in (RunPhase.STOPPING, RunPhase.FINISHED)
    assert (sync.status(130.0).time_left_s, sync.status(130.0).elapsed_s) == (0.0, 100.0)


def test_a_token_budget_shows_the_tokens_left():
    _, sync, cores, _ = make_cluster(BASE, learners=2, limits=RunLimits(tokens=10_000))
    sync.handle(Heartbeat("l0", cores[0].session, Progress("b0", tokens=2_500, steps=25)), 1.0)
    status = sync.status()
    assert (status.tokens, status.token_budget, status.tokens_left) == (2_500, 10_000, 7_500)
    assert (status.time_budget_s, status.time_left_s) == (0.0, 0.0)


def test_a_restored_run_keeps_its_clock_until_a_learner_comes_back():
    """The time a run had counted stays in its status and its next checkpoint while it waits
    for its learners (a checkpoint taken then used to reset the clock to 0)."""
    run = RunState.new(RunLimits(time_s=100.0), ClaimLimits(0.0, 0))
    run.load_state_dict({"phase": "running", "elapsed_s": 30.0, "progress": RunState.new(
        RunLimits(), ClaimLimits(0.0, 0)).progress.state_dict()})
    assert run.phase is RunPhase.WAITING
    assert run.state_dict(500.0)["elapsed_s"] == 30.0 and run.time_left_s(500.0) == 70.0
    run.start(500.0)
    assert run.time_left_s(520.0) == 50.0
