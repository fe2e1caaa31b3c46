"""A soak: thousands of kills in one ``ddiloco chaos`` run, and what the surviving processes hold.

A hundred kills show that a learner rejoins; slow faults show only at thousands: a file
descriptor, a thread, a registry entry or a round-log segment kept per incarnation, a data
position that drifts a little at every restart (issue 56). So the soak runs the chaos
runner (:class:`ddiloco.chaos.runner.ChaosRun`, its supervisor restarts every learner it
kills) on a schedule of many kills (:func:`soak_schedule`) and, every ``sample_every`` kills,
reads what the operating system says of the synchronizer (``/proc``: RSS, peak RSS, open fds,
threads), of its state directory (bytes, files), of each learner and its link helper, and
what the synchronizer says of the run (goodput, tokens; the eval loss of its global model,
evaluated on a thread of its own so that the runner's loop keeps injecting on time).
:func:`judge` turns the samples and the chaos report into the issue's promises, each a boolean.
"""

from __future__ import annotations

import enum
import os
import random
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.chaos.outcome import LiveState
from ddiloco.chaos.runner import ChaosRun
from ddiloco.chaos.schedule import Fault, learner_name
from ddiloco.runtime.client import CallRefused, Unreachable
from ddiloco.runtime.sharded import ShardedClient
from ddiloco.runtime.sync.state_dir import load_latest
from ddiloco.settings.config import Config
from ddiloco.settings.fault_kinds import FaultKind
from ddiloco.workload.checkpoint import CheckpointError

FIRST_KILL_S = 5.0
"""Every learner joins and contributes before the first fault."""
KILL_GAP_S = 9.0
"""Between kills, on the schedule's clock. bench_chaos.py measured 6 s too short on this 2-core
machine: under load restarts outran the rotation and every learner was down at once."""
DOWN_S = 1.0
"""How long a killed process stays down before the supervisor starts it again."""
FLAT_TOLERANCE = 0.10
"""A figure at the last sample may exceed the second sample's by this much (the first is warm-up)."""
QUIET_S = 2.0
"""A sample waits until the synchronizer has answered this long since its last restart ..."""
QUIET_DEADLINE_S = 30.0
"""... and every learner is alive, but no longer than this after its kill count was reached."""


class Promise(enum.StrEnum):
    """What the soak must show; exit 0 only if every one holds."""

    LEARNERS_ALIVE_AND_TRAINING = "every_learner_alive_and_training_at_end"
    BUDGET_REACHED = "run_reached_its_budget"
    SYNC_RSS_FLAT = "sync_rss_flat"
    SYNC_FDS_FLAT = "sync_fds_flat"
    SYNC_THREADS_FLAT = "sync_threads_flat"
    STATE_DIR_FLAT = "state_dir_bytes_flat"
    NO_MERGED_VERSION_LOST = "no_merged_version_lost"
    NO_HONEST_STEP_REFUSED = "no_honest_step_refused"
    NO_DATA_SKIPPED = "no_data_skipped"
    RETRAINED_WITHIN_ONE_PERIOD_PER_KILL = "retrained_within_one_period_per_kill"


FLAT_FIGURES = {Promise.SYNC_RSS_FLAT: "sync_rss_kib", Promise.SYNC_FDS_FLAT: "sync_fds",
                Promise.SYNC_THREADS_FLAT: "sync_threads", Promise.STATE_DIR_FLAT: "state_dir_settled_bytes"}
"""The flatness promises and the sampled figure each one compares."""


# ---- the operating system's view ----------------------------------------------------------------

@dataclass(frozen=True)
class ProcFigures:
    """One process as ``/proc`` shows it."""

    rss_kib: int
    hwm_kib: int
    """Peak RSS of this process since it started (VmHWM)."""
    fds: int
    threads: int


def read_proc(pid: int) -> ProcFigures | None:
    """``pid``'s RSS, peak RSS, open fds and threads; None if it is gone (or not ours to read)."""
    try:
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.split()
        return ProcFigures(rss_kib=int(fields["VmRSS"][0]), hwm_kib=int(fields["VmHWM"][0]),
                           fds=len(os.listdir(f"/proc/{pid}/fd")), threads=int(fields["Threads"][0]))
    except (OSError, KeyError, IndexError, ValueError):  # gone between the reads, a zombie, another user's
        return None


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (a learner's link helper, a synchronizer's status page)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the name in parentheses may hold spaces
            found.append(int(entry))
    return sorted(found)


