"""The one supervisor ``bench_peers.py`` runs both systems under: kill -9 on a seeded schedule,
restarts after a fixed downtime, a learner throttled to half speed, and each learner's peak memory.

Nothing here knows which system it supervises: it gets the learners' names, the process table
(:class:`ddiloco.runtime.launch.processes.Processes`) and a function that starts a learner, so a
ddiloco learner and a torchft replica meet the same faults at the same seconds of their runs.
"""

from __future__ import annotations

import enum
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the command line parses its arguments without importing torch
    from ddiloco.runtime.launch.processes import Processes

TICK_S = 0.05
"""How often the supervisor looks at its schedule: kills land within this of their time, whatever the
harness's main loop is busy with (an evaluation on a loaded machine takes seconds)."""
THROTTLE_SLICE_S = 0.1
"""The slow learner runs this long, then stands still (SIGSTOP) as long: half its speed, whatever a step
costs, and the same for both systems (its whole process group: trainer and link helper alike)."""


class Scenario(enum.StrEnum):
    FAULT_FREE = "fault_free"
    KILLS = "kills"
    SLOW_LEARNER = "slow_learner"


class System(enum.StrEnum):
    DDILOCO = "ddiloco"
    TORCHFT_DILOCO = "torchft_diloco"
    TORCHFT_DDP = "torchft_ddp"


@dataclass(frozen=True, slots=True)
class Kill:
    """``learner`` gets kill -9 ``at_s`` seconds into the run and is started again ``downtime_s`` later."""

    at_s: float
    learner: str


def kill_schedule(seed: int, learners: list[str], kills: int, time_s: float, downtime_s: float,
                  warmup_s: float) -> list[Kill]:
    """``kills`` kill -9 between ``warmup_s`` and the end of the run less one downtime and a margin, one at a
    time, the learners in turn (each lap in a seeded order, so every learner is killed about as often): the
    window is cut into equal slots, each kill at a seeded time in the first half of its slot, so two kills
    are at least half a slot apart and a learner is never killed while it is down."""
    rng = random.Random(seed)
    if kills == 0:
        return []
    end_s = time_s - downtime_s - 5.0
    slot_s = (end_s - warmup_s) / kills
    if slot_s <= 2 * downtime_s:
        raise ValueError(f"{kills} kills with {downtime_s:.0f}s down each do not fit between {warmup_s:.0f}s "
                         f"and the end of a {time_s:.0f}s run")
    order: list[str] = []
    while len(order) < kills:
        lap = list(learners)
        rng.shuffle(lap)
        order.extend(lap)
    return [Kill(round(warmup_s + k * slot_s + rng.uniform(0.0, slot_s / 2), 2), name)
            for k, name in enumerate(order[:kills])]


@dataclass
class Supervised:
    """What the supervisor did and saw; times are seconds into the run."""

    kills: list[tuple[float, str]] = field(default_factory=list)
    restarts: list[tuple[float, str]] = field(default_factory=list)
    vmhwm_mib: dict[str, float] = field(default_factory=dict)
    """Each learner's peak, its process and the children it started (a ddiloco learner's link helper)
    together, the largest over its incarnations."""


class Supervisor:
    """Carries out ``kills`` and the throttling of ``slow`` on the processes of ``learners``, each in a thread
    of its own, from :meth:`begin` (the learners' start, time 0) to :meth:`close`.

    The thread that restarts a learner must outlive it (a child of the table dies with the thread that
    started it), so :meth:`close` comes after the learners have stopped.
    """

    def __init__(self, procs: "Processes", learners: list[str], start: Callable[[str], None], *, kills: list[Kill],
                 downtime_s: float, slow: str | None) -> None:
        self.procs = procs
        self.learners = learners
        self.start = start
        self.pending = sorted(kills, key=lambda k: k.at_s)
        self.downtime_s = downtime_s
        self.down: dict[str, float] = {}
        self.seen = Supervised()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True)]
        if slow:
            self._threads.append(threading.Thread(target=self._throttle_loop, args=(slow,), daemon=True))

    def begin(self, t0_monotonic: float) -> None:
        self._t0 = t0_monotonic
        for thread in self._threads:
            thread.start()

    def end_faults(self) -> None:
        """No more kills or restarts (the run's stop time): a learner down now stays down."""
        with self.lock:
            self.pending.clear()
            self.down.clear()

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            with self.lock:
                self.tick(time.monotonic() - self._t0)

    def tick(self, now_s: float) -> None:
        while self.pending and self.pending[0].at_s <= now_s:
            kill = self.pending.pop(0)
            if self.procs.signal(kill.learner, signal.SIGKILL):
                self.seen.kills.append((round(now_s, 2), kill.learner))
                self.down[kill.learner] = now_s
        for name, since in list(self.down.items()):
            if now_s - since >= self.downtime_s:
                del self.down[name]
                self.start(name)
                self.seen.restarts.append((round(now_s, 2), name))
        for name in self.learners:
            proc = self.procs.children.get(name)
            if proc is not None and proc.poll() is None:
                peak = tree_vmhwm_mib(proc.pid)
                self.seen.vmhwm_mib[name] = max(self.seen.vmhwm_mib.get(name, 0.0), peak)

    def _throttle_loop(self, name: str) -> None:
        while not self._stop.is_set():
            self._signal_group(name, signal.SIGCONT)
            if self._stop.wait(THROTTLE_SLICE_S):
                break
            self._signal_group(name, signal.SIGSTOP)
            self._stop.wait(THROTTLE_SLICE_S)
        self._signal_group(name, signal.SIGCONT)

    def _signal_group(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs.children.get(name)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)  # every child of the table leads its own process group
            except ProcessLookupError:
                pass

    def close(self) -> Supervised:
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5.0)
        return self.seen


def tree_vmhwm_mib(pid: int) -> float:
    """VmHWM of ``pid`` and its descendants, MiB (0 for a process that is gone)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except (OSError, ValueError):
            continue
    return total


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.extend([child, *_descendants(child)])
    return found
