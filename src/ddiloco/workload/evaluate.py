"""Held-out evaluation of a language model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def evaluate(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Mean loss per target byte over ``batches`` of ``(x, y)``, in nats.

    Runs in eval mode under ``torch.no_grad`` (so a mixture-of-experts model reports its
    cross-entropy without the load-balancing term), weighting each batch by its number of
    targets so a smaller last batch counts for what it holds. The train/eval mode of every
    submodule is restored afterwards.
    """
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    total = 0.0
    count = 0
    try:
        with torch.no_grad():
            for x, y in batches:
                total += float(model(x, y)) * y.numel()
                count += y.numel()
    finally:
        for module, training in modes:
            module.training = training
    return total / count
