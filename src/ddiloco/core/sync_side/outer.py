"""The synchronizer's outer optimizer (docs/concepts.md, "Outer optimizer")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from ddiloco.core.shared.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class NesterovSGD:
    """Outer optimizer: SGD with Nesterov momentum applied to the outer gradient Δ.

    DiLoCo (Douillard et al., arXiv 2311.08455) uses lr 0.7, momentum 0.9. The math is that
    of ``torch.optim.SGD(nesterov=True, dampening=0)`` fed grad = Δ, written as a pure
    function so the momentum buffer is state the synchronizer owns (and checkpoints) per
    fragment. Δ = anchor − local is a gradient, so the update u = −lr·(…) moves Θ from the
    anchor toward the learners.
    """

    lr: float
    """Outer learning rate (> 0)."""
    momentum: float
    """Nesterov momentum μ in [0, 1); 0 is plain SGD."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"outer lr must be a positive number, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer momentum must be in [0, 1), got {self.momentum}")

    def update(self, delta: Tensor, buffer: Tensor | None) -> tuple[Tensor, Tensor]:
        """Return (u, new_buffer) with Θ_new = Θ + u; pass buffer None on the first step.

        buf = μ·buf + Δ (buf = Δ at first), u = −lr·(Δ + μ·buf). Inputs are not modified.
        """
        if buffer is None:
            new_buffer = delta.detach().clone()
        elif buffer.shape != delta.shape:
            raise ValueError(f"buffer shape {tuple(buffer.shape)} != delta {tuple(delta.shape)}")
        else:
            # Same operation order as torch.optim.SGD, so results match it bit for bit.
            new_buffer = buffer.mul(self.momentum).add_(delta)
        step = delta.add(new_buffer, alpha=self.momentum)
        return step.mul_(-self.lr), new_buffer
