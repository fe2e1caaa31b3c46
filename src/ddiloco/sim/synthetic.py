"""A synthetic workload for protocol testing: parameters that move by a seeded random walk.

``ddiloco simtest`` runs hundreds of seeds in minutes. The protocol's safety and liveness
do not depend on what a gradient is — only on which messages travel, when, and what the
state machines do with them — so each inner "step" here is a seeded Gaussian nudge of a
few small tensors (microseconds) instead of a transformer step (milliseconds). The
fragments, codecs, merges, outer optimizer and every protocol decision are the real ones;
the real model is exercised by the rest of the suite and by ``ddiloco run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ddiloco.settings.config import Config

SHAPES = {"embed": (32, 4), "w1": (16, 8), "w2": (12, 8), "b1": (16,), "w3": (8, 6)}
TOKENS_SHAPE = (2, 8)
"""A step trains on 16 "tokens": enough for the budget and the token weights to be real."""


class WalkModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g) * 0.1))

    @staticmethod
    def embedding_param_names() -> tuple[str, ...]:
        return ("embed",)


@dataclass(slots=True)
class WalkTrainer:
    """An inner step: every parameter moves by a small seeded Gaussian step, pulled toward 0."""

    model: WalkModel
    generator: torch.Generator

    def step(self, x: torch.Tensor, y: torch.Tensor, progress: float = 0.0) -> float:
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.999).add_(torch.randn(p.shape, generator=self.generator), alpha=0.01)
        return 0.0

    def reset_optimizer(self) -> None:
        """Nothing to reset: the walk has no optimizer state."""


@dataclass(slots=True)
class ConstantSampler:
    batch: tuple[torch.Tensor, torch.Tensor] = field(
        default_factory=lambda: (torch.zeros(TOKENS_SHAPE, dtype=torch.long), torch.zeros(TOKENS_SHAPE, dtype=torch.long)))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch

    def skip_to(self, batch: int) -> None:
        """Every batch is the same one: nothing to skip."""


@dataclass(slots=True)
class SyntheticWorkload:
    """What :class:`~ddiloco.sim.virtual_cluster.VirtualCluster` needs of a workload, at almost no cost."""

    config: Config
    _learner: int = 0

    def new_model(self) -> WalkModel:
        return WalkModel()

    def new_trainer(self, model: nn.Module) -> WalkTrainer:
        self._learner += 1
        seed = (self.config.run.seed * 7919 + self._learner) % 2**64  # any seed up to 2**63 - 1; unchanged below 2**51
        return WalkTrainer(model, torch.Generator().manual_seed(seed))

    def sampler(self, learner: int) -> ConstantSampler:
        return ConstantSampler()

    @property
    def tokens_per_step(self) -> int:
        return TOKENS_SHAPE[0] * TOKENS_SHAPE[1]

    def evaluate(self, model: nn.Module) -> float:
        """Distance of the global parameters from the origin (the walk's attractor)."""
        with torch.no_grad():
            return float(sum(p.square().sum() for p in model.parameters()))
