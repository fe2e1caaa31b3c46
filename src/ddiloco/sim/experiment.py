"""Run one mode on the virtual cluster; :mod:`ddiloco.outputs.reporting` writes what it measured."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.protocol_config import Mode
from ddiloco.outputs.reporting import ProgressFn, RunWriter, summarize
from ddiloco.settings.config import Config
from ddiloco.sim.dp_baselines import DataParallel
from ddiloco.sim.harness import Recorder
from ddiloco.sim.snapshot import SnapshotFn
from ddiloco.sim.virtual_cluster import VirtualCluster
from ddiloco.workload.workload import Workload


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped a virtual run; its files, partial summary included, are written."""

    def __init__(self, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        super().__init__()
        self.summary = summary
        self.rows = rows


def run_virtual(
    config: Config,
    *,
    workload: Workload | None = None,
    device: torch.device | None = None,
    progress: ProgressFn | None = None,
    observer: SnapshotFn | None = None,
    check_invariants: bool = True,
    schedule_span: tuple[float, float] = (0.0, 1.0),
    out: Path | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``config`` on the virtual cluster (learners' models on ``device``, the workload's by
    default); return (summary, metrics rows). ``observer`` receives read-only snapshots of a
    Decoupled or synchronous DiLoCo run (the data-parallel baselines have no learners to show).

    With ``out``, the run's files are written there as it goes (:class:`RunWriter`); the
    directory is created only once the workload and the cluster are built, so a run refused
    before it starts leaves nothing; a finished run ends with ``model.safetensors``, the global
    model as its final evaluation measured it. Interrupted, it writes a summary of what was done so far
    and raises :class:`Interrupted`.
    """
    if workload is None or workload.config.run.learners != config.run.learners:
        workload = Workload.build(config, device or (workload.device if workload else None))
    else:
        workload = replace(workload, config=config)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    recorder = Recorder(config, workload, progress=progress, schedule_span=schedule_span)
    started = time.perf_counter()
    driver: VirtualCluster | DataParallel
    mode = Mode(config.run.mode)
    if mode.uses_protocol:
        driver = VirtualCluster(workload, recorder, check_invariants=check_invariants, observer=observer)
    else:
        driver = DataParallel(workload, recorder, elastic=mode is Mode.DP_ELASTIC)
    writer = RunWriter(out, config) if out is not None else None
    recorder.on_row = writer.add_row if writer else None
    try:
        result = driver.run()
    except KeyboardInterrupt:
        so_far = driver.so_far()
        summary = summarize(config, so_far, wall_s=time.perf_counter() - started, interrupted=True,
                            **{key: so_far[key] for key in ("done", "eval_at_s", "fragment_versions", "events")})
        if writer:
            writer.finish(summary)
        raise Interrupted(summary, recorder.rows) from None
    final = result.pop("final")
    summary = summarize(config, final, wall_s=time.perf_counter() - started, **result)
    if writer:
        # The model the final evaluation measured: the synchronizer's Θ, or data parallel's weights.
        writer.finish(summary, driver.eval_model if isinstance(driver, VirtualCluster) else driver.model)
    return summary, recorder.rows


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
