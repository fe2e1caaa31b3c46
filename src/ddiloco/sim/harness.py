"""What every mode of a virtual run shares: failure trace, speeds, evaluation schedule, metrics.

Decoupled DiLoCo and its baselines are compared on the same workload
(:class:`~ddiloco.workload.workload.Workload`), the same step-time draws and the same
failures; this module builds those once from a :class:`~ddiloco.settings.config.Config` and records
what a run measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.measures.useful_work import Accounting
from ddiloco.measures.wire_bytes import ByteLedger, Direction
from ddiloco.outputs.reporting import ProgressFn, RowFn
from ddiloco.settings.config import Config
from ddiloco.sim.faults import FailureTrace
from ddiloco.sim.speed import StepTimer
from ddiloco.workload.workload import Workload


@dataclass(slots=True)
class Recorder:
    """Budget, evaluation schedule, metrics rows and the progress callback of one run."""

    config: Config
    workload: Workload
    progress: ProgressFn | None = None
    on_row: RowFn | None = None
    """Called with every metrics row as soon as it is recorded (the run's files grow as it goes)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    accounting: Accounting = field(init=False)
    bytes: ByteLedger = field(default_factory=ByteLedger)
    trace: FailureTrace = field(init=False)
    timer: StepTimer = field(init=False)
    schedule_span: tuple[float, float] = (0.0, 1.0)
    """The share of the whole run's learning-rate schedule this run covers (a warm start's
    phases each cover part of it, ``experiment.run_warm_started``)."""
    _next_eval: int = 0

    def __post_init__(self) -> None:
        c = self.config
        self.accounting = Accounting(c.cluster.arrivals_s(c.run.learners))
        self.trace = FailureTrace(
            learners=c.run.learners,
            mtbf_s=c.faults.mtbf_s,
            downtime_s=c.faults.downtime_s,
            horizon_s=self.horizon_s(),
            seed=c.run.seed,
        )
        self.timer = StepTimer(
            learners=c.run.learners,
            step_time_s=c.cluster.step_time_s,
            jitter=c.cluster.jitter,
            slow_fraction=c.cluster.slow_fraction,
            slow_factor=c.cluster.slow_factor,
            seed=c.run.seed,
        )

    def horizon_s(self) -> float:
        """Virtual time the failure trace must cover: the time budget, or a generous bound."""
        c = self.config
        if c.run.time_s:
            return c.run.time_s
        steps = c.run.tokens / (self.workload.tokens_per_step * c.run.learners)
        return 50.0 * steps * c.cluster.step_time_s * c.cluster.slow_factor + 1000.0

    def fraction_done(self, tokens: int, now: float) -> float:
        run = self.config.run
        if run.time_s:
            return min(1.0, now / run.time_s)
        return min(1.0, tokens / run.tokens)

    def run_progress(self, tokens: int, now: float) -> float:
        """Where the inner learning-rate schedule stands: the fraction done, placed on the span."""
        start, end = self.schedule_span
        return start + (end - start) * self.fraction_done(tokens, now)

    def eval_due(self, tokens: int, now: float) -> bool:
        """``train.evals`` evaluations spread over the run, the first at its start; the
        driver's closing evaluation (after the last merges) is the one at 100%."""
        evals = self.config.train.evals
        return self._next_eval < evals and self.fraction_done(tokens, now) >= self._next_eval / evals

    def figures(self, now: float, tokens: int) -> dict[str, Any]:
        """The run's figures at ``now``, one definition for the metrics rows, the live view,
        the table and an interrupted run's summary. Goodput and uptime count the work that has
        reached the global model by ``now`` (credits arrive at merges and checkpoints, so
        during a run they trail the work; the closing row has every credit)."""
        return {
            "virtual_time_s": round(now, 6),
            "tokens": tokens,
            "goodput": self.accounting.goodput(now),
            "uptime": self.accounting.uptime(now),
            "bytes_up": self.bytes.total(Direction.UP),
            "bytes_down": self.bytes.total(Direction.DOWN),
        }

    def record(self, *, now: float, tokens: int, model: torch.nn.Module, extra: dict[str, Any]) -> dict[str, Any]:
        """Evaluate the global model and append a metrics row (handed to ``on_row``, then ``progress``)."""
        self._next_eval += 1
        figures = self.figures(now, tokens)
        row = {"virtual_time_s": figures.pop("virtual_time_s"), "tokens": figures.pop("tokens"),
               "eval_loss": self.workload.evaluate(model), **figures, **extra}
        self.rows.append(row)
        if self.on_row:
            self.on_row(row)
        if self.progress:
            self.progress(self.fraction_done(tokens, now), row)
        return row

    def so_far(self, now: float, tokens: int) -> dict[str, Any]:
        """An interrupted run's figures: those at ``now`` and the latest evaluation (with its time)."""
        latest = self.rows[-1] if self.rows else {"eval_loss": None, "virtual_time_s": None}
        return {**self.figures(now, tokens), "eval_loss": latest["eval_loss"],
                "eval_at_s": latest["virtual_time_s"], "done": round(self.fraction_done(tokens, now), 4)}
