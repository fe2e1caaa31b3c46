"""``benchmarks/bench_peers.py``: ddiloco beside torchft on real processes, kept from rotting.

The slow test runs the harness end to end at its smallest (2 learners, 20 s windows, one kill -9):
ddiloco's side always (it needs nothing but this package), torchft's beside it only where torchft is
installed (the ``peers`` extra, which CI does not install). The fast
ones check the command line's refusals: one line, exit 2, no traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_peers.py"
SMALLEST = ["--learners", "2", "--time", "20", "--kills", "1", "--scenarios", "kills", "--seed", "3"]


def _run(args: list[str], *, prelude: str = "", timeout_s: float = 900) -> subprocess.CompletedProcess:
    """The benchmark as a user runs it; ``prelude`` runs first in the same interpreter (hiding a package).
    Its folder is on the path as when it runs as a script (its sibling modules)."""
    code = (f"import runpy, sys\n{prelude}\nsys.argv = ['bench_peers.py', *{args!r}]\n"
            f"runpy.run_path({str(BENCH)!r}, run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                          env=env)


@pytest.mark.parametrize("args, says", [
    (["--only", "tensorflow"], "'tensorflow' is not a valid System"),
    (["--scenarios", "meteor"], "'meteor' is not a valid Scenario"),
    (["--learners", "1"], "--learners must be at least 2"),
    (["--time", "30", "--kills", "9"], "do not fit"),
])
def test_bench_peers_bad_input_is_one_line_and_exit_2(args, says):
    proc = _run(args, timeout_s=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and says in proc.stderr and "Traceback" not in proc.stderr


def test_bench_peers_without_torchft_names_it_and_how_to_install_it():
    proc = _run(["--quick"], prelude="sys.modules['torchft'] = None  # as if not installed", timeout_s=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "torchft is not installed" in proc.stderr and "pip install -e '.[peers]'" in proc.stderr


def _kills_run(result: dict, system: str) -> dict:
    run = result["results"]["kills"][system]
    assert not run["failed"], run.get("log_tail")
    return run


@pytest.mark.slow
def test_bench_peers_meets_one_kill_on_ddiloco_and_on_torchft_where_installed(tmp_path):
    """One kill -9 on each side. Without torchft (CI), ddiloco's side alone with torchft hidden: --only
    ddiloco needs none; with it, both sides meet the same kill (the ddiloco side is not run twice)."""
    out = tmp_path / "peers.json"
    both = importlib.util.find_spec("torchft") is not None
    systems = "ddiloco,torchft_diloco" if both else "ddiloco"
    proc = _run([*SMALLEST, "--only", systems, "--json", str(out), "--out", str(tmp_path / "runs")],
                prelude="" if both else "sys.modules['torchft'] = None")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ours = _kills_run(result, "ddiloco")
    assert [name for _, name in ours["kills"]] == [name for _, name in result["settings"]["kill_schedule"]]
    assert len(ours["restarts"]) == 1
    assert 0 < ours["tokens_merged"] <= ours["tokens_trained"]
    assert ours["curve"] and ours["bytes_per_outer_step"] > 0 and ours["vmhwm_mib_max"] > 0
    assert result["commit"] and result["load"] and (tmp_path / "peers.png").exists()
    runs = [ours]
    if both:
        theirs = _kills_run(result, "torchft_diloco")
        assert [n for _, n in ours["kills"]] == [n for _, n in theirs["kills"]] == ["learner-1"]
        assert "goodput" in result["ratios"]["kills"] and "kills_goodput_plus_10_points" in result["targets"]
        assert result["settings"]["torchft"]["version"] == "0.2.0"
        runs.append(theirs)
    for run in runs:
        assert 0 < run["goodput"] <= 1 and run["commits"] > 0 and run["curve"]
