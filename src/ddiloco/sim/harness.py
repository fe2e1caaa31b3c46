"""What every mode of a virtual run shares: failure trace, speeds, evaluation schedule, metrics.

Decoupled DiLoCo and its baselines are compared on the same workload
(:class:`~ddiloco.workload.workload.Workload`), the same step-time draws and the same
failures; this module builds those once from a :class:`~ddiloco.config.Config` and records
what a run measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.config import Config
from ddiloco.reporting import ProgressFn
from ddiloco.sim.accounting import Accounting
from ddiloco.sim.faults import FailureTrace
from ddiloco.measures import ByteLedger, Direction
from ddiloco.sim.speed import StepTimer
from ddiloco.workload.workload import Workload


@dataclass(slots=True)
class Recorder:
    """Budget, evaluation schedule, metrics rows and the progress callback of one run."""

    config: Config
    workload: Workload
    progress: ProgressFn | None = None
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
        self.accounting = Accounting(c.run.learners)
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
        return self.fraction_done(tokens, now) >= self._next_eval / self.config.train.evals

    def record(self, *, now: float, tokens: int, model: torch.nn.Module, extra: dict[str, Any]) -> dict[str, Any]:
        """Evaluate the global model and append a metrics row."""
        self._next_eval += 1
        row = {
            "virtual_time_s": round(now, 6),
            "tokens": tokens,
            "eval_loss": self.workload.evaluate(model),
            "goodput": self.accounting.goodput(now),
            "uptime": self.accounting.uptime(now),
            "bytes_up": self.bytes.total(Direction.UP),
            "bytes_down": self.bytes.total(Direction.DOWN),
            **extra,
        }
        self.rows.append(row)
        if self.progress:
            self.progress(self.fraction_done(tokens, now), row)
        return row


    def settle(self) -> None:
        """After the run: restate every row's goodput and uptime with the final credits.

        During a run, work is credited only when it reaches the model (a merge, a
        checkpoint), so the live figures lag; the rows written to disk say how much of the
        work done up to each point ended up in the model.
        """
        for row in self.rows:
            row["goodput"] = self.accounting.goodput(row["virtual_time_s"])
            row["uptime"] = self.accounting.uptime(row["virtual_time_s"])
