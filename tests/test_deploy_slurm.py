"""deploy/slurm/ddiloco.sbatch under a real Slurm: munged, slurmctld and one slurmd per
emulated node on this host (tests/slurm_cluster.py), where Slurm is installed and the tests
run as root; tests/test_deploy.py checks its command lines with stub Slurm commands."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ddiloco.testing import free_port, wait_for
from slurm_cluster import SingleHostSlurm, SlurmUnavailable

SBATCH = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "ddiloco.sbatch"


@pytest.fixture
def slurm(tmp_path):
    """munged, slurmctld and two emulated nodes on this host (tests/slurm_cluster.py); stopped after the test."""
    cluster = SingleHostSlurm(tmp_path / "slurm", nodes=2, cpus=4)
    try:
        cluster.start()
    except SlurmUnavailable as why:
        pytest.skip(str(why))
    yield cluster
    cluster.stop()


def learner_workers(learner_id: str, token_file: Path) -> set[int]:
    """Pids of the training processes (torchrun's workers, not torchrun itself) of one learner of this run."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue
        if ("ddiloco.cli" in argv and f"learner-{learner_id}" in argv and str(token_file) in argv
                and not any(a.startswith("--rdzv") for a in argv)):
            pids.add(int(proc.name))
    return pids


@pytest.mark.slow
def test_the_batch_script_runs_under_a_real_slurm(slurm, tmp_path):
    """Two nodes: the synchronizer on n1, three learners sharing n2 (each its rendezvous
    port and a third of its CPUs). learner-2 is killed with kill -9, restarted, killed again:
    lost for good, so the job fails with exit code 3 while the others finish the run."""
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text("[run]\ntokens = 0\ntime_s = 18.0\n")  # wall seconds from the first join: room for two kills
    env = {"RUN_DIR": str(run_dir), "PRESET": "tiny", "CONFIG": str(config), "LEARNERS": "3", "NPROC_PER_NODE": "1",
           "SYNC_PORT": str(free_port()), "RDZV_PORT": str(free_port()), "MAX_RESTARTS": "1", "RESTART_DELAY": "1"}
    job = slurm.sbatch(SBATCH, "--nodes=2", f"--output={tmp_path / 'job.out'}", env=env)
    token = run_dir / "token"
    killed: set[int] = set()
    for _ in range(2):
        pids = wait_for(lambda: learner_workers("2", token) - killed, "a learner-2 process to kill")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed |= pids
    wait_for(lambda: slurm.job(job).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING"), "the job to end", 240)
    state, output = slurm.job(job), (tmp_path / "job.out").read_text()
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "3:0"), output
    assert state["NodeList"] == "n[1-2]"
    assert "learner-2 exited with code 1; restart 1 of 1" in output
    assert "lost for good (restarts exhausted): learner-2;" in output
    for i in (0, 1):  # the others trained to the end of the run
        assert "done:" in (run_dir / "logs" / f"learner-{i}.log").read_text()
    assert "shutting down" in (run_dir / "logs" / "sync-shard-0.log").read_text()
