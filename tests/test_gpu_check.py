"""``scripts/gpu_check.sh``, the one command of a GPU session, for what runs without a GPU: its
arguments, the steps it would run, and the ladder's table it seeds (from which the next point,
8m Decoupled DiLoCo, must find the best lr of a gridded size: it once failed at once because the
seed table held no data-parallel run at one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bench_scale
import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=120)


@pytest.mark.parametrize("args", [(), ("a", "b"), ("--fast", "out")])
def test_bad_arguments_are_one_usage_line_and_exit_2(args):
    done = gpu_check(*args)
    assert done.returncode == 2 and "usage: scripts/gpu_check.sh [--dry-run] OUTDIR" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_dry_run_lists_every_step_and_seeds_a_table_the_next_point_runs_from(tmp_path):
    out = tmp_path / "gpu"
    done = gpu_check("--dry-run", str(out))
    assert done.returncode == 0, done.stderr
    steps = [line.split("]")[0].lstrip("[") for line in done.stdout.splitlines() if line.startswith("[")]
    assert steps == ["cuda_tests", "fsdp_nccl", "throughput_gpu", "throughput_100m", "profile", "scale"]
    assert "scripts/fsdp_step.sh" in done.stdout
    assert "--model gpu100m" in done.stdout and "--sizes 8m" in done.stdout
    table_path = out / "scale" / "table.json"
    runs = json.loads(table_path.read_text())["runs"]
    assert any(r["mode"] == "dp" and r["size"] == "3m" for r in runs)  # from the table b882afc continued
    bench = bench_scale
    plan = bench.PLANS["gpu"]
    size = next(s for s in plan.sizes if s.name == "8m")
    (lr,) = bench._lrs_for(size, "decoupled", "base", plan.lrs, plan, bench.Table(table_path), False)
    assert lr in plan.lrs


def test_the_seed_alone_would_have_failed(tmp_path):
    """The table the last session's command copied, on its own, holds no gap at a gridded size."""
    bench = bench_scale
    plan = bench.PLANS["gpu"]
    size = next(s for s in plan.sizes if s.name == "8m")
    with pytest.raises(Exception, match="reuses the best lr of a gridded size"):
        bench._lrs_for(size, "decoupled", "base", plan.lrs, plan,
                       bench.Table(ROOT / "docs" / "results" / "scale_gpu_b882afc.json"), False)
