"""Run one mode on the virtual cluster; :mod:`ddiloco.reporting` writes what it measured."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from ddiloco.config import Config
from ddiloco.core.config import Mode
from ddiloco.errors import ConfigError
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
    schedule_span: tuple[float, float] = (0.0, 1.0),
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
    recorder = Recorder(config, workload, progress=progress, schedule_span=schedule_span)
    started = time.perf_counter()
    mode = config.run.mode
    if mode in ("decoupled", "diloco"):
        result = VirtualCluster(workload, recorder, check_invariants=check_invariants, observer=observer).run()
    else:
        result = DataParallel(workload, recorder, elastic=mode == "dp-elastic").run()
    final = result.pop("final")
    recorder.settle()
    return summarize(config, final, wall_s=time.perf_counter() - started, **result), recorder.rows


def run_warm_started(config: Config, warm_fraction: float, *, workload: Workload | None = None,
                     device: torch.device | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Data parallel for the first ``warm_fraction`` of the token budget, then ``config``'s mode
    from data parallel's weights for the rest (a candidate for closing the quality gap).

    The phases share one budget and one learning-rate schedule: each covers its part of it.
    The learners start the second phase with fresh AdamW state (and their own warm-up), as a
    learner joining a run does; the synchronizer starts from the warm weights with fresh
    outer momentum.
    """
    if not 0.0 < warm_fraction < 1.0:
        raise ConfigError(f"warm start: the data-parallel share must be in (0, 1), got {warm_fraction}")
    if config.run.time_s or not Mode(config.run.mode).uses_protocol:
        raise ConfigError("a warm start runs a token budget of Decoupled or synchronous DiLoCo")
    workload = workload or Workload.build(config, device)
    warm = replace(config, run=replace(config.run, mode="dp-elastic", tokens=round(config.run.tokens * warm_fraction)))
    warm_workload = replace(workload, config=warm)
    dp = DataParallel(warm_workload, Recorder(warm, warm_workload, schedule_span=(0.0, warm_fraction)), elastic=True)
    dp.run()
    done = dp.tokens / config.run.tokens
    rest = replace(config, run=replace(config.run, tokens=config.run.tokens - dp.tokens))
    weights = {k: v.detach().to("cpu", copy=True) for k, v in dp.model.state_dict().items()}
    summary, rows = run_virtual(rest, workload=replace(workload, config=rest, initial_state=weights),
                                check_invariants=False, schedule_span=(done, 1.0))
    summary["tokens"] += dp.tokens
    summary["warm_start_tokens"] = dp.tokens
    return summary, [*dp.recorder.rows, *({**row, "tokens": row["tokens"] + dp.tokens} for row in rows)]
