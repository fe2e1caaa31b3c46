"""Real inner training: one model, one AdamW, one data stream.

Every driver trains through this class — a virtual-cluster learner, a learner process and
the data-parallel baselines — so the compute they compare is the same code.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.settings.workload_settings import LrSchedule, ModelConfig, Precision
from ddiloco.workload.model import ByteTransformer


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSettings:
    lr: float
    warmup_steps: int
    weight_decay: float
    schedule: LrSchedule = LrSchedule.CONSTANT
    lr_min_ratio: float = 0.1
    """Where a decaying schedule ends, as a share of ``lr``."""
    precision: Precision = Precision.FP32


def decay_factor(schedule: LrSchedule, progress: float, lr_min_ratio: float) -> float:
    """The schedule's share of the peak rate at ``progress`` (the run's fraction done, 0..1)."""
    p = min(1.0, max(0.0, progress))
    if schedule is LrSchedule.CONSTANT:
        return 1.0
    shape = 0.5 * (1.0 + math.cos(math.pi * p)) if schedule is LrSchedule.COSINE else 1.0 - p
    return lr_min_ratio + (1.0 - lr_min_ratio) * shape


class InnerTrainer:
    """AdamW on a :class:`ByteTransformer`: a linear warm-up, then the run's schedule.

    The warm-up counts this trainer's own steps (a restarted learner has fresh AdamW state
    and warms up again). A decaying schedule is indexed by the *run's* progress, which the
    driver passes to :meth:`step` — the tokens (or virtual time) of all learners together
    against the budget — not by the learner's own step count: learners join, leave and
    rejoin at unknown times, and one that joins late takes the rate the run has reached
    instead of starting the schedule again from its peak.
    """

    def __init__(self, model: nn.Module, settings: OptimizerSettings) -> None:
        self.model = model
        self.settings = settings
        self.steps = 0
        self.optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.AdamW:
        on_gpu = next(self.model.parameters()).device.type == "cuda"
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=self.settings.lr,
            betas=(0.9, 0.95),
            weight_decay=self.settings.weight_decay,
            fused=True if on_gpu else None,  # one kernel for the whole update on a GPU
        )

    def reset_optimizer(self) -> None:
        """A restarted learner starts with fresh optimizer state (and a new warm-up)."""
        self.optimizer = self._new_optimizer()
        self.steps = 0

    def lr_at(self, progress: float) -> float:
        """The rate of the next step, at the run's ``progress`` (0..1)."""
        s = self.settings
        warm = min(1.0, (self.steps + 1) / s.warmup_steps) if s.warmup_steps else 1.0
        return s.lr * warm * decay_factor(s.schedule, progress, s.lr_min_ratio)

    def step(self, x: torch.Tensor, y: torch.Tensor, progress: float = 0.0) -> torch.Tensor:
        """One inner step on batch (x, y) at the run's ``progress``; returns the training loss.

        The loss is a detached 0-d tensor on the model's device: reading it (``float(loss)``)
        waits for the step to finish, so a loop that looks at it only now and then never
        stalls an accelerator at every step.
        """
        lr = self.lr_at(progress)
        self.steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        device = next(self.model.parameters()).device
        if device.type == "cuda":  # from pinned memory the copies do not wait for the GPU
            x, y = x.pin_memory(), y.pin_memory()
        bf16 = self.settings.precision is Precision.BF16
        with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = self.model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss.detach()


def build_model(config: ModelConfig, seed: int) -> ByteTransformer:
    """The initial model every learner and the synchronizer start from, for ``seed``."""
    torch.manual_seed(seed)
    return ByteTransformer(config)
