"""Real inner training: one model, one AdamW, one data stream.

Every driver trains through this class — a virtual-cluster learner, a learner process and
the data-parallel baselines — so the compute they compare is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.workload.model import ByteTransformer, ModelConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSettings:
    lr: float
    warmup_steps: int
    weight_decay: float


class InnerTrainer:
    """AdamW on a :class:`ByteTransformer`, with linear warm-up then a constant learning rate.

    Constant after warm-up because learners join, leave and rejoin at unknown times: a
    schedule tied to a total step count would mean something different for each of them.
    """

    def __init__(self, model: nn.Module, settings: OptimizerSettings) -> None:
        self.model = model
        self.settings = settings
        self.steps = 0
        self.optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=self.settings.lr,
            betas=(0.9, 0.95),
            weight_decay=self.settings.weight_decay,
        )

    def reset_optimizer(self) -> None:
        """A restarted learner starts with fresh optimizer state (and a new warm-up)."""
        self.optimizer = self._new_optimizer()
        self.steps = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step on batch (x, y); returns the training loss."""
        self.steps += 1
        warmup = self.settings.warmup_steps
        scale = min(1.0, self.steps / warmup) if warmup else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.settings.lr * scale
        self.model.train()
        device = next(self.model.parameters()).device
        loss = self.model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(loss.detach())


def build_model(config: ModelConfig, seed: int) -> ByteTransformer:
    """The initial model every learner and the synchronizer start from, for ``seed``."""
    torch.manual_seed(seed)
    return ByteTransformer(config)
