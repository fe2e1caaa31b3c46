"""One run of one system in ``bench_peers.py``: ddiloco (``ddiloco sync`` and M ``ddiloco learner``
processes) or torchft (its Lighthouse and M replica processes, ``peers_torchft.py``), on the same
configuration file, under the same supervisor (``peers_supervisor.py``), watched the same way.

Both sides' learners write a batch log (every batch trained; kill -9 loses none) and a progress file;
the harness reads those for the tokens trained, evaluates the global model every ``EVAL_EVERY_S``
(ddiloco's from the synchronizer, torchft's from the replicas' snapshots of their committed
fragments) and notes when work was committed (a fragment version that moved; a replica's commit
line). At ``time_s`` after the learners were started both stop: ddiloco's learners get SIGTERM and
flush what they hold (what ``ddiloco run`` does at a run's end), torchft's replicas finish the outer
step under way (torchft has no flush). A peer that crashes or hangs fails its run with its log's
last lines: :class:`PeerFailed`, never retried.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peers_supervisor import Kill, Scenario, Supervised, Supervisor, System

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.runtime.batch_log import read_batch_log
from ddiloco.runtime.launch.child import EXEC
from ddiloco.runtime.launch.command_lines import learner_command
from ddiloco.runtime.launch.local_run import (
    LEAVE_TIMEOUT_S,
    GlobalEvaluator,
    Synchronizers,
    prepare_files,
)
from ddiloco.runtime.launch.placement import Placement
from ddiloco.runtime.launch.processes import Processes
from ddiloco.runtime.progress import read_progress
from ddiloco.runtime.sharded import ShardedClient
from ddiloco.settings.config import Config
from ddiloco.settings.config_sources import build_config
from ddiloco.workload.workload import Workload

POLL_S = 0.25
EVAL_EVERY_S = 2.0
FINISH_GRACE_S = 60.0
"""After the stop time, how long the learners may take to leave (a flush; torchft's last outer step, or a
quorum that waits out a departed peer's heartbeat) before the run counts as hung."""
START_TIMEOUT_S = 240.0
"""How long every learner may take to train its first step (python, torch, numba, the corpus: seconds on a
quiet machine, a minute when other jobs load the cores) before the run counts as failed."""
TORCHFT_SCRIPT = Path(__file__).resolve().parent / "peers_torchft.py"
STOP_FILE = "stop_at"
"""Where the harness writes the stop time (epoch s) for torchft's replicas once every learner trains."""


class PeerFailed(Exception):
    """A process of the run crashed or hung; the message ends with its log's last lines."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    system: System
    scenario: Scenario
    seed: int
    learners: int
    time_s: float
    """Wall seconds from the learners' start to their stop, the same for both systems."""
    preset: str
    out: Path
    kills: tuple[Kill, ...] = ()
    downtime_s: float = 0.0
    slow: str | None = None

    @property
    def names(self) -> list[str]:
        return [f"learner-{i}" for i in range(self.learners)]

    def config(self) -> Config:
        """The run's configuration; the synchronizer's budget is only a cap (the harness stops the run)."""
        return build_config(preset=self.preset, run__learners=self.learners, run__seed=self.seed,
                            run__time_s=self.time_s + 600.0)


@dataclass
class RunRecord:
    """What one run did; ``bench_peers.py`` turns it into the metrics."""

    spec: RunSpec
    tokens_per_step: int
    period: int
    curve: list[dict[str, Any]] = field(default_factory=list)
    """(t_s, eval_loss) of the global model, t_s from the learners' start (torchft's: when the snapshot was
    written)."""
    tokens_at: list[tuple[float, float]] = field(default_factory=list)
    """(t_s, tokens trained by then), sampled at every evaluation."""
    commit_times_s: list[float] = field(default_factory=list)
    batches_trained: dict[str, int] = field(default_factory=dict)
    batches_merged: dict[str, int] = field(default_factory=dict)
    steps_per_s: dict[str, float] = field(default_factory=dict)
    """Each learner's own pace: its steps over its training seconds, all incarnations together."""
    bytes_sent: float = 0.0
    start_to_step_s: list[float | None] = field(default_factory=list)
    """Every learner process's seconds from its start to its first step (None: killed or stopped before one)."""
    wall_s: float = 0.0
    supervised: Supervised = field(default_factory=Supervised)
    failed: str | None = None


class _Learners:
    """The learners' files: batch logs, progress files, and the counts of incarnations that ended."""

    def __init__(self, out: Path, names: list[str]) -> None:
        self.out = out
        self.base: dict[str, dict[str, float]] = {n: {} for n in names}
        self.train_s: dict[str, float] = {n: 0.0 for n in names}
        self.started: dict[str, float] = {}
        self.start_to_step_s: list[float | None] = []
        """Per process, seconds from its start to its first trained step (None: it never trained one)."""

    def progress(self, name: str) -> Path:
        return self.out / f"{name}.progress"

    def batches(self, name: str) -> Path:
        return self.out / f"{name}.batches"

    def before_start(self, name: str) -> None:
        """Fold the previous incarnation's last progress into the learner's totals, then forget its file."""
        self._fold(name)
        self.progress(name).unlink(missing_ok=True)
        self.started[name] = time.time()

    def _fold(self, name: str) -> None:
        last = read_progress(self.progress(name))
        if name in self.started:
            first = (last or {}).get("first_step_time")
            self.start_to_step_s.append(round(first - self.started.pop(name), 2) if first else None)
        if last is None:
            return
        for key in ("steps", "merged", "bytes_sent"):
            self.base[name][key] = self.base[name].get(key, 0.0) + float(last.get(key, 0) or 0)
        if last.get("first_step_time"):
            self.train_s[name] += last["time"] - last["first_step_time"]

    def total(self, name: str, key: str) -> float:
        last = read_progress(self.progress(name)) or {}
        return self.base[name].get(key, 0.0) + float(last.get(key, 0) or 0)

    def trained(self, name: str) -> int:
        return sum(p.trained_to - p.resumed_at for p in read_batch_log(self.batches(name)))

    def finish(self, names: list[str]) -> dict[str, float]:
        """Each learner's steps per second of training, once every process has ended."""
        rates = {}
        for name in names:
            steps = self.total(name, "steps")
            self._fold(name)
            self.progress(name).unlink(missing_ok=True)
            rates[name] = steps / self.train_s[name] if self.train_s[name] > 0 else 0.0
        return rates


def run(spec: RunSpec) -> RunRecord:
    """Run ``spec`` to its end; a crash or hang is recorded in ``failed`` (with the log's tail), not raised."""
    torch.set_num_threads(1)  # the harness's evaluations share the cores: torch's threads spin against a loaded machine
    config = spec.config()
    shutil.rmtree(spec.out, ignore_errors=True)  # this run's own directory: nothing of an earlier run resumes
    files = prepare_files(config, spec.out)
    procs = Processes(files.logs)
    record = RunRecord(spec, config.train.batch_size * config.model.seq_len, config.protocol.period)
    side: _Side = _Ddiloco(spec, config, files, procs) if spec.system is System.DDILOCO else _Torchft(spec, config,
                                                                                                     files, procs)
    supervisor: Supervisor | None = None
    started = time.monotonic()
    try:
        side.start_servers()
        supervisor = Supervisor(procs, spec.names, side.start_learner, kills=list(spec.kills),
                                downtime_s=spec.downtime_s, slow=spec.slow)
        for name in spec.names:
            side.start_learner(name)
        t0 = side.t0 = _all_training(spec, side, procs)
        (spec.out / STOP_FILE).write_text(f"{t0 + spec.time_s:.3f}")
        supervisor.begin(time.monotonic())
        next_eval = 0.0
        stopped = False
        while True:
            now = time.time() - t0
            side.poll(now, record)
            if now >= next_eval:
                next_eval += EVAL_EVERY_S
                record.tokens_at.append((round(now, 2), side.tokens()))
                side.evaluate(now, record)
            with supervisor.lock:
                crashed = next((n for n in [*side.servers, *spec.names] if procs.died(n)), None)
            if crashed is not None:
                raise PeerFailed(f"{crashed} exited with code {procs.children[crashed].returncode}:\n"
                                 + procs.tail(crashed))
            if now >= spec.time_s and not stopped:
                supervisor.end_faults()
                side.stop_learners()
                stopped = True
            if stopped and not any(procs.running(n) for n in spec.names):
                break
            if now > spec.time_s + FINISH_GRACE_S:
                hung = next(n for n in spec.names if procs.running(n))
                raise PeerFailed(f"{hung} still running {FINISH_GRACE_S:.0f}s after the stop time:\n"
                                 + procs.tail(hung))
            time.sleep(POLL_S)
        record.tokens_at.append((round(time.time() - t0, 2), side.tokens()))
        side.evaluate(time.time() - t0, record, final=True)
        side.finish(record)
    except (PeerFailed, DdilocoError) as err:
        record.failed = str(err)
    finally:
        if supervisor is not None:
            record.supervised = supervisor.close()
        side.close()
        procs.close()
    record.wall_s = round(time.monotonic() - started, 1)
    return record


def _all_training(spec: RunSpec, side: "_Side", procs: Processes) -> float:
    """The time at which every learner has trained a step: the run's time 0 for both systems, so that
    neither's start-up (ddiloco's learners also compile their kernels) counts in its window."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        crashed = next((n for n in [*side.servers, *spec.names] if procs.died(n)), None)
        if crashed is not None:
            raise PeerFailed(f"{crashed} exited with code {procs.children[crashed].returncode} before training:\n"
                             + procs.tail(crashed))
        if all((read_progress(side.learners.progress(n)) or {}).get("steps", 0) > 0 for n in spec.names):
            return time.time()
        time.sleep(POLL_S)
    late = next(n for n in spec.names if not (read_progress(side.learners.progress(n)) or {}).get("steps"))
    raise PeerFailed(f"{late} trained no step within {START_TIMEOUT_S:.0f}s:\n" + procs.tail(late))


class _Side:
    """What differs between the two systems; the loop in :func:`run` is the same for both."""

    servers: list[str]
    t0: float = 0.0

    def __init__(self, spec: RunSpec, config: Config, files: Any, procs: Processes) -> None:
        self.spec = spec
        self.config = config
        self.files = files
        self.procs = procs
        self.learners = _Learners(spec.out, spec.names)
        for name in spec.names:  # a kept directory's earlier run
            self.learners.batches(name).unlink(missing_ok=True)
            self.learners.progress(name).unlink(missing_ok=True)

    def tokens(self) -> float:
        return sum(self.learners.total(n, "steps") for n in self.spec.names) * self.config.train.batch_size \
            * self.config.model.seq_len

    def start_servers(self) -> None: ...
    def start_learner(self, name: str) -> None: ...
    def poll(self, now: float, record: RunRecord) -> None: ...
    def evaluate(self, now: float, record: RunRecord, final: bool = False) -> None: ...
    def stop_learners(self) -> None: ...
    def finish(self, record: RunRecord) -> None: ...
    def close(self) -> None: ...


class _Ddiloco(_Side):
    servers = ["sync"]

    def start_servers(self) -> None:
        (self.address,) = Synchronizers.of_run(self.files, Placement(None, None), self.procs, pages=False).start_all()
        self.client = ShardedClient([self.address])
        self.evaluator = GlobalEvaluator(self.config, self.client)
        self.versions = -1
        self.status: dict[str, Any] = {}

    def start_learner(self, name: str) -> None:
        self.learners.before_start(name)
        self.procs.start(name, learner_command([self.address], name, 1, "cpu",
                                               progress_file=self.learners.progress(name),
                                               batch_log=self.learners.batches(name)),
                         env={"OMP_NUM_THREADS": "1"})

    def poll(self, now: float, record: RunRecord) -> None:
        try:
            self.status = self.client.status_dict()
        except Exception:  # noqa: BLE001 - a busy synchronizer misses a poll, not the run
            return
        versions = sum(f["version"] for f in self.status["fragments"])
        if self.versions >= 0 and versions > self.versions:
            record.commit_times_s.append(round(now, 3))
        self.versions = versions

    def evaluate(self, now: float, record: RunRecord, final: bool = False) -> None:
        loss, _ = self.evaluator.evaluate()
        record.curve.append({"t_s": round(now, 2), "eval_loss": loss, "final": final})

    def stop_learners(self) -> None:
        self.procs.stop_all(self.spec.names, LEAVE_TIMEOUT_S)  # SIGTERM: finish the step, flush, leave

    def finish(self, record: RunRecord) -> None:
        status = self.client.status_dict()
        by_id = {lr["id"]: lr for lr in status["learners"]}
        for name in self.spec.names:
            record.batches_trained[name] = self.learners.trained(name)
            record.batches_merged[name] = int(by_id.get(name, {}).get("data_position", 0))
        record.bytes_sent = float(status["bytes_up"])
        record.steps_per_s = self.learners.finish(self.spec.names)
        record.start_to_step_s = self.learners.start_to_step_s

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        self.procs.stop_all(self.servers, LEAVE_TIMEOUT_S)


class _Torchft(_Side):
    servers = ["lighthouse"]

    def start_servers(self) -> None:
        port_file = self.spec.out / "lighthouse.port"
        port_file.unlink(missing_ok=True)
        self.procs.start("lighthouse", [sys.executable, str(TORCHFT_SCRIPT), "lighthouse", "--port-file",
                                        str(port_file)], module=EXEC)
        deadline = time.monotonic() + 120.0
        while not port_file.exists():
            if not self.procs.running("lighthouse") or time.monotonic() > deadline:
                raise PeerFailed("torchft's Lighthouse did not start:\n" + self.procs.tail("lighthouse"))
            time.sleep(0.1)
        self.address = port_file.read_text().strip()
        self.workload = Workload.build(self.config)
        self.model = self.workload.new_model()
        self.seen: dict[int, int] = {}
        self.snapshot_time = 0.0
        for old in self.spec.out.glob("commits-*.log"):
            old.unlink()
        for old in self.spec.out.glob("global-*.pt"):
            old.unlink()

    def start_learner(self, name: str) -> None:
        self.learners.before_start(name)
        kind = "ddp" if self.spec.system is System.TORCHFT_DDP else "diloco"
        self.procs.start(name, [sys.executable, str(TORCHFT_SCRIPT), "replica", "--kind", kind, "--index",
                                name.rsplit("-", 1)[1], "--lighthouse", self.address, "--config",
                                str(self.files.config_file), "--out", str(self.spec.out)],
                         env={"OMP_NUM_THREADS": "1"}, module=EXEC)

    def poll(self, now: float, record: RunRecord) -> None:
        for path in sorted(self.spec.out.glob("commits-*.log")):
            index = int(path.stem.rsplit("-", 1)[1])
            lines = path.read_text().split("\n")[:-1]
            for line in lines[self.seen.get(index, 0):]:
                record.commit_times_s.append(round(float(line.split()[0]) - self.t0, 3))
            self.seen[index] = len(lines)

    def evaluate(self, now: float, record: RunRecord, final: bool = False) -> None:
        newest: dict[str, Any] | None = None
        for path in self.spec.out.glob("global-*.pt"):
            try:
                snap = torch.load(path, weights_only=True)
            except Exception:  # noqa: BLE001 - a file replaced while read: the next poll reads it
                continue
            if newest is None or snap["time"] > newest["time"]:
                newest = snap
        if newest is None or (newest["time"] <= self.snapshot_time and not final):
            return
        self.snapshot_time = newest["time"]
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, value in newest["params"].items():
                params[key].copy_(value)
        record.curve.append({"t_s": round(newest["time"] - self.t0, 2), "eval_loss": self.workload.evaluate(self.model),
                             "final": final})

    def stop_learners(self) -> None:
        """Replicas stop by themselves at the stop time, once their outer step is complete."""

    def finish(self, record: RunRecord) -> None:
        for name in self.spec.names:
            record.batches_trained[name] = self.learners.trained(name)
            record.batches_merged[name] = int(self.learners.total(name, "merged"))
            record.bytes_sent += self.learners.total(name, "bytes_sent")
        record.steps_per_s = self.learners.finish(self.spec.names)
        record.start_to_step_s = self.learners.start_to_step_s

    def close(self) -> None:
        self.procs.stop_all(self.servers, 5.0)

