"""One machine, real processes: a synchronizer and M learners, on loopback or in network namespaces.

:func:`run_processes` is ``ddiloco run --runtime processes``: it starts ``ddiloco sync`` and
M ``ddiloco learner`` processes with the run's configuration, watches the synchronizer's
status, evaluates the global model at the same points of the token budget as the virtual
cluster does, and returns the same summary and metrics rows. The learners take the
synchronizer's configuration, so the model, initial weights, data shards and data order
are the virtual cluster's; only time is real (``virtual_time_s`` holds wall seconds). Each
synchronizer serves its status page (``--http-port``) and the launcher prints its address.
With a topology (``--hosts netns``, :mod:`ddiloco.runtime.launch.placement`) every process runs in
its own network namespace behind a capped link (``--mode dp`` runs real data parallel on
the same hosts instead: :mod:`ddiloco.baseline.data_parallel`, from the same pieces). ``timeline.jsonl``
(:mod:`ddiloco.runtime.launch.run_log`) records the run once a second.

SIGINT or SIGTERM stops the run cleanly: learners first (they flush), then the final model
is read and evaluated, then the synchronizer (its final checkpoint); the summary says which
signal stopped it. The pieces (the run's files, its synchronizers, the evaluator of the global
model: :mod:`~ddiloco.runtime.launch.local_run`) are public: ``ddiloco chaos``
(:mod:`ddiloco.chaos.runner`) starts the same processes from them and breaks them.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.core.shared.protocol_config import Mode
from ddiloco.outputs.reporting import ProgressFn, summarize
from ddiloco.runtime.client import CallRefused, Unreachable
from ddiloco.runtime.launch.command_lines import learner_command
from ddiloco.runtime.launch.local_run import (
    LEAVE_TIMEOUT_S,
    POLL_S,
    START_TIMEOUT_S,
    GlobalEvaluator,
    RunFiles,
    Synchronizers,
    announce,
    prepare_files,
)
from ddiloco.runtime.launch.netns import SYNC_HOST
from ddiloco.runtime.launch.placement import Placement, placed
from ddiloco.runtime.launch.processes import Processes, StopSignals, interruption
from ddiloco.runtime.launch.run_log import RunTimeline
from ddiloco.runtime.launch.topology import Topology
from ddiloco.runtime.sharded import ShardedClient
from ddiloco.settings.config import Config
from ddiloco.workload.workload import weights_sha256


def run_processes(
    config: Config,
    out: Path,
    progress: ProgressFn | None = None,
    *,
    timeout_s: float | None = None,
    device: str = "cpu",
    min_step_s: float = 0.0,
    topology: Topology | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``config`` as one synchronizer and M learner processes (learners train on ``device``,
    each inner step padded to at least ``min_step_s``), on 127.0.0.1 or, given a ``topology``,
    each in its own network namespace on its capped link.

    Writes the children's logs to ``out/logs``, the synchronizer's checkpoints to
    ``out/sync-state`` (``sync-state-<i>`` per shard when ``protocol.shards`` > 1: one
    synchronizer process per shard) and ``out/timeline.jsonl``; returns (summary, metrics
    rows) like the virtual cluster. Data parallel's ``--mode dp`` is not the protocol's: it runs
    in :func:`ddiloco.baseline.data_parallel.run_data_parallel`, from the same pieces.
    """
    if not Mode(config.run.mode).uses_protocol:
        raise DdilocoError(f"run_processes runs modes {Mode.DECOUPLED} and {Mode.DILOCO}, not {config.run.mode!r}")
    files = prepare_files(config, out)
    with StopSignals() as stop, placed(topology, [SYNC_HOST, *files.learners], out) as place:
        procs = Processes(files.logs)
        timeline = RunTimeline(out, files.learners, place)
        try:
            return _run(config, files, place, procs, timeline, stop, progress, timeout_s, device, min_step_s)
        finally:
            procs.close()
            timeline.close()
            for port_file in files.port_files:  # the ports of synchronizers that are gone
                port_file.unlink(missing_ok=True)


