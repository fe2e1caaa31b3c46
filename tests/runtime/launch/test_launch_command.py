"""``ddiloco launch``: the synchronizer and M copies of the own-loop example in one command, a copy
killed with kill -9 started again under its id, and bad input refused in one line with no
process left behind. Real processes on 127.0.0.1; waits poll with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.cli import main
from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.testing import finish, session_pids, status_of, wait_for

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MODEL = ("--d-model", "32", "--layers", "1")
STEP_TOKENS = 8 * 32
LEARNER = ("python", str(EXAMPLES / "own_loop.py"), "learner", *MODEL, "--seq-len", "32", "--batch-size", "8",
           "--threads", "1")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def init(tmp_path: Path) -> Path:
    path = tmp_path / "init.safetensors"
    subprocess.run([sys.executable, str(EXAMPLES / "own_loop.py"), "init", str(path), *MODEL], check=True,
                   capture_output=True, env=ENV)
    return path


def launch(tmp_path: Path, init: Path, budget_steps: int, *learner: str, options: tuple[str, ...] = (),
           step_tokens: int = STEP_TOKENS) -> subprocess.Popen:
    """``ddiloco launch`` of the own-loop example, M = 2, in a session of its own (to find leftovers)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "launch", "--learners", "2", "--init", str(init), "--preset", "tiny",
         "--tokens", str(budget_steps * step_tokens), "--set", "protocol.heartbeat_s=0.3", "--out",
         str(tmp_path / "out"), *options, "--", *LEARNER, *learner],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)


def learner_pid(launcher: int, learner_id: str) -> int | None:
    """The launched copy of ``learner_id`` (its environment says which), a child of ``launcher``: the
    topmost such process, not the link's helper that the copy starts (it inherits the environment)."""
    copies = {}
    for pid in session_pids(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if f"DDILOCO_LEARNER_ID={learner_id}".encode() in environ:
            copies[pid] = parent
    topmost = [pid for pid, parent in copies.items() if parent not in copies]
    return topmost[0] if topmost else None


@pytest.mark.slow
def test_launch_runs_the_own_loop_example_to_the_end_and_its_model_exports(tmp_path: Path, init: Path) -> None:
    proc = launch(tmp_path, init, 60, "--max-steps", "40")
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert "the run finished" in out and "Traceback" not in err
    assert not session_pids(proc.pid)
    for i in range(2):
        log = (tmp_path / "out" / "logs" / f"learner-{i}.log").read_text()
        assert f"learner-{i} done after" in log  # each copy got its own id from the environment
        assert f"learner-{i}: learner-{i} done after" in out  # and its output is shown, after its name
    model_file = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "out" / "sync-state"), str(model_file), "--init", str(init)]) == 0
    from own_loop import ByteGRU  # examples/ is on pytest's pythonpath

    ByteGRU(32, 1).load_state_dict(load_file(model_file))  # strict: the tied head is in the file
    written = load_file(tmp_path / "out" / "model.safetensors")  # what the launch wrote at the end: the same
    assert all(torch.equal(t, written[name]) for name, t in load_file(model_file).items())


@pytest.mark.slow
def test_a_learner_killed_9_is_started_again_and_the_run_finishes(tmp_path: Path, init: Path) -> None:
    """learner-1 is killed as soon as it has joined, whatever learner-0 is doing: its steps (32 x 128
    tokens) last long enough that it cannot have trained its 40 before the kill, however loaded the
    machine (killed once both had joined, it sometimes had: learner-0 started late and learner-1 was
    done, so its restart found the run over)."""
    proc = launch(tmp_path, init, 60, "--max-steps", "40", "--batch-size", "32", "--seq-len", "128",
                  step_tokens=32 * 128)
    try:
        log = tmp_path / "out" / "logs" / "learner-1.log"
        wait_for(lambda: log.exists() and "learner-1 resuming data at batch" in log.read_text(), "learner-1 to join",
                 poll_s=0.02)
        victim = wait_for(lambda: learner_pid(proc.pid, "learner-1"), "learner-1's process", poll_s=0.02)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: (pid := learner_pid(proc.pid, "learner-1")) and pid != victim, "learner-1 started again")
    finally:
        out, err = finish(proc)
    assert "learner-1 exited with code -9: starting it again (1 of 3 restarts)" in err, err
    assert proc.returncode == 0, err
    assert log.read_text().count("learner-1 resuming data at batch") == 2  # the same id, rejoined
    assert not session_pids(proc.pid)


@pytest.mark.slow
def test_sigterm_stops_the_learners_then_the_synchronizer_and_leaves_no_process(tmp_path: Path, init: Path) -> None:
    """With a token: the synchronizer takes its file, each copy $DDILOCO_TOKEN (LearnerRuntime.from_env)."""
    token = tmp_path / "token"
    token.write_text("s3cret-token-for-this-test\n")
    proc = launch(tmp_path, init, 10**6, options=("--token-file", str(token)))
    try:
        port_file = tmp_path / "out" / "sync.port"
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip(), "the synchronizer's port")
        assert status_of(int(port)) is None  # refused without the token
        wait_for(lambda: (s := status_of(int(port), "s3cret-token-for-this-test"))
                 and all(lr["accepted"] for lr in s["learners"]) and len(s["learners"]) == 2,
                 "both learners' work merged")
        proc.send_signal(signal.SIGTERM)
    finally:
        out, err = finish(proc)
    assert proc.returncode == 130, err
    assert "launch: SIGTERM: stopping the learners, then the synchronizer" in err and "Traceback" not in err
    assert not session_pids(proc.pid)
    # Issue 57: how to go on, in the terms of the command typed (not `ddiloco sync --state-dir ... --resume`)
    assert f"ddiloco launch --resume --out {tmp_path / 'out'}" in out and "ddiloco export" in out, out
    assert not port_file.exists()  # the port of a synchronizer that is gone
    sync_log = (tmp_path / "out" / "logs" / "sync.log").read_text()
    assert "final checkpoint written" in sync_log  # stopped in order: its state is whole
    assert main(["export", str(tmp_path / "out" / "sync-state"), str(tmp_path / "m.safetensors"),
                 "--init", str(init)]) == 0


@pytest.mark.parametrize("args, says", [
    (["--learners", "0", "--", "python", "train.py"], "--learners must be at least 1, got 0"),
    (["--learners", "2"], "no command after --"),
    (["--learners", "2", "--"], "no command after --"),
    (["--learners", "2", "--", "no-such-program-here"], "'no-such-program-here': no such command"),
])
def test_bad_input_is_one_line_before_anything_starts(args: list[str], says: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ddiloco: error: {says}" or (len(err.splitlines()) == 1 and says in err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_script_that_exits_at_once_is_one_line_exit_2_and_leaves_no_process(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "launch", "--learners", "2", "--preset", "tiny", "--out",
         str(tmp_path / "out"), "--", sys.executable, "-c", "import sys; print('no runtime here'); sys.exit(3)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    out, err = finish(proc)
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "exited with code 3 before it joined the run" in errors[0], err
    assert "no runtime here" in errors[0] and "Traceback" not in err
    assert not session_pids(proc.pid)
    assert not (tmp_path / "out").exists()  # no run, no logs, no sync.port: a new launch starts afresh (issue 57)


def test_from_env_outside_launch_says_what_to_do_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DDILOCO_CONNECT", "DDILOCO_LEARNER_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"\$DDILOCO_CONNECT and \$DDILOCO_LEARNER_ID not set: start this script "
                                          r"with `ddiloco launch --learners M -- python SCRIPT \.\.\.`"):
        LearnerRuntime.from_env(torch.nn.Linear(2, 2))
