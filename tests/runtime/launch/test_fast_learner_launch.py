"""Issue 57, in real processes: a user's script of ~1 ms steps (``fast_steps.py``) launched with
``ddiloco launch`` had contributions refused as ``implausible`` (in 1 launch of 3; a faster one in
every launch), and only the synchronizer's log said so. Now every contribution of such a script is
accepted (the rule is the core's, driven as fast as it goes in ``tests/core/test_fast_learners.py``;
one launch here shows it end to end); and where work is refused (here: a ``protocol.min_step_s`` of
a second, far above the script's steps, so its sequence numbers outrun what the clock allows), the
launcher's output, the learner's own log and ``ddiloco status`` say so."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.testing import finish, session_pids, stop_session, wait_for

SCRIPT = Path(__file__).with_name("fast_steps.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(tmp_path: Path, *options: str, stderr: Path | None = None, pad_s: float = 0.0) -> subprocess.Popen:
    """``ddiloco launch`` of two copies of the script, each step padded to ``pad_s``; its stderr to
    ``stderr`` if given (read while it runs)."""
    init = tmp_path / "init.safetensors"
    subprocess.run([sys.executable, str(SCRIPT), "init", str(init)], check=True, env=ENV)
    return subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "launch", "--learners", "2", "--init", str(init), "--preset", "tiny",
         "--out", str(tmp_path / "out"), *options, "--", sys.executable, str(SCRIPT), "learner"],
        stdout=subprocess.PIPE, stderr=open(stderr, "w") if stderr else subprocess.PIPE, text=True,
        env={**ENV, "FAST_STEPS_PAD_S": str(pad_s)},
        start_new_session=True)


@pytest.mark.slow
def test_every_contribution_of_a_1_ms_step_script_is_accepted(tmp_path: Path) -> None:
    # A time budget: a token budget of a few seconds' steps was once spent by one copy before the other,
    # slow to start on the loaded machine, had joined.
    proc = launch(tmp_path, "--time", "15")
    out, err = finish(proc, 400)
    assert proc.returncode == 0, err
    assert not session_pids(proc.pid)
    sync_log = (tmp_path / "out" / "logs" / "sync.log").read_text()
    assert "rejected " not in sync_log, [line for line in sync_log.splitlines() if "rejected " in line][:3]
    (versions,) = re.findall(r"run finished: \d+ tokens, fragment versions \[([\d, ]+)\]", sync_log)
    assert all(int(v) > 0 for v in versions.split(",")), versions  # their work merged, fragment by fragment
    assert "refused" not in out + err
    assert out.count("done after") == 2


@pytest.mark.slow
def test_work_refused_is_said_on_the_launchers_output_the_learners_log_and_in_status(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = tmp_path / "launch.err"
    # Refused at once: 50 ms steps claim twenty times what a protocol.min_step_s of 1 s allows (unpadded,
    # two copies at 1 ms steps spun through the whole test for nothing it checks).
    proc = launch(tmp_path, "--time", "25", "--set", "protocol.min_step_s=1", stderr=said, pad_s=0.05)
    try:
        log = tmp_path / "out" / "logs" / "learner-0.log"
        wait_for(lambda: log.exists() and "the synchronizer refused this learner's contribution" in log.read_text(),
                 "learner-0 to say its work was refused", timeout_s=200)
        port = (tmp_path / "out" / "sync.port").read_text().strip()
        assert main(["status", f"127.0.0.1:{port}", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        (learner,) = [lr for lr in status["learners"] if lr["id"] == "learner-0"]
        assert main(["status", f"127.0.0.1:{port}"]) == 0
        table = capsys.readouterr().out
        wait_for(lambda: "launch: the synchronizer refused" in said.read_text(), "the launcher to say so",
                 timeout_s=200)
    finally:  # everything checked is said by now: the rest of the budget would show nothing new
        out, _ = stop_session(proc, signal.SIGTERM, 400)
    err = said.read_text()
    assert learner["refused_steps"].get("implausible", 0) > 0, learner
    assert "steps refused" in table
    row = next(line for line in table.splitlines() if "learner-0" in line)
    assert re.search(r"\b[1-9][\d,]*\b", row.split("│")[7]), row  # its refused steps, not 0
    assert "implausible" in log.read_text() and "that work is lost" in log.read_text()
    assert re.search(r"launch: the synchronizer refused \d+ of learner-\d's contributions, its work thrown away: "
                     r"implausible", err), err
    assert not session_pids(proc.pid)
