"""A synchronizer killed with kill -9 between two checkpoints loses no merged round.

Real processes: the round log (``runtime/sync/round_log.py``) must be on disk before an
update leaves, and ``--resume`` must replay it. No checkpoint is written during the run here
(only the first, at start), so everything the learners received after it comes back from
the log alone; the learners, which hold those versions, rejoin without adopting an older
state and keep contributing.
"""

from __future__ import annotations

import re

import pytest

from ddiloco.testing import free_port, learner_args, status_of, sync_args, wait_for

pytestmark = pytest.mark.slow

PACE = ("--min-step-s", "0.25")
"""Slow enough that the seconds a synchronizer takes to restart are a few periods of steps:
progress that short is kept across the rejoin (longer would exceed the norm bound)."""
ADOPTED = re.compile(r"adopted the global state at versions \[([\d, ]*)\](?:; kept this learner's progress on "
                     r"fragments \[([\d, ]*)\])?")
JOINED = re.compile(r"learner (learner-\d) (?:re)?joined .* at versions \[([\d, ]*)\]")


def test_a_synchronizer_killed_9_between_checkpoints_resumes_at_every_version_a_learner_received(procs, tmp_path):
    port = free_port()
    args = sync_args(port, "--tokens", str(10**9), "--state-dir", str(tmp_path / "state"),
                     "--checkpoint-every-rounds", "1000000", "--checkpoint-every", "100000")
    procs.start("sync", *args)
    for i in range(2):
        procs.start(f"l{i}", *learner_args(port, f"learner-{i}", *PACE))
    before = wait_for(lambda: (s := status_of(port)) and sum(f["version"] for f in s["fragments"]) >= 30
                      and all(lr["accepted"] >= 5 for lr in s["learners"]) and s, "rounds merged by both learners")
    assert before["checkpoints"] == 0

    procs.kill9("sync")
    procs.start("sync2", *args, "--resume")
    wait_for(lambda: len(JOINED.findall(procs.log("sync2"))) >= 2, "both learners to rejoin by themselves")
    resumed_log = procs.log("sync2")
    replayed = int(re.search(r"\((\d+) rounds from the round log", resumed_log).group(1))
    merged = sum(f["version"] for f in before["fragments"])
    assert replayed >= merged - len(before["fragments"])  # all but rounds still being logged at the status
    resumed = status_of(port)
    served = [f["version"] for f in sorted(resumed["fragments"], key=lambda f: f["id"])]
    for learner_id, held in JOINED.findall(resumed_log):
        held_versions = [int(v) for v in held.split(",")]
        # No learner holds a version the synchronizer lost (it would have to adopt an older state).
        assert all(h <= s for h, s in zip(held_versions, served)), (learner_id, held_versions, served)
    for i in range(2):
        # Each learner's versions when the synchronizer died, and what it took at the rejoin: never older.
        log = wait_for(lambda: (text := procs.log(f"l{i}")).count("adopted the global state") >= 2 and text,
                       f"learner-{i} to take the resumed state")
        held = [int(v) for v in re.findall(r"versions \[([\d, ]*)\]", log.split("does not answer")[0])[-1].split(",")]
        taken = ADOPTED.findall(log)[-1]
        assert all(t >= h for t, h in zip((int(v) for v in taken[0].split(",")), held)), (held, taken)
        print(f"learner-{i}: held {held} when the synchronizer died, took {taken[0]}, kept {taken[1] or 'nothing'}")

    # Their next contributions are accepted: the run goes on from where it was.
    wait_for(lambda: (s := status_of(port)) and all(lr["accepted"] >= 3 for lr in s["learners"]),
             "both learners' contributions accepted by the resumed synchronizer")
