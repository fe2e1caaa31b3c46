"""`ddiloco run --runtime processes` (Decoupled DiLoCo and real data parallel), how it ends when killed or
told to stop, and a learner that is a torchrun job of two ranks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess

import pytest

from ddiloco.baseline.dp_worker import CHECKPOINT
from ddiloco.commands.display import what_happened
from ddiloco.commands.run import run_real
from ddiloco.outputs.reporting import SUMMARY_KEYS
from ddiloco.runtime.launch.launcher import run_processes
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import (
    ddiloco_session,
    free_port,
    learner_args,
    session_pids,
    status_of,
    stop_session,
    sync_args,
    wait_for,
    wait_until_running,
)
from ddiloco.workload.checkpoint import load_checkpoint
from ddiloco.workload.workload import Workload

pytestmark = pytest.mark.slow


def test_process_run_writes_what_a_virtual_run_writes_from_the_same_start(tmp_path) -> None:
    # 96 steps of the tiny model, not 48: where one learner starts ~70 ms after the other, the outer
    # momentum of so short a run can overshoot on its last merges (the virtual cluster, tiny, 12288 tokens,
    # cluster.step_time_s=0.005, cluster.latency_s=0.01, cluster.late_learners=1, cluster.late_join_s=0.07:
    # one merge at the stop takes the eval loss from 3.09 to 6.62; 3 of 72 such worlds end above the start,
    # none of them at 24576 tokens; under a loaded suite this run ended at 6.65 and 7.63 in 2 of about 40).
    config = build_config(preset="tiny", overrides=("run.learners=2", "run.tokens=24576"))
    seen = []
    # Unpaced: the tiny model steps every 6 ms, faster than an update comes back. The send schedule
    # once held a send for two periods of steps only, and this run diverged (eval loss 5.48 -> 8.08):
    # the next Δ, from the same anchor, carried the last one's progress again (tests/sim/test_fast_steps.py).
    summary, rows = run_processes(config, tmp_path, lambda fraction, row: seen.append(fraction), timeout_s=240)
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["runtime"] == "processes" and summary["learners"] == 2
    assert summary["tokens"] >= 24576 and min(summary["fragment_versions"]) >= 1
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0 and 0 < summary["goodput"] <= 1
    # The final loss above the first (8.08 against 5.48) is what double-counted Δs do: say what the run did.
    story = {k: summary.get(k) for k in ("steps_per_learner", "own_steps_per_learner", "rounds_closed", "rejections",
                                         "refused_steps", "fragment_versions")}
    assert rows[-1]["eval_loss"] == summary["eval_loss"] < rows[0]["eval_loss"], ([r["eval_loss"] for r in rows], story)
    assert seen and seen[-1] == 1.0
    # Issue 45: the same "what happened" as the virtual cluster's (summary.json had events None).
    events = summary["events"]
    # No learner failed; a rejoin is the protocol at work when a loaded machine starves a learner past its lease.
    assert events["failures"] == 0 and isinstance(events["rejoins"], int)
    assert events["merges"] == sum(summary["rounds_closed"].values()) > 0
    assert 0 <= events["longest_pause_s"] <= rows[-1]["virtual_time_s"]
    assert what_happened(summary, slow_factor=config.cluster.slow_factor)[0].startswith("0 learner failures")
    # Same model, same initial weights and the same evaluation as the virtual cluster's.
    workload = Workload.build(config)
    assert rows[0]["eval_loss"] == workload.evaluate(workload.new_model())
    assert rows[0]["fragment_versions"] == [0, 0, 0]
    # Each learner trains on its own shard (a learner slow to start may find the budget spent).
    logs = [(tmp_path / "logs" / f"learner-{i}.log").read_text() for i in range(2)]
    assert any("training as learner" in log for log in logs)
    for i, log in enumerate(logs):
        assert "training as learner" not in log or f"training as learner learner-{i} (data shard {i} of 2" in log
        assert "Traceback" not in log


def test_a_late_learner_process_joins_the_run_under_way_and_its_work_reaches_the_model(tmp_path) -> None:
    """Scavenging on real processes: the launcher starts learner-2 eight seconds in, after the
    others have trained; it joins the running job over gRPC (a state transfer, as a restarted
    learner) and trains its own shard."""
    config = build_config(preset="tiny", overrides=("run.learners=3", "run.time_s=20", "cluster.late_learners=1",
                                                    "cluster.late_join_s=8"))
    # Paced (50 ms steps, the tiny model's take a few): a 20 s run of learners that spin takes the cores
    # the rest of the suite runs on, and the late join needs only that the others have merged.
    summary, _ = run_processes(config, tmp_path, timeout_s=240, min_step_s=0.05)
    log = (tmp_path / "logs" / "learner-2.log").read_text()
    adopted = re.search(r"adopted the global state at versions \[([\d, ]+)\]", log)
    assert adopted and min(int(v) for v in adopted.group(1).split(",")) > 0, log[:2000]  # merged without it
    assert "training as learner learner-2 (data shard 2 of 3" in log and "Traceback" not in log
    assert summary["own_steps_per_learner"][2] > 0
    assert summary["steps_per_learner"][2] > 0  # what the synchronizer accepted from it


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_a_learner_under_torchrun_keeps_its_two_ranks_identical(procs, tmp_path) -> None:
    port = free_port()
    procs.start("sync", *sync_args(port, "--tokens", "20000", "--exit-when-finished", learners=1))
    with open(tmp_path / "torchrun.log", "wb") as log:
        job = subprocess.Popen(
            ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "ddiloco.cli", *learner_args(port, "learner-0")],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,  # its own process group: the ranks die with it below
        )
    try:
        wait_for(lambda: job.poll() is not None, "the torchrun learner to finish")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    text = (tmp_path / "torchrun.log").read_text()
    assert job.returncode == 0, text[-3000:]
    hashes = dict(re.findall(r"rank (\d) of 2: weights sha256 ([0-9a-f]{64})", text))
    assert set(hashes) == {"0", "1"} and hashes["0"] == hashes["1"]
    sync = procs.procs["sync"]
    wait_for(lambda: sync.poll() is not None, "the synchronizer to exit when finished")
    assert sync.returncode == 0
    assert "run finished" in procs.log("sync")
    # Both ranks' batches count: 2 x 256 tokens per step.
    done = re.search(r"done: (\d+) steps", text)
    tokens = int(re.search(r"run finished: (\d+) tokens", procs.log("sync")).group(1))
    assert done and tokens == int(done.group(1)) * 2 * 256


def test_data_parallel_on_real_processes_trains_the_same_model_from_the_same_start(tmp_path) -> None:
    config = build_config(preset="tiny", overrides=("run.learners=2", "run.tokens=12288", "run.mode='dp'"))
    summary, rows = run_real(config, tmp_path, timeout_s=240)  # --runtime processes: dp is the baseline's
    assert set(SUMMARY_KEYS) <= set(summary) and summary["mode"] == "dp" and summary["runtime"] == "processes"
    # 12288 tokens / (2 ranks x 256 tokens per step): 24 steps, every rank the same, every step all-reduced.
    assert summary["own_steps_per_learner"] == [24, 24] and summary["fragment_versions"] == [24]
    assert summary["events"]["merges"] == 24 and summary["events"]["failures"] == 0  # the panel's (issue 45)
    assert summary["tokens"] == 12288 and summary["bytes_up"] == summary["bytes_down"] > 0
    workload = Workload.build(config)
    assert rows[0]["eval_loss"] == workload.evaluate(workload.new_model())
    assert rows[-1]["eval_loss"] == summary["eval_loss"] < rows[0]["eval_loss"]
    state = load_checkpoint(tmp_path / CHECKPOINT)  # the final checkpoint, model and optimizer
    assert state["steps"] == 24 and set(state["model"]) == set(workload.initial_state)


def _running_run(out, *extra: str) -> subprocess.Popen:
    """A process run of the tiny preset, once the synchronizer answers and both learners are started."""
    proc = ddiloco_session("run", "--runtime", "processes", "--preset", "tiny", "--learners", "2", *extra, out=out)
    wait_until_running(proc, out)
    return proc


def test_kill_9_of_the_launcher_leaves_no_process_behind(tmp_path) -> None:
    proc = _running_run(tmp_path / "out", "--time", "120")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not session_pids(proc.pid), "the launcher's children to die with it")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_of_the_launcher_stops_the_run_cleanly(tmp_path) -> None:
    out = tmp_path / "out"
    proc = _running_run(out, "--time", "120")
    # a learner joined is not yet a merge: the summary's tokens are what reached the global model, so
    # stop once some have (under a loaded suite the first round can close after the signal otherwise)
    port = int((out / "sync.port").read_text())
    wait_for(lambda: (s := status_of(port)) and s["tokens"] > 0, "a first merge", timeout_s=180)
    stdout, stderr = stop_session(proc, signal.SIGTERM)
    assert proc.returncode == 130, stdout + stderr
    assert "ddiloco: interrupted by SIGTERM: stopped cleanly" in stderr and "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["signal"] == "SIGTERM" and summary["tokens"] > 0
    assert "stopped" not in summary  # one name for one fact, the virtual cluster's (issue 57)
    assert (out / "metrics.jsonl").read_text() and (out / "plot.png").exists()
    assert (out / "sync-state" / "CURRENT").exists()  # its final checkpoint
    for name in ("sync", "learner-0", "learner-1"):
        assert "Traceback" not in (out / "logs" / f"{name}.log").read_text(), name
    assert not session_pids(proc.pid)