_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")
_SEGMENT = re.compile(r"rounds-(\d+)\.log$")


def state_dir_size(path: Path) -> tuple[int, int, int]:
    """(bytes, files, settled bytes) of a synchronizer's state directory; files that vanish while it
    walks (a checkpoint replaced) are skipped.

    The total is a sawtooth that says nothing of a leak: the round log's segments since the latest
    checkpoint grow until the next one (20 rounds or 30 s; a restarted synchronizer opens a segment
    beside the one its predecessor left, and the next checkpoint deletes both), and a checkpoint being
    written sits beside the latest until ``CURRENT`` names it. The settled bytes leave out exactly
    those, so what is left can grow only if something is kept that should not be: old checkpoints,
    segments a checkpoint already holds, a manifest that grows.
    """
    try:
        current = _CHECKPOINT.match((path / "CURRENT").read_text().strip())
    except OSError:
        current = None
    latest = int(current.group(1)) if current else -1
    segments = [int(m.group(1)) for p in _listdir(path) if (m := _SEGMENT.match(p))]
    live_from = _round_log_from(path) if current else None
    if live_from is None:  # no checkpoint names its segment: only the newest is surely live
        live_from = max(segments, default=-1)
    total = files = settled = 0
    for root, _, names in os.walk(path):
        top = os.path.relpath(root, path).split(os.sep)[0]
        folder = _CHECKPOINT.match(top)
        in_progress = folder is not None and int(folder.group(1)) > latest
        for name in names:
            try:
                size = os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue
            total, files = total + size, files + 1
            segment = _SEGMENT.match(name) if root == str(path) else None
            if not in_progress and not (segment and int(segment.group(1)) >= live_from):
                settled += size
    return total, files, settled


