"""Merge rules: how one round's outer gradients of a fragment become one update
(docs/concepts.md, "Token-weighted merge").

Learners' outer gradients are close to orthogonal, so their plain mean has a norm about
1/sqrt(M) of theirs: the outer step would shrink as learners are added and the outer
learning rate would need retuning with M. Radial-directional averaging (RDA) averages
magnitudes and directions separately, so the merged step keeps the learners' typical norm.

A rule is one object in this file: the synchronizer's accumulator
(:class:`~ddiloco.core.sync_side.accumulate.RoundAccumulator`) adds ``scale(w, ‖Δ‖)·Δ`` of every
contribution at the round's close (on int4 payloads through the compiled kernels, without
decoding) and multiplies the sum by ``factor(...)``; ``reference`` is the rule's
specification in float64, which the accumulator must match (``tests/core/test_accumulate.py``).
To add a rule: subclass :class:`MergeRule` here, name it in :class:`MergeRuleName`, and test
it against its reference; ``protocol.merge`` then accepts its name. A rule that is not a
scaled sum of the contributions (a coordinate-wise median, say) would need an accumulator of
its own.

Token weights live here too: w = tokens · tokens/steps, quantity times efficiency.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ddiloco.core.shared.choices import MergeRuleName

EPS = 1e-12
"""Below this a norm is zero: such a Δ has no direction (RDA still counts it in the magnitude)."""


MERGE_RULES = tuple(name.value for name in MergeRuleName)
"""Every rule's name, the one list: ``protocol.merge`` accepts these and ``ddiloco simtest`` draws them."""


def token_weight(tokens: int, steps: int) -> float:
    """w = tokens · tokens/steps: quantity times efficiency (tokens per step). A learner that did
    more useful work since its last contribution counts more, and a late one still counts for
    what it did."""
    return tokens * (tokens / steps)


def token_weights(tokens: Sequence[int], steps: Sequence[int]) -> Tensor:
    """Normalized float64 :func:`token_weight` of several contributions (the references' input)."""
    if len(tokens) != len(steps) or not tokens:
        raise ValueError(f"need as many tokens as steps, at least one: {tokens=} {steps=}")
    if any(s <= 0 for s in steps):
        raise ValueError(f"steps must be positive, got {list(steps)}")
    if any(t < 0 for t in tokens):
        raise ValueError(f"tokens must be non-negative, got {list(tokens)}")
    w = torch.tensor([token_weight(t, s) for t, s in zip(tokens, steps)], dtype=torch.float64)
    total = w.sum()
    if not total > 0:
        raise ValueError(f"no contribution has positive weight: {tokens=} {steps=}")
    return w / total


@dataclass(frozen=True, slots=True)
class Summand:
    """One contribution as the rule sees it at the close: its weight and the norm of its Δ."""

    weight: float
    norm: float


class MergeRule(ABC):
    """How a round's contributions to one fragment become its merged Δ."""

    name: ClassVar[MergeRuleName]

    @abstractmethod
    def scale(self, weight: float, norm: float) -> float:
        """α_m: the round sums Σ α_m·Δ_m at its close (0: this one adds no vector)."""

    @abstractmethod
    def factor(self, summands: Sequence[Summand], length: float) -> float:
        """What turns the accumulated vector, of norm ``length``, into the merged Δ (0: no step)."""

    @abstractmethod
    def coherence(self, summands: Sequence[Summand], length: float) -> float:
        """‖Σ w_m·x_m‖ / Σ w_m·‖x_m‖ over the vectors x_m this rule sums: 1 when the learners'
        outer gradients agree, about 1/√M when they are orthogonal."""

    @abstractmethod
    def reference(self, deltas: Sequence[Tensor], weights: Tensor) -> Tensor:
        """The rule's specification in float64 (normalized ``weights``); the result is float32."""


