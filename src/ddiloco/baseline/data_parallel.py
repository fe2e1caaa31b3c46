"""``ddiloco run --runtime processes --mode dp``: M data-parallel ranks where the M learners would run.

The ranks (:mod:`ddiloco.baseline.dp_worker`) rendezvous at rank 0 (``learner-0``'s host)
and all-reduce over the same loopback or capped links a Decoupled DiLoCo run of the same
configuration would use; there is no synchronizer. The launcher watches their progress
files, records ``timeline.jsonl`` like any local run, and builds the summary from rank 0's
metrics rows and result. SIGINT or SIGTERM asks every rank to stop; they agree on the step,
and rank 0 writes its final checkpoint and result before they leave.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Any

from ddiloco.baseline.dp_worker import METRICS_FILE, RESULT_FILE
from ddiloco.core.shared.errors import DdilocoError
from ddiloco.outputs.reporting import ProgressFn, summarize
from ddiloco.runtime.launch.local_run import (
    LEAVE_TIMEOUT_S,
    POLL_S,
    free_port,
    learner_names,
    learner_threads,
    prepare_files,
)
from ddiloco.runtime.launch.placement import placed
from ddiloco.runtime.launch.processes import Processes, StopSignals, interruption
from ddiloco.runtime.launch.run_log import RunTimeline
from ddiloco.runtime.launch.topology import Topology
from ddiloco.settings.config import Config

MASTER_PORT = 29500


def run_data_parallel(config: Config, out: Path, progress: ProgressFn | None = None, *,
                      timeout_s: float | None = None, device: str = "cpu",
                      topology: Topology | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``config`` as M data-parallel ranks (see the module's docstring); returns (summary, metrics rows)."""
    if config.run.learners < 2:
        raise DdilocoError("--mode dp on real processes needs at least 2 learners (ranks) to all-reduce between")
    files = prepare_files(config, out)
    for stale in (out / METRICS_FILE, out / RESULT_FILE):
        stale.unlink(missing_ok=True)
    ranks = learner_names(config.run.learners)
    threads = learner_threads(config.run.learners - 1)  # no synchronizer: the ranks have every core
    with StopSignals() as stop, placed(topology, ranks, out) as place:
        procs = Processes(files.logs)
        timeline = RunTimeline(out, ranks, place)
        started, epoch = time.monotonic(), time.time()
        master = f"{place.address(ranks[0])}:{MASTER_PORT if place.net else free_port()}"
        try:
            for r, name in enumerate(ranks):
                procs.start(name, ["--config", str(files.config_file), "--rank", str(r), "--master", master,
                                   "--out", str(out), "--threads", str(threads), "--device", device,
                                   "--ifname", place.ifname, "--epoch", str(epoch)],
                            env={"OMP_NUM_THREADS": str(threads)}, prefix=place.prefix(name),
                            module="ddiloco.baseline.dp_worker")
            signalled, shown = False, 0
            while any(procs.running(name) for name in ranks):
                if timeout_s is not None and time.monotonic() - started > timeout_s:
                    raise DdilocoError(f"data-parallel run did not finish within {timeout_s:.0f}s "
                                       f"(logs in {files.logs})")
                failed = next((n for n in ranks if not procs.running(n) and procs.children[n].returncode), None)
                if failed is not None:
                    raise DdilocoError(f"{failed} (data-parallel rank {ranks.index(failed)}) exited with code "
                                       f"{procs.children[failed].returncode}; data parallel stops with any "
                                       f"rank:\n{procs.tail(failed)}")
                if stop.requested is not None and not signalled:
                    for name in ranks:  # they agree on the step at which to stop, then rank 0 writes its files
                        procs.signal(name, signal.SIGTERM)
                    signalled = True
                timeline.record(None)
                rows = _rows(out)
                if progress and len(rows) > shown:
                    shown = len(rows)
                    progress(_fraction(config, timeline, started), rows[-1])
                time.sleep(POLL_S)
            procs.stop_all(ranks, LEAVE_TIMEOUT_S)
            timeline.record(None, force=True)
        finally:
            procs.close()
            timeline.close()
        failed = next((n for n in ranks if procs.children[n].returncode), None)
        if failed is not None or not (out / RESULT_FILE).exists():
            name = failed or ranks[0]
            raise DdilocoError(f"{name} (data-parallel rank {ranks.index(name)}) ended without its result:\n"
                               + procs.tail(name))
    result = json.loads((out / RESULT_FILE).read_text())
    rows = _rows(out)
    steps = timeline.steps()
    summary = summarize(config, result["final"], wall_s=time.monotonic() - started, runtime="processes",
                        weights_sha256=result["weights_sha256"], fragment_versions=[result["steps"]],
                        steps_per_learner=list(steps.values()), own_steps_per_learner=list(steps.values()),
                        comm_wait_s=result["comm_wait_s"], links=timeline.link_totals(),
                        **interruption(stop, _fraction(config, timeline, started)),
                        # A rank that dies ends a data-parallel run with an error: a summary had none.
                        events=timeline.events(merges=result["steps"], rejoins=0, failures=0,
                                               end_s=rows[-1]["virtual_time_s"] if rows else 0.0),
                        **place.describe())
    if progress:
        progress(1.0, rows[-1])
    return summary, rows


def _rows(out: Path) -> list[dict[str, Any]]:
    """Rank 0's metrics rows so far (it appends one line per evaluation)."""
    try:
        lines = (out / METRICS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _fraction(config: Config, timeline: RunTimeline, started: float) -> float:
    if config.run.time_s:
        return min(1.0, (time.monotonic() - started) / config.run.time_s)
    per_step = config.train.batch_size * config.model.seq_len
    total = math.ceil(config.run.tokens / per_step / config.run.learners)
    return min(1.0, min(timeline.steps().values()) / max(1, total))
