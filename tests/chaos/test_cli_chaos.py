"""``ddiloco chaos`` end to end: bad input, a short real run with every fault kind, and an interrupted run.

Real processes and real signals; every wait has a deadline and nothing asserts on timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from chaos_helpers import process_state, session_pids
from runtime_helpers import status_of, wait_for

from ddiloco.cli import main

TINY = ["--preset", "tiny", "--set", "protocol.lease_s=5", "--set", "protocol.heartbeat_s=0.5"]


def chaos(*args: str, out: Path) -> subprocess.Popen:
    """``ddiloco chaos`` as a session leader: every process it starts shares its session id."""
    return subprocess.Popen([sys.executable, "-m", "ddiloco.cli", "chaos", *args, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def schedule(tmp_path: Path, text: str) -> str:
    path = tmp_path / "schedule.toml"
    path.write_text(text)
    return str(path)


def test_an_unknown_fault_kind_is_one_line_and_exit_2_with_nothing_started(tmp_path) -> None:
    path = schedule(tmp_path, '[[fault]]\ntime = 1\nfault = "meteor"\ntarget = "learner-0"\n')
    proc = chaos(*TINY, "--learners", "2", "--schedule", path, out=tmp_path / "out")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines() == [f"ddiloco: error: schedule file {path}, fault 1: unknown fault kind "
                                        "'meteor' (kinds: kill, freeze, sync_kill, latency, bandwidth, reset, "
                                        "partition)"]
    assert not session_pids(proc.pid) and not (tmp_path / "out" / "logs").exists()


@pytest.mark.parametrize("text, args, message", [
    ('[[fault]]\ntime = 1\nfault = "kill"\ntarget = "learner-7"\nduration = 1\n', (),
     "targets 'learner-7', which does not exist"),
    ('[[fault]]\ntime = -3\nfault = "kill"\ntarget = "learner-0"\n', (), "time must be a finite number >= 0"),
    ('[[fault]]\ntime = 1\nfault = "bandwidth"\ntarget = "learner-0"\nduration = 2\nrate_bytes_per_s = -1\n', (),
     "rate_bytes_per_s must be a finite number >= 0"),
    ("[[fault]\n", (), "is not valid TOML"),
    ("", ("--time", "-5"), "--time must be a positive number"),
    ("", ("--learners", "1"), "needs at least 2 learners"),
    ("", ("--link-rate", "5mbit"), "--link-rate needs --hosts netns"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, text, args, message) -> None:
    before = set(os.listdir("/proc"))
    argv = ["chaos", *TINY, "--learners", "2", "--out", str(tmp_path / "out"), *args]
    if text:
        argv += ["--schedule", schedule(tmp_path, text)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco: error: ") and message in err and err.count("\n") == 1
    children = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and
                Path(f"/proc/{p}/stat").exists() and f" {os.getpid()} " in Path(f"/proc/{p}/stat").read_text()]
    assert not children


E2E_SCHEDULE = """
[[fault]]
time = 3
fault = "kill"
target = "learner-1"
duration = 2

[[fault]]
time = 3
fault = "latency"
target = "learner-0"
duration = 3
delay_s = 0.1

[[fault]]
time = 7
fault = "sync_kill"
duration = 0.5

[[fault]]
time = 9
fault = "freeze"
target = "learner-2"
duration = 6

[[fault]]
time = 9
fault = "partition"
target = "learner-0"
duration = 3

[[fault]]
time = 13
fault = "reset"
target = "learner-1"
duration = 1

[[fault]]
time = 15
fault = "bandwidth"
target = "learner-1"
duration = 3
rate_bytes_per_s = 4000
"""


@pytest.mark.slow
def test_a_short_run_with_every_fault_kind_keeps_its_promises(tmp_path) -> None:
    out = tmp_path / "out"
    proc = chaos(*TINY, "--learners", "3", "--time", "18", "--settle", "10", "--no-baseline",
                 "--schedule", schedule(tmp_path, E2E_SCHEDULE), out=out)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
    report = json.loads((out / "chaos.json").read_text())
    assert report["faults"] == {k: 1 for k in ("kill", "freeze", "sync_kill", "latency", "bandwidth", "reset",
                                               "partition")}
    assert report["completed"] and report["violations"] == []
    assert report["learners"] == report["learners_alive_at_end"] == 3
    assert report["longest_pause_s"] <= report["pause_bound_s"] == pytest.approx(5 + report["grace_window_s"])
    assert report["sync_downtime_s"] > 0 and len(report["sync_restarts"]) == 1
    # Every learner that had joined the killed incarnation joins the resumed one: at least one rejoin.
    assert report["rejoins"] >= 1 and report["rejected"].get("unknown_learner", 0) >= 1
    assert report["tokens"] > 0 and report["eval_loss"] is not None and report["baseline_eval_loss"] is None
    assert 0 < report["goodput"] <= 1 and 0 < report["uptime"] <= 1
    assert all(entry["started_s"] is not None and "skipped" not in entry for entry in report["schedule"])
    assert (out / "chaos.png").stat().st_size > 10_000
    assert "Traceback" not in stderr
    for log in (out / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log.name
    assert not session_pids(proc.pid)


@pytest.mark.slow
def test_sigterm_leaves_no_process_behind(tmp_path) -> None:
    """SIGTERM unwinds like Ctrl-C (SIGINT raises the same KeyboardInterrupt), killing every child."""
    out = tmp_path / "out"
    # learner-1 is frozen (SIGSTOP) when the interrupt comes: a stopped child must go too.
    text = '[[fault]]\ntime = 0\nfault = "freeze"\ntarget = "learner-1"\nduration = 50\n'
    proc = chaos(*TINY, "--learners", "2", "--time", "60", "--no-baseline", "--schedule", schedule(tmp_path, text),
                 out=out)
    try:
        port = int(wait_for(lambda: (out / "sync.port").exists() and (out / "sync.port").read_text().strip(),
                            "the synchronizer's port file"))
        wait_for(lambda: (s := status_of(port)) and any(lr["alive"] for lr in s["learners"]), "a learner to join")
        children = wait_for(lambda: (p := session_pids(proc.pid) - {proc.pid}) and len(p) >= 3 and p,
                            "the synchronizer and both learners")
        wait_for(lambda: any(process_state(pid) == "T" for pid in children), "learner-1 to be frozen")
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "ddiloco: interrupted" in stderr, stderr
    assert not session_pids(proc.pid)  # the chaos process reaps its children before it exits