class Mean(MergeRule):
    """Σ w_m Δ_m / Σ w_m."""

    name = MergeRuleName.MEAN

    def scale(self, weight: float, norm: float) -> float:
        return weight

    def factor(self, summands: Sequence[Summand], length: float) -> float:
        total = sum(s.weight for s in summands)
        return 1.0 / total if total > 0 else 0.0

    def coherence(self, summands: Sequence[Summand], length: float) -> float:
        # Also the merged Δ's norm over the learners' weighted mean norm: the shrinkage RDA undoes.
        summed = sum(s.weight * s.norm for s in summands)
        return length / summed if summed > EPS else 0.0

    def reference(self, deltas: Sequence[Tensor], weights: Tensor) -> Tensor:
        _check(deltas, weights)
        acc = torch.zeros(deltas[0].shape, dtype=torch.float64)
        for delta, w in zip(deltas, weights.tolist()):
            acc.add_(delta.detach().to(torch.float64), alpha=w)
        return acc.to(torch.float32)


class RadialDirectional(MergeRule):
    """(Σ w_m ‖Δ_m‖ / Σ w_m) · normalize(Σ w_m Δ_m / ‖Δ_m‖).

    Norms are L2 norms of the whole fragment vector (per fragment, not per tensor): the
    fragment is the unit that travels and is merged, and one norm per fragment keeps the
    relative scale of its tensors as the learners produced it. A Δ of norm <= EPS carries no
    direction; if the directions cancel (the weighted sum of unit vectors has norm <= EPS)
    there is no step.
    """

    name = MergeRuleName.RDA

    def scale(self, weight: float, norm: float) -> float:
        return weight / norm if norm > EPS else 0.0

    def magnitude(self, summands: Sequence[Summand]) -> float:
        """The merged step's norm: the weighted mean of the learners' norms."""
        return sum(s.weight * s.norm for s in summands) / sum(s.weight for s in summands)

    def factor(self, summands: Sequence[Summand], length: float) -> float:
        total = sum(s.weight for s in summands)
        if total <= 0 or length / total <= EPS:
            return 0.0
        return self.magnitude(summands) / length

    def coherence(self, summands: Sequence[Summand], length: float) -> float:
        summed = sum(s.weight for s in summands)  # Σ w_m ‖x_m‖ over unit vectors x_m
        return length / summed if summed > EPS else 0.0

    def reference(self, deltas: Sequence[Tensor], weights: Tensor) -> Tensor:
        _check(deltas, weights)
        direction = torch.zeros(deltas[0].shape, dtype=torch.float64)
        summands = []
        for delta, w in zip(deltas, weights.tolist()):
            d = delta.detach().to(torch.float64)
            norm = float(torch.linalg.vector_norm(d))
            summands.append(Summand(w, norm))
            if norm > EPS:
                direction.add_(d, alpha=w / norm)
        direction_norm = float(torch.linalg.vector_norm(direction))
        if direction_norm <= EPS:
            return torch.zeros(deltas[0].shape, dtype=torch.float32)
        return direction.mul_(self.magnitude(summands) / direction_norm).to(torch.float32)


class RadialDirectionalMedian(RadialDirectional):
    """RDA with the weighted median of the norms as the magnitude (the lower one on a tie)."""

    name = MergeRuleName.RDA_MEDIAN

    def magnitude(self, summands: Sequence[Summand]) -> float:
        ordered = sorted(summands, key=lambda s: s.norm)
        half = sum(s.weight for s in ordered) / 2
        running = 0.0
        for s in ordered:
            running += s.weight
            if running >= half - EPS * half:
                return s.norm
        return ordered[-1].norm


_RULES: dict[MergeRuleName, MergeRule] = {rule.name: rule for rule in (Mean(), RadialDirectional(),
                                                                        RadialDirectionalMedian())}


def merge_rule(name: str) -> MergeRule:
    """The rule named ``name`` (ValueError for an unknown one; the configuration says which exist)."""
    return _RULES[MergeRuleName(name)]


def _check(deltas: Sequence[Tensor], weights: Tensor) -> None:
    if not deltas:
        raise ValueError("nothing to merge: no deltas")
    if weights.shape != (len(deltas),):
        raise ValueError(f"{len(deltas)} deltas but weights of shape {tuple(weights.shape)}")
    shapes = {tuple(d.shape) for d in deltas}
    if len(shapes) != 1:
        raise ValueError(f"deltas of different shapes: {sorted(shapes)}")
