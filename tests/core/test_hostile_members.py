"""Issue 12's findings against the core: what one buggy or hostile member's message could do.

Each test sends what the probe sent and checks that the run's state did not move.
"""

from __future__ import annotations

import dataclasses

import pytest

from ddiloco.core.actions import Refused
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.messages import MAX_ID_CHARS, Heartbeat, Join, Leave, Progress, Session
from protocol_helpers import local_step, make_cluster, step

BASE = ProtocolConfig(fragments=3, period=3, quorum=2, grace_max_s=5.0, lease_s=10.0, overlap=2, space_rounds=False)


def a_contribution(cores, params):
    core, p = cores[0], params[0]
    for _ in range(100):
        local_step(p, seed=core.step)
        due = step(core, tokens=100, duration_s=1.0)
        if due:
            return due[0]
    raise AssertionError("no contribution fell due")


def test_a_contribution_without_tokens_cannot_be_built_nor_stepped():
    """Finding 1: tokens = 0 gave a round nothing to weigh, and its merge raised in the timer."""
    plan, sync, cores, params = make_cluster(BASE, learners=2)
    c = a_contribution(cores, params)
    with pytest.raises(ValueError, match="bad counters"):
        dataclasses.replace(c, tokens=0)
    with pytest.raises(ValueError, match="tokens"):
        cores[1].record_step(0, 1.0, 0.0)  # LearnerRuntime.step(tokens=0) ends here


def test_progress_of_a_refused_message_never_moves_the_budget():
    """Finding 2: a heartbeat from an unregistered id claiming 1e9 tokens ended a 1e9-token run."""
    plan, sync, cores, params = make_cluster(BASE, learners=2)
    before = sync.status().tokens
    ghost = Progress("ghost-boot", tokens=10**9, steps=10**9 // 64)
    for message in (Heartbeat("ghost", Session(sync.incarnation, 99), ghost),
                    Leave("ghost", Session(sync.incarnation, 99), ghost),
                    Heartbeat("l0", Session(sync.incarnation + 1, 0), ghost)):  # a stale session of a real id
        (reply,) = [a for a in sync.handle(message, 1.0) if isinstance(a, Refused)]
        assert reply.learner_id == message.learner_id
    assert sync.status().tokens == before


@pytest.mark.parametrize("tokens, steps", [(2**64 - 1, 2**58), (2**49, 2**40), (2**25, 1)])
def test_counts_beyond_any_run_are_malformed(tokens, steps):
    """Finding 3: two heartbeats of 2^64 - 1 tokens overflowed the status reply's int64 for good."""
    with pytest.raises(ValueError):
        Progress("b", tokens=tokens, steps=steps)


@pytest.mark.parametrize("field, value", [("compute_s", 1e300), ("compute_s", -1.0), ("step_time_s", -1e300),
                                          ("step_time_s", float("nan")), ("step_time_s", 1e9),
                                          ("seq", 2**63), ("base_version", 2**63)])
def test_timings_and_indices_out_of_range_are_malformed(field, value):
    """Finding 7 (goodput 1e298, a grace window forced to 0) and the 2^63 sequence number of finding 6."""
    plan, sync, cores, params = make_cluster(BASE, learners=2)
    c = a_contribution(cores, params)
    with pytest.raises(ValueError):
        dataclasses.replace(c, **{field: value})


@pytest.mark.parametrize("learner_id", ["x" * (MAX_ID_CHARS + 1), "has space", "tab\there", "", "ünïcode"])
def test_implausible_ids_are_malformed(learner_id):
    """Findings 4, 5 and 8: megabyte ids filled ledgers, checkpoint headers and reply metadata."""
    with pytest.raises(ValueError, match="learner id"):
        Join(learner_id, "boot")
    with pytest.raises(ValueError, match="boot id"):
        Join("learner-0", learner_id)


def test_honest_ids_and_counts_still_pass():
    Join("learner-0", "3f2a9c1e-boot")
    Join("host-17.rack:3/gpu@node", "b" * MAX_ID_CHARS)
    Progress("b", tokens=2**40, steps=2**20)
