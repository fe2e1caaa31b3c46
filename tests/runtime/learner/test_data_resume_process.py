"""A real ``ddiloco learner`` killed with kill -9 and started again resumes its data where its
work reached the global model, and says so in one line (``core/sync_side/data_position.py``).

Every wait polls the synchronizer's status with a generous deadline; nothing asserts on timing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from ddiloco.chaos.batch_counts import count_batches
from ddiloco.runtime.batch_log import read_batch_log
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import free_port, learner_args, status_of, sync_args, wait_for

pytestmark = pytest.mark.slow

PACE = ("--min-step-s", "0.02")
RESUMED = re.compile(r"resuming data at batch (\d+) \(every batch before it reached the global model\)")


def learner(status: dict | None, name: str) -> dict:
    return next((lr for lr in status["learners"] if lr["id"] == name), {}) if status else {}


def test_a_learner_killed_9_resumes_its_data_at_its_data_position(procs, tmp_path) -> None:
    tiny = build_config(preset="tiny")
    batch_log = ("--batch-log", str(tmp_path / "learner-0.batches"))  # what ddiloco chaos counts from
    tokens_per_step = tiny.train.batch_size * tiny.model.seq_len
    period = tiny.protocol.period
    port = free_port()
    procs.start("sync", *sync_args(port, "--tokens", str(10**9), learners=1))
    procs.start("a", *learner_args(port, "learner-0", *PACE, *batch_log))
    wait_for(lambda: learner(status_of(port), "learner-0").get("data_position", 0) >= 3 * period,
             "three periods of learner-0's data to reach the global model")
    assert "data from batch 0 (none of this learner's batches reached the global model yet)" in procs.log("a")

    procs.kill9("a")
    # Its lease runs out and the round holding its last contributions closes: the position stands still.
    dead = wait_for(lambda: (s := status_of(port)) and not learner(s, "learner-0")["alive"] and s,
                    "the killed learner's lease to expire")
    position = learner(dead, "learner-0")["data_position"]
    reported_steps = learner(dead, "learner-0")["tokens"] // tokens_per_step  # what its messages said it trained
    assert 0 < position <= reported_steps

    shown = subprocess.run([sys.executable, "-m", "ddiloco.cli", "status", f"127.0.0.1:{port}", "--json"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert learner(json.loads(shown.stdout), "learner-0")["data_position"] == position

    procs.start("a2", *learner_args(port, "learner-0", *PACE, *batch_log))
    line = wait_for(lambda: RESUMED.search(procs.log("a2")), "the restarted learner to say where its data resumes")
    resumed = int(line.group(1))
    print(f"killed after at least {reported_steps} batches; resumed at batch {resumed}")
    assert resumed == position  # > 0 and <= the batches it had trained
    back = wait_for(lambda: (s := status_of(port)) and learner(s, "learner-0")["alive"]
                    and learner(s, "learner-0")["data_position"] >= position + 2 * period and s,
                    "the restarted learner's data to reach the global model beyond where it resumed")
    assert learner(back, "learner-0")["registrations"] >= 2
    assert procs.procs["a2"].poll() is None and procs.procs["sync"].poll() is None

    # The batch log says the same from the learner's side, and no batch was skipped: the first process
    # trained every batch below the position it was given back, the second started there.
    procs.kill9("a2")
    first, second = read_batch_log(tmp_path / "learner-0.batches")
    assert first.resumed_at == 0 and first.trained_to >= position and second.resumed_at == position
    counts = count_batches([first, second], period, learner(status_of(port), "learner-0")["data_position"])
    print(f"batch log: {first} then {second}: {counts.retrained} batches trained again, {counts.skipped} skipped")
    assert counts.retrained == min(first.trained_to, second.trained_to) - position and counts.skipped == 0