def _round_log_from(path: Path) -> int | None:
    """The first round-log segment the latest checkpoint still needs (its ``round_log_from``), or
    None when it cannot be read (being replaced as the harness looks)."""
    try:
        saved = load_latest(path)
        return None if saved is None else int(saved["service"]["round_log_from"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return None


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# ---- samples ----------------------------------------------------------------------------------

@dataclass
class SoakSample:
    """The figures at one kill count; ``None`` where a process could not be read."""

    kills: int
    sync_kills: int
    t_s: float
    """Seconds after the first join."""
    quiet: bool
    """Taken with the synchronizer up for QUIET_S and every learner alive (else at the deadline)."""
    sync_rss_kib: int | None
    sync_hwm_kib: int | None
    sync_fds: int | None
    sync_threads: int | None
    status_page_rss_kib: int | None
    state_dir_bytes: int
    state_dir_files: int
    state_dir_settled_bytes: int
    """Without the newest round-log segment and a checkpoint still being written (:func:`state_dir_size`)."""
    harness_rss_kib: int | None
    """This process: the chaos runner and every learner's fault-injecting proxy (asyncio, one thread)."""
    learners_alive: int
    learner_rss_kib: dict[str, int | None] = field(default_factory=dict)
    helper_rss_kib: dict[str, int | None] = field(default_factory=dict)
    """Each learner's link helper (the process that talks to the synchronizer for it)."""
    goodput: float | None = None
    tokens: int | None = None
    eval_loss: float | None = None
    """The global model's, evaluated after the sample (filled in when the evaluation ends)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SoakSampler:
    """Watches a :class:`ChaosRun` through its live callback; every ``sample_every`` learner kills,
    once the cluster is quiet (or the deadline passed), takes a :class:`SoakSample`."""

    def __init__(self, config: Config, sample_every: int, *, evaluate: bool = True,
                 on_sample: Any = None) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self.config = config
        self.sample_every = sample_every
        self.evaluate = evaluate
        self.on_sample = on_sample or (lambda sample: None)
        self.samples: list[SoakSample] = []
        self.run: ChaosRun | None = None
        self._due_since: float | None = None
        self._next = sample_every
        self._up_since: float | None = None
        self._evaluator: Any = None
        self._eval_thread: threading.Thread | None = None

    def attach(self, run: ChaosRun) -> None:
        self.run = run

    def tick(self, state: LiveState) -> None:
        """The runner's ``on_sample``: called after every status poll."""
        now = time.monotonic()
        self._up_since = (self._up_since or now) if state.sync_up else None
        kills = state.faults_so_far.get(str(FaultKind.LEARNER_CRASH), 0)
        if kills < self._next:
            return
        self._due_since = self._due_since or now
        quiet = self._up_since is not None and now - self._up_since >= QUIET_S and state.alive == state.learners
        if not quiet and (now - self._due_since < QUIET_DEADLINE_S or not state.sync_up):
            return
        self._take(kills, state, quiet)
        self._due_since = None
        self._next = (kills // self.sample_every + 1) * self.sample_every

    def _take(self, kills: int, state: LiveState, quiet: bool) -> None:
        run = self.run
        assert run is not None and run.cluster is not None
        cluster, procs = run.cluster, run.cluster.procs
        sync_pid = procs.children[cluster.syncs[0]].pid
        sync = read_proc(sync_pid)
        page = [read_proc(p) for p in children_of(sync_pid)]
        size, files, settled = state_dir_size(cluster.files.state_dirs[0])
        learners, helpers = {}, {}
        for i in range(run.m):
            name = learner_name(i)
            proc = procs.children.get(name)
            figures = read_proc(proc.pid) if proc is not None and proc.poll() is None else None
            learners[name] = figures.rss_kib if figures else None
            kids = [read_proc(p) for p in children_of(proc.pid)] if figures and proc is not None else []
            helpers[name] = sum(k.rss_kib for k in kids if k) if any(kids) else None
        own = read_proc(os.getpid())
        sample = SoakSample(
            kills=kills, sync_kills=state.faults_so_far.get(str(FaultKind.SYNC_CRASH), 0), t_s=round(run.now_s(), 1),
            quiet=quiet, sync_rss_kib=sync.rss_kib if sync else None, sync_hwm_kib=sync.hwm_kib if sync else None,
            sync_fds=sync.fds if sync else None, sync_threads=sync.threads if sync else None,
            status_page_rss_kib=sum(p.rss_kib for p in page if p) if any(page) else None,
            state_dir_bytes=size, state_dir_files=files,
            state_dir_settled_bytes=settled, harness_rss_kib=own.rss_kib if own else None,
            learners_alive=state.alive, learner_rss_kib=learners, helper_rss_kib=helpers)
        addresses = [cluster.synchronizers.address(i) for i in range(len(cluster.syncs))]
        try:
            with ShardedClient(addresses, token=cluster.place.token) as client:
                status = client.status_dict(timeout_s=5.0)
            sample.goodput, sample.tokens = status.get("goodput"), status.get("tokens")
        except (Unreachable, CallRefused):
            pass  # down again already: the figures above stand without them
        self.samples.append(sample)
        self.on_sample(sample)
        if self.evaluate and (self._eval_thread is None or not self._eval_thread.is_alive()):
            self._eval_thread = threading.Thread(target=self._evaluate, args=(sample, addresses, cluster.place.token),
                                                 name="soak-eval", daemon=True)
            self._eval_thread.start()

    def _evaluate(self, sample: SoakSample, addresses: list[str], token: str | None) -> None:
        """The global model's eval loss now, off the runner's loop (an evaluation takes seconds under load)."""
        from ddiloco.runtime.launch.local_run import GlobalEvaluator

        try:
            with ShardedClient(addresses, token=token) as client:
                if self._evaluator is None:
                    self._evaluator = GlobalEvaluator(self.config, client)
                self._evaluator.client = client
                sample.eval_loss = round(self._evaluator.evaluate()[0], 4)
        except (Unreachable, CallRefused):
            pass  # the synchronizer was killed meanwhile: this sample has no eval loss

    def join(self, timeout_s: float = 120.0) -> None:
        """Wait for the last evaluation (it reads a synchronizer that is still running)."""
        if self._eval_thread is not None:
            self._eval_thread.join(timeout_s)


# ---- the schedule -------------------------------------------------------------------------------

def soak_schedule(*, kills: int, sync_kills: int, learners: int, seed: int, sample_every: int, lease_s: float,
                  freezes: int, partitions: int, gap_s: float = KILL_GAP_S) -> tuple[list[Fault], float]:
    """``kills`` learner kills ``gap_s`` apart, each lap of the learners in a seeded order (never the same
    learner twice in a row), ``sync_kills`` synchronizer kills half-way between two samples (so that
    a sample never reads an incarnation that is seconds old), and a few freezes (1.5 leases: the
    learner must rejoin) and partitions (0.5-1.5 leases) on learners not killed just before or after.
    Returns (faults in time order, the fault window)."""
    if kills < 1 or sync_kills < 0 or learners < 2:
        raise ValueError(f"need kills >= 1, sync_kills >= 0, learners >= 2; got {kills}, {sync_kills}, {learners}")
    rng = random.Random(f"soak-{seed}")
    order: list[str] = []
    while len(order) < kills:
        lap = [learner_name(i) for i in range(learners)]
        rng.shuffle(lap)
        if order and lap[0] == order[-1]:
            lap[0], lap[-1] = lap[-1], lap[0]
        order += lap
    faults = [Fault(at_s=FIRST_KILL_S + k * gap_s, kind=FaultKind.LEARNER_CRASH, target=order[k], duration_s=DOWN_S)
              for k in range(kills)]
    slots = _sync_slots(kills, sync_kills, sample_every)
    faults += [Fault(at_s=FIRST_KILL_S + (slot - 1) * gap_s + gap_s / 2, kind=FaultKind.SYNC_CRASH, target="sync",
                     duration_s=DOWN_S) for slot in slots]
    free = [k for k in range(1, kills - 1) if k + 1 not in slots]  # the gap after kill k holds no sync kill
    kinds = [FaultKind.FREEZE] * freezes + [FaultKind.PARTITION] * partitions
    rng.shuffle(kinds)
    for kind, k in zip(kinds, sorted(rng.sample(free, min(len(free), len(kinds))))):
        busy = {order[k - 1], order[k], order[k + 1]}
        target = rng.choice([name for name in map(learner_name, range(learners)) if name not in busy] or [order[k]])
        freeze = kind is FaultKind.FREEZE
        faults.append(Fault(at_s=round(FIRST_KILL_S + k * gap_s + 0.25 * gap_s, 2),
                            kind=kind, target=target,
                            duration_s=round(lease_s * (1.5 if freeze else rng.uniform(0.5, 1.5)), 2)))
    faults.sort(key=lambda f: f.at_s)
    return faults, max(f.end_s for f in faults) + 1.0


def _sync_slots(kills: int, sync_kills: int, sample_every: int) -> list[int]:
    """Kill counts after which a synchronizer kill comes: the middle of a sample interval past the first
    sample where there are intervals enough, else spread evenly."""
    if sync_kills == 0:
        return []
    intervals = kills // sample_every - 1
    slots = []
    for j in range(sync_kills):
        x = sample_every + (j + 0.5) * (kills - sample_every) / sync_kills if intervals >= 1 \
            else (j + 0.5) * kills / sync_kills
        if 1 <= sync_kills <= intervals:
            x = (x // sample_every + 0.5) * sample_every
        slots.append(min(kills - 1, max(1, int(x))))
    return slots


# ---- the promises -------------------------------------------------------------------------------

def flat(samples: list[SoakSample], key: str, tolerance: float = FLAT_TOLERANCE) -> bool | None:
    """Whether ``key`` at the last sample has grown no more than ``tolerance`` above its value at the
    second sample (None: fewer than two samples with a value: nothing to compare).

    Only growth breaks it: a leak grows with the kills, while a figure that fell (a synchronizer
    restarted since, whose lazily started threads and pools are not all back yet) leaks nothing.
    """
    values = [getattr(s, key) for s in samples if getattr(s, key) is not None]
    if len(values) < 2:
        return None
    reference = values[1] if len(values) > 2 else values[0]
    return values[-1] - reference <= tolerance * max(abs(reference), 1)


def judge(report: dict[str, Any], samples: list[SoakSample]) -> dict[Promise, bool]:
    """Each promise from the chaos report (``chaos.json``'s keys) and the samples."""
    by_learner = report["batches_by_learner"]
    training = all(c["processes"] and c["processes"][-1][1] > c["processes"][-1][0] for c in by_learner.values())
    restarts = report["sync_restarts"]
    promises = {
        Promise.LEARNERS_ALIVE_AND_TRAINING: report["learners_alive_at_end"] == report["learners"]
        and len(by_learner) == report["learners"] and training,
        Promise.BUDGET_REACHED: bool(report["completed"]),
        Promise.NO_MERGED_VERSION_LOST: all(r["answering_at_s"] is not None and r["rounds_lost"] == 0
                                            for r in restarts),
        Promise.NO_HONEST_STEP_REFUSED: report["honest_refused_steps"] == 0,
        Promise.NO_DATA_SKIPPED: report["batches_skipped"] == 0,
        Promise.RETRAINED_WITHIN_ONE_PERIOD_PER_KILL: report["batches_retrained_beyond_period"] == 0,
    }
    for promise, key in FLAT_FIGURES.items():
        promises[promise] = bool(flat(samples, key))  # no samples to compare is not a flat line
    return promises
