"""Issue 45: a synchronizer that cannot start leaves nothing behind.

``ddiloco sync --state-dir st2`` on a port in use printed gRPC's own log line (``E1128 ...
add_port.cc:83] Failed to add port ...``) before its error and left ``st2/lock`` and an empty
``rounds-00000000.log``; the retry on a free port was refused (``already holds a run's
state``) and ``--resume`` then started a new run instead of the documented error."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.runtime.sync.round_log import RoundLog
from ddiloco.runtime.sync.state_dir import has_checkpoint
from ddiloco.testing import DEADLINE_S, ddiloco_argv, sync_argv

RESUME_ERROR = ("ddiloco: error: --resume: --state-dir '{}' holds no run's state (no checkpoint, no round log): start "
                "without --resume for a new run, or pass --resume-if-present to resume only when there is one")


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--listen", "--metrics-port"])
def test_a_port_in_use_is_one_line_and_creates_no_state_directory(tmp_path: Path, option: str) -> None:
    state = tmp_path / "st2"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        listen = f"127.0.0.1:{port}" if option == "--listen" else "127.0.0.1:0"
        metrics = ("--metrics-port", str(port)) if option == "--metrics-port" else ()
        done = subprocess.run(ddiloco_argv(*sync_argv(*metrics, listen=listen, state_dir=state, log_level="warning")),
                              capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 2
    assert done.stderr == (f"ddiloco: error: cannot listen on 127.0.0.1:{port}: Address already in use (another "
                           f"synchronizer, or another program, holds the port: choose another {option} port)\n")
    assert not state.exists()


def header_only_log(state: Path) -> None:
    """What a synchronizer that could not listen left behind before: a segment with its header only."""
    state.mkdir()
    RoundLog(state, {"layout_sha256": "x", "shard": 0}).close()
    assert [p.name for p in state.glob("rounds-*.log")] == ["rounds-00000000.log"]


def test_a_round_log_without_a_round_is_no_runs_state(tmp_path: Path) -> None:
    state = tmp_path / "st"
    header_only_log(state)
    assert not has_checkpoint(state)
    log = RoundLog(state, {"layout_sha256": "x", "shard": 0})
    log.append(0, 1, False, b"update").result()
    log.close()
    assert has_checkpoint(state)


def test_resume_on_a_directory_that_holds_no_round_is_the_documented_error(tmp_path: Path, capsys,
                                                                        monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    header_only_log(tmp_path / "st2")
    assert main(sync_argv("--resume", state_dir=Path("st2"))) == 2
    assert capsys.readouterr().err == RESUME_ERROR.format("st2") + "\n"  # was: "no checkpoint in st2: starting a new run"
