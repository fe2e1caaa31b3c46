"""What every mode of a virtual run shares: workload, failure trace, speeds, budget, metrics.

Decoupled DiLoCo and its baselines are compared on the same corpus shards, the same initial
weights, the same step-time draws and the same failures; this module builds those once
from a :class:`~ddiloco.config.Config` and records what a run measures.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddiloco.config import Config
from ddiloco.sim.accounting import Accounting
from ddiloco.sim.faults import FailureTrace
from ddiloco.sim.network import ByteCounter
from ddiloco.sim.speed import StepTimer
from ddiloco.workload.corpus import BatchSampler, Corpus, eval_batches, load_corpus, split_corpus
from ddiloco.workload.evaluate import evaluate
from ddiloco.workload.model import ByteTransformer
from ddiloco.workload.trainer import InnerTrainer, OptimizerSettings, build_model

ProgressFn = Callable[[float, dict[str, Any]], None]
"""Called with the run's progress in [0, 1] and the latest metrics row."""


@dataclass(slots=True)
class Workload:
    """Corpus shards, evaluation batches and the initial weights every learner starts from."""

    config: Config
    corpus: Corpus
    eval_set: list[tuple[torch.Tensor, torch.Tensor]]
    initial_state: dict[str, torch.Tensor]

    @classmethod
    def build(cls, config: Config) -> "Workload":
        data = load_corpus(config.train.corpus or None, max_bytes=config.train.corpus_max_bytes)
        corpus = split_corpus(data, num_shards=config.run.learners, seq_len=config.model.seq_len)
        batches = eval_batches(
            corpus.eval_data,
            batch_size=config.train.batch_size,
            seq_len=config.model.seq_len,
            max_batches=config.train.eval_batches,
        )
        model = build_model(config.model, config.run.seed)
        return cls(config, corpus, batches, {k: v.clone() for k, v in model.state_dict().items()})

    def new_model(self) -> ByteTransformer:
        model = ByteTransformer(self.config.model)
        model.load_state_dict(self.initial_state)
        return model

    def new_trainer(self, model: torch.nn.Module) -> InnerTrainer:
        t = self.config.train
        return InnerTrainer(model, OptimizerSettings(lr=t.lr, warmup_steps=t.warmup_steps, weight_decay=t.weight_decay))

    def sampler(self, learner: int) -> BatchSampler:
        return BatchSampler(
            self.corpus.train_shards[learner],
            batch_size=self.config.train.batch_size,
            seq_len=self.config.model.seq_len,
            seed=self.config.run.seed * 1_000_003 + learner,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.config.train.batch_size * self.config.model.seq_len

    def evaluate(self, model: torch.nn.Module) -> float:
        return evaluate(model, self.eval_set)


@dataclass(slots=True)
class Recorder:
    """Budget, evaluation schedule, metrics rows and the progress callback of one run."""

    config: Config
    workload: Workload
    progress: ProgressFn | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    accounting: Accounting = field(init=False)
    bytes: ByteCounter = field(default_factory=ByteCounter)
    trace: FailureTrace = field(init=False)
    timer: StepTimer = field(init=False)
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
            "bytes_up": self.bytes.total("up"),
            "bytes_down": self.bytes.total("down"),
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


def weights_sha256(model: torch.nn.Module) -> str:
    """Hash of the global weights, in state-dict order: equal runs give equal hashes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
