"""``benchmarks/bench_round_log.py`` runs end to end at a tiny size and writes its figures: a
change to the core's round API broke it once without any test noticing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_round_log_benchmark_runs_and_reports_the_logs_cost(tmp_path):
    out = tmp_path / "round_log.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_round_log.py"), "--params", "48000",
                    "--fragments", "4", "--learners", "2", "--pairs", "1", "--sweeps", "1", "--json", str(out)],
                   check=True, capture_output=True, timeout=300, env={**os.environ, "BENCH_DIR": str(tmp_path)})
    result = json.loads(out.read_text())
    assert result["logged_vs_alone_cpu"] > 0
    assert result["log_bytes_per_round_of_every_fragment"] > 0
    assert result["params_per_cpu_s"]["alone"] > 0 and result["params_per_cpu_s"]["logged"] > 0