def _run(config: Config, files: RunFiles, place: Placement, procs: Processes, timeline: RunTimeline,
         stop: StopSignals, progress: ProgressFn | None, timeout_s: float | None, device: str,
         min_step_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the synchronizers, then the learners; watch the run to its end or a signal; stop the
    learners before the last evaluation and the synchronizers after it."""
    started = time.monotonic()
    syncs = Synchronizers.of_run(files, place, procs)
    addresses = syncs.start_all(stop)
    for i, name in enumerate(syncs.names):
        announce(f"{name}: status page at {syncs.status_url(i)}"
                 + (f" (?token= the one in {place.token_file})" if place.token_file else ""))
    client = ShardedClient(addresses, token=place.token)
    try:
        evaluations = _Evaluations(config, GlobalEvaluator(config, client), started, progress)

        def start(names: list[str]) -> None:
            _start_learners(names, timeline, procs, place, addresses, files.threads, device, min_step_s)

        late = _LateLearners(timeline.learners, config.cluster.arrivals_s(len(timeline.learners)), start)
        evaluations.evaluate(_first_status(files, procs, client))
        _watch(files, procs, timeline, client, stop, evaluations, timeout_s, late)
        _stop_learners(procs, timeline, stop)
        status = client.status_dict()
        timeline.record(status, force=True)
        final = evaluations.evaluate(status)
        wall = time.monotonic() - started
        procs.stop_all(files.sync_names, LEAVE_TIMEOUT_S)
    finally:
        client.close()
    tokens_per_step = config.train.batch_size * config.model.seq_len
    by_id = {lr["id"]: lr for lr in status["learners"]}
    summary = summarize(
        config,
        final,
        wall_s=wall,
        runtime="processes",
        weights_sha256=weights_sha256(evaluations.evaluator.model),
        fragment_versions=final["fragment_versions"],
        rounds_closed=status["quorum"]["rounds_closed"],
        rejections=status["rejections"],
        refused_steps=status.get("refused_steps", {}),
        honest_refused_steps=status.get("honest_refused_steps", 0),  # every launched learner is honest
        steps_per_learner=[by_id.get(name, {}).get("tokens", 0) // tokens_per_step for name in timeline.learners],
        own_steps_per_learner=list(timeline.steps().values()),
        links=timeline.link_totals(),
        **interruption(stop, evaluations.fraction(status)),
        events=timeline.events(merges=sum(status["quorum"]["rounds_closed"].values()),
                               rejoins=sum(max(0, lr["registrations"] - 1) for lr in status["learners"]),
                               failures=sum(1 for n in timeline.learners if procs.died(n)),
                               end_s=final["virtual_time_s"]),
        **place.describe(),
    )
    return summary, evaluations.rows


def _start_learners(names: list[str], timeline: RunTimeline, procs: Processes, place: Placement, addresses: list[str],
                    threads: int, device: str, min_step_s: float) -> None:
    """One ``ddiloco learner`` per name, each on its host, writing the progress file the timeline reads."""
    for name in names:
        procs.start(name, learner_command(addresses, name, threads, device, min_step_s,
                                          token_file=place.token_file,
                                          progress_file=timeline.progress_file(name)),
                    env={"OMP_NUM_THREADS": str(threads)}, prefix=place.prefix(name))


class _LateLearners:
    """``cluster.late_learners``: each learner starts at its arrival (``ClusterConfig.arrivals_s``,
    wall seconds into the run here): at once, or later for capacity that frees up mid-run."""

    def __init__(self, names: list[str], arrivals_s: list[float], start: Callable[[list[str]], None]) -> None:
        self.pending = {name: t for name, t in zip(names, arrivals_s) if t > 0}
        self._start = start
        start([name for name in names if name not in self.pending])

    def start_due(self, elapsed_s: float) -> None:
        due = [name for name, t in self.pending.items() if t <= elapsed_s]
        if due:
            announce(f"{', '.join(due)}: joining the run under way ({elapsed_s:.0f}s in)")
            self._start(due)
            for name in due:
                del self.pending[name]


class _Evaluations:
    """The global model evaluated at the same points of the budget as on the virtual cluster,
    each a metrics row with the virtual cluster's columns (``virtual_time_s`` holds wall seconds)."""

    def __init__(self, config: Config, evaluator: GlobalEvaluator, started: float, progress: ProgressFn | None):
        self.config = config
        self.evaluator = evaluator
        self.started = started
        self.progress = progress
        self.rows: list[dict[str, Any]] = []

    def fraction(self, status: dict[str, Any]) -> float:
        return _fraction(self.config, status, time.monotonic() - self.started)

    def evaluate(self, status: dict[str, Any]) -> dict[str, Any]:
        eval_loss, versions = self.evaluator.evaluate()
        row = {
            "virtual_time_s": round(time.monotonic() - self.started, 3),
            "tokens": status["tokens"],
            "eval_loss": eval_loss,
            "goodput": status["goodput"],
            "uptime": status["model_uptime"],
            "bytes_up": status["bytes_up"],
            "bytes_down": status["bytes_down"],
            "fragment_versions": versions,
            "alive": sum(1 for lr in status["learners"] if lr["alive"]),
        }
        self.rows.append(row)
        if self.progress:
            self.progress(self.fraction(status), row)
        return row

    def at_next_point(self, status: dict[str, Any]) -> None:
        """Evaluate once the run has reached its next evaluation point; the last is the final evaluation's."""
        done, evals = len(self.rows), self.config.train.evals
        if done < evals and self.fraction(status) >= done / evals:
            self.evaluate(status)


def _watch(files: RunFiles, procs: Processes, timeline: RunTimeline, client: ShardedClient, stop: StopSignals,
           evaluations: _Evaluations, timeout_s: float | None, late: _LateLearners) -> None:
    """Poll the synchronizers' status into the timeline until the run finishes or a signal stops it,
    evaluating and starting late learners on the way; a dead synchronizer, every learner gone or
    the timeout is an error."""
    while stop.requested is None:
        late.start_due(time.monotonic() - evaluations.started)
        if timeout_s is not None and time.monotonic() - evaluations.started > timeout_s:
            raise DdilocoError(f"process run did not finish within {timeout_s:.0f}s (logs in {files.logs})")
        dead = next((name for name in files.sync_names if not procs.running(name)), None)
        if dead is not None:
            raise DdilocoError(f"the synchronizer {dead} exited with code {procs.children[dead].returncode}:\n"
                               + procs.tail(dead))
        try:
            status = client.status_dict()
        except (Unreachable, CallRefused):
            time.sleep(POLL_S)
            continue
        timeline.record(status)
        if status["finished"]:
            return
        if not late.pending and all(not procs.running(name) for name in timeline.learners):
            bad = next((n for n in timeline.learners if procs.children[n].returncode), None)
            raise DdilocoError("every learner exited before the run finished"
                               + (f"; {bad}:\n{procs.tail(bad)}" if bad else ""))
        evaluations.at_next_point(status)
        time.sleep(POLL_S)


def _first_status(files: RunFiles, procs: Processes, client: ShardedClient) -> dict[str, Any]:
    """The synchronizers' status once they answer: bound to its port, a synchronizer on a loaded host
    may still take seconds to answer its first call (issue 57: the run ended in a traceback, "connection
    attempt timed out before receiving SETTINGS frame", at a load average of 12 on 2 cores)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return client.status_dict()
        except (Unreachable, CallRefused) as err:
            dead = next((name for name in files.sync_names if not procs.running(name)), None)
            if dead is not None or time.monotonic() > deadline:
                raise DdilocoError(f"the synchronizer did not answer within {START_TIMEOUT_S:.0f}s: {err}"
                                   + (f"\n{procs.tail(dead)}" if dead else "")) from None
            time.sleep(POLL_S)


def _stop_learners(procs: Processes, timeline: RunTimeline, stop: StopSignals) -> None:
    """Learners leave by themselves at the end of the run; told to stop, they flush and leave."""
    if stop.requested is None:
        _wait_all(procs, timeline.learners)
        return
    announce(f"{stop.requested.name}: stopping the learners, then the synchronizer (final checkpoint)")
    procs.stop_all(timeline.learners, LEAVE_TIMEOUT_S)


def _wait_all(procs: Processes, names: list[str]) -> None:
    """Wait for ``names`` to exit by themselves; one slow to leave is stopped."""
    deadline = time.monotonic() + LEAVE_TIMEOUT_S
    for name in names:
        if name not in procs.children:
            continue  # a late learner the run finished without
        try:
            procs.children[name].wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs.stop(name)


def _fraction(config: Config, status: dict[str, Any], elapsed_s: float) -> float:
    if config.run.time_s:
        return min(1.0, elapsed_s / config.run.time_s)
    return min(1.0, status["tokens"] / max(1, config.run.tokens))
