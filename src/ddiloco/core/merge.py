"""Merge the learners' outer gradients of one fragment into one (DESIGN.md section 2, 3-4).

Learners' outer gradients are close to orthogonal, so their plain mean has a norm about
1/sqrt(M) of theirs: the outer step would shrink as learners are added and the outer
learning rate would need retuning with M. Radial-directional averaging (RDA) averages
magnitudes and directions separately, so the merged step keeps the learners' typical norm.
Sums run in float64; results are float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MERGE_RULES = ("rda", "mean")


def token_weights(tokens: Sequence[int], steps: Sequence[int]) -> Tensor:
    """Normalized float64 weights w_m ∝ tokens_m * (tokens_m / steps_m).

    Quantity times efficiency (tokens per step): a learner that did more useful work since
    its last contribution counts more, and a late one still counts for what it did.
    """
    if len(tokens) != len(steps) or not tokens:
        raise ValueError(f"need as many tokens as steps, at least one: {tokens=} {steps=}")
    if any(s <= 0 for s in steps):
        raise ValueError(f"steps must be positive, got {list(steps)}")
    if any(t < 0 for t in tokens):
        raise ValueError(f"tokens must be non-negative, got {list(tokens)}")
    t = torch.tensor(tokens, dtype=torch.float64)
    w = t * (t / torch.tensor(steps, dtype=torch.float64))
    total = w.sum()
    if not total > 0:
        raise ValueError(f"no contribution has positive weight: {tokens=} {steps=}")
    return w / total


def _check(deltas: Sequence[Tensor], weights: Tensor) -> None:
    if not deltas:
        raise ValueError("nothing to merge: no deltas")
    if weights.shape != (len(deltas),):
        raise ValueError(f"{len(deltas)} deltas but weights of shape {tuple(weights.shape)}")
    shapes = {tuple(d.shape) for d in deltas}
    if len(shapes) != 1:
        raise ValueError(f"deltas of different shapes: {sorted(shapes)}")


def merge_mean(deltas: Sequence[Tensor], weights: Tensor) -> Tensor:
    """Weighted mean Σ w_m Δ_m: used for the embedding fragment and for ablations."""
    _check(deltas, weights)
    acc = torch.zeros(deltas[0].shape, dtype=torch.float64)
    for delta, w in zip(deltas, weights.tolist()):
        acc.add_(delta.detach().to(torch.float64), alpha=w)
    return acc.to(torch.float32)


def merge_rda(deltas: Sequence[Tensor], weights: Tensor, *, eps: float = 1e-12) -> Tensor:
    """Radial-directional average: (Σ w_m ‖Δ_m‖) · normalize(Σ w_m Δ_m / ‖Δ_m‖).

    Norms are L2 norms of the whole fragment vector (per fragment, not per tensor): the
    fragment is the unit that travels and is merged, and one norm per fragment keeps the
    relative scale of its tensors as the learners produced it. Deltas with norm <= eps
    carry no direction; if the directions cancel (weighted sum of unit vectors, a vector of
    norm <= 1, has norm <= eps) the result is zeros.
    """
    _check(deltas, weights)
    magnitude = 0.0
    direction = torch.zeros(deltas[0].shape, dtype=torch.float64)
    for delta, w in zip(deltas, weights.tolist()):
        d = delta.detach().to(torch.float64)
        norm = float(torch.linalg.vector_norm(d))
        magnitude += w * norm
        if norm > eps:
            direction.add_(d, alpha=w / norm)
    direction_norm = float(torch.linalg.vector_norm(direction))
    if direction_norm <= eps:
        return torch.zeros(deltas[0].shape, dtype=torch.float32)
    return direction.mul_(magnitude / direction_norm).to(torch.float32)
