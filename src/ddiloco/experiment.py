"""Run one mode on the virtual cluster; :mod:`ddiloco.reporting` writes what it measured."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from ddiloco.config import Config
from ddiloco.reporting import ProgressFn, summarize
from ddiloco.sim.cluster import VirtualCluster
from ddiloco.sim.data_parallel import DataParallel
from ddiloco.sim.harness import Recorder
from ddiloco.sim.snapshot import SnapshotFn
from ddiloco.workload.workload import Workload


def run_virtual(
    config: Config,
    *,
    workload: Workload | None = None,
    device: torch.device | None = None,
    progress: ProgressFn | None = None,
    observer: SnapshotFn | None = None,
    check_invariants: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``config`` on the virtual cluster (learners' models on ``device``, the workload's by
    default); return (summary, metrics rows). ``observer`` receives read-only snapshots of a
    Decoupled or synchronous DiLoCo run (the data-parallel baselines have no learners to show)."""
    if workload is None or workload.config.run.learners != config.run.learners:
        workload = Workload.build(config, device or (workload.device if workload else None))
    else:
        workload = replace(workload, config=config)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    recorder = Recorder(config, workload, progress=progress)
    started = time.perf_counter()
    mode = config.run.mode
    if mode in ("decoupled", "diloco"):
        result = VirtualCluster(workload, recorder, check_invariants=check_invariants, observer=observer).run()
    else:
        result = DataParallel(workload, recorder, elastic=mode == "dp-elastic").run()
    final = result.pop("final")
    recorder.settle()
    return summarize(config, final, wall_s=time.perf_counter() - started, **result), recorder.rows
