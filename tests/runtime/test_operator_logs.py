"""Issue 29: what an operator reads when the synchronizer goes away and comes back (real processes).

A SIGTERM of the synchronizer made each learner log about 170 lines a second (one per
undelivered call), its return a false "link too slow" warning, and the synchronizer itself
said only ``shutting down``. Every wait is on a log line or a status, with a generous deadline.
"""

from __future__ import annotations

import signal

import pytest

from ddiloco.testing import free_port, learner_args, status_of, sync_args, wait_for

pytestmark = pytest.mark.slow

PACE = ("--min-step-s", "0.05")
"""A send every 0.1 s (H = 6, 3 fragments). At 0.02 s, a synchronizer slowed by a loaded host
(load 4.7: two benchmarks beside the suite) answered too slowly before the outage, and the
learner was truly behind: its link window, full of those sends, said so after the rejoin."""
SCREEN_LINES = 25
"""What fits on one screen, with room to spare."""


def accepted(port: int) -> int:
    status = status_of(port)
    return sum(lr["accepted"] for lr in status["learners"]) if status else -1


def test_an_outage_of_the_synchronizer_is_a_few_lines_in_a_learners_log(procs, tmp_path) -> None:
    port = free_port()
    args = sync_args(port, "--tokens", str(10**9), "--state-dir", str(tmp_path / "state"), learners=1)
    procs.start("sync", *args)
    procs.start("a", *learner_args(port, "learner-0", *PACE))
    wait_for(lambda: accepted(port) >= 5, "the learner contributing")

    procs.procs["sync"].send_signal(signal.SIGTERM)
    assert procs.procs["sync"].wait(60) == 0
    said = procs.log("sync")
    assert "shutting down on SIGTERM: writing the final checkpoint to" in said
    assert "stopped by SIGTERM: final checkpoint written to" in said and "--resume" in said
    before = len(procs.log("a").splitlines())
    # Down for longer than one summary interval: the learner says so once, then sums up.
    wait_for(lambda: "unreachable for" in procs.log("a"), "a summary of the outage", timeout_s=90)
    procs.start("sync2", *args, "--resume")
    wait_for(lambda: "answers again after" in procs.log("a"), "the learner to see it back", timeout_s=90)
    resumed = wait_for(lambda: accepted(port) >= 1 and accepted(port), "work accepted again")
    wait_for(lambda: accepted(port) >= resumed + 20, "more work accepted after the outage")

    lines = procs.log("a").splitlines()[before:]
    outage = lines[:next(i for i, line in enumerate(lines) if "answers again after" in line) + 1]
    assert len(outage) <= SCREEN_LINES, "\n".join(outage)
    assert sum("does not answer" in line for line in outage) == 1
    assert not [line for line in lines if "undelivered" in line]  # not one line per call
    assert not [line for line in lines if "link carries" in line or "none of this learner's work" in line]
    assert any("a rejoin" in line for line in lines)  # the new incarnation's join is marked as one
    print("\n".join(outage))
