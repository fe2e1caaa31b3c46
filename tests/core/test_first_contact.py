"""Before a learner joins (``core/learner_side/first_contact.py``): its wait for a synchronizer that
does not answer, and the check that the synchronizers it reached are one run's shards."""

from __future__ import annotations

import pytest

from ddiloco.core.learner_side.first_contact import ProbeMove, ProbeWait, ShardHeader, shard_order
from ddiloco.core.learner_side.link_watch import OUTAGE_AFTER_S, OUTAGE_SUMMARY_S
from ddiloco.core.shared.errors import ConfigError


def test_a_learner_says_once_that_it_waits_then_warns_after_the_outage_bound_and_every_summary():
    wait = ProbeWait(started_s=100.0)  # no timeout: it waits for ever
    assert wait.unanswered(100.0, 0.2) is ProbeMove.SAY_WAITING
    assert wait.unanswered(101.0, 0.4) is ProbeMove.WAIT
    first_warning = 100.0 + OUTAGE_AFTER_S
    assert wait.unanswered(first_warning - 0.1, 2.0) is ProbeMove.WAIT
    assert wait.unanswered(first_warning, 2.0) is ProbeMove.WARN
    assert wait.unanswered(first_warning + 2.0, 2.0) is ProbeMove.WAIT
    assert wait.unanswered(first_warning + OUTAGE_SUMMARY_S, 2.0) is ProbeMove.WARN
    assert wait.unanswered(1e9, 2.0) is ProbeMove.WARN  # never gives up without a timeout


def test_a_learner_gives_up_when_its_next_probe_would_come_after_its_join_timeout():
    wait = ProbeWait(started_s=0.0, timeout_s=5.0)
    assert wait.unanswered(0.0, 0.2) is ProbeMove.SAY_WAITING
    assert wait.unanswered(3.0, 2.0) is ProbeMove.WAIT  # the next probe at 5.0: still within
    assert wait.unanswered(3.1, 2.0) is ProbeMove.GIVE_UP


def _header(address: str, shard: int, shards: int = 2, run: str = "r") -> ShardHeader:
    return ShardHeader(address, run, shards, shard)


def test_the_shards_of_one_run_come_back_in_shard_order():
    assert shard_order([_header("b", 1), _header("a", 0)]) == [1, 0]
    assert shard_order([_header("a", 0, shards=1)]) == [0]


@pytest.mark.parametrize("headers, says", [
    ([_header("a", 0), _header("b", 1, run="other")], "serve different runs"),
    ([_header("a", 0)], "one of 2 shard(s), but 1 address(es)"),
    ([_header("a", 0), _header("b", 0)], "both serve shard 0"),
])
def test_synchronizers_that_are_not_one_runs_shards_each_once_are_refused_naming_them(headers, says):
    with pytest.raises(ConfigError) as err:
        shard_order(headers)
    assert says in str(err.value)
