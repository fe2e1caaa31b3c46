"""A round's merge, accumulated as contributions arrive (the synchronizer's fast path).

Token-weighted RDA needs only, per contribution, its norm ‖Δ_m‖ and weight w_m: the round
keeps Σ w_m·Δ_m/‖Δ_m‖ (a float32 vector), Σ w_m‖Δ_m‖ and Σ w_m, so closing it costs one
pass over the fragment instead of one per contribution. The plain weighted mean keeps
Σ w_m·Δ_m and Σ w_m. A contribution is checked (finite, norm bound) and added in one pass
over its payload when it arrives; only its compressed payload is kept, so that a newer one
from the same learner can take its place (subtract, add). int4 payloads go through compiled
loops (``core/kernels.py``); other codecs are decoded and added with torch.

The pure float64 references (``merge.merge_rda``, ``merge.merge_mean``) stay for the tests:
this path matches them within float32 rounding (``tests/core/test_accumulate.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, NamedTuple

import numpy as np
import torch

from ddiloco.core.codecs import AbsmaxCodec, Codec
from ddiloco.core.kernels import int4_axpy, int4_stats, norm_squared
from ddiloco.core.messages import RejectReason, Rejected

EPS = 1e-12


@dataclass(frozen=True, slots=True)
class _Entry:
    payload: bytes
    weight: float
    norm: float


class Accumulated(NamedTuple):
    """A round's sum, ready for the outer step."""

    acc: np.ndarray
    """The float32 accumulator (Σ w_m·Δ_m/‖Δ_m‖ for RDA, Σ w_m·Δ_m for the mean)."""
    factor: float
    """What turns ``acc`` into the merged Δ."""
    coherence: float
    """‖Σ w_m·x_m‖ / Σ w_m·‖x_m‖ over the summed vectors x_m (unit directions for RDA, the Δ_m
    for the mean): 1 when the learners' outer gradients point the same way, about 1/√M when
    they are orthogonal. For the mean rule it is also the merged Δ's norm over the learners'
    weighted mean norm, the shrinkage RDA exists to undo (RDA's ratio is 1 by construction)."""


class RoundAccumulator:
    """Σ of one round's contributions to one fragment, by key (a learner's session)."""

    def __init__(self, numel: int, codec: Codec, *, rda: bool) -> None:
        self.numel = numel
        self.codec = codec
        self.rda = rda
        self._fast = isinstance(codec, AbsmaxCodec) and codec.bits == 4 and codec.block_size % 2 == 0
        # Allocated once and zeroed in place between rounds: a fresh buffer per round would
        # cost a page fault per 4 KiB, more than the merge itself on a large fragment.
        self._acc = np.zeros(numel, dtype=np.float32)
        self._touched = False
        self._entries: dict[Hashable, _Entry] = {}
        self._sum_w = 0.0
        self._sum_w_norm = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    # ---- one contribution ----------------------------------------------------------------

    def measure(self, payload: bytes, norm_bound: float) -> float:
        """‖Δ‖ of a payload, or :class:`Rejected` (``non_finite``, ``norm_bound``); changes nothing."""
        if self._fast:
            scales, packed = self._split(payload)
            square, bad = int4_stats(scales, packed, self.numel, self.codec.block_size)  # type: ignore[attr-defined]
            finite = bad == 0
            norm = math.sqrt(square) if finite else math.inf
        else:
            delta = self.codec.decode(payload, self.numel)
            finite = bool(torch.isfinite(delta).all())
            norm = float(torch.linalg.vector_norm(delta.double())) if finite else math.inf
        if not finite:
            raise Rejected(RejectReason.NON_FINITE, "NaN or Inf in the outer gradient")
        if norm > norm_bound:
            raise Rejected(RejectReason.NORM_BOUND, f"outer-gradient norm {norm:.3g} exceeds bound {norm_bound:.3g}")
        return norm

    def add(self, key: Hashable, payload: bytes, weight: float, norm: float) -> None:
        """Count a (measured) contribution; one with the same key is replaced by it."""
        if key in self._entries:
            self.discard(key)
        self._axpy(payload, norm, weight)
        self._entries[key] = _Entry(payload, weight, norm)
        self._sum_w += weight
        self._sum_w_norm += weight * norm

    def cap_weights(self, max_ratio: float) -> int:
        """No entry weighs more than ``max_ratio`` times the lower-median weight; returns how many
        were capped. Applied at the close, when every weight of the round is known."""
        if not max_ratio or len(self._entries) < 2:
            return 0
        weights = sorted(e.weight for e in self._entries.values())
        cap = max_ratio * weights[(len(weights) - 1) // 2]
        capped = 0
        for key, entry in list(self._entries.items()):
            if entry.weight > cap:
                self._axpy(entry.payload, entry.norm, cap - entry.weight)
                self._sum_w += cap - entry.weight
                self._sum_w_norm += (cap - entry.weight) * entry.norm
                self._entries[key] = _Entry(entry.payload, cap, entry.norm)
                capped += 1
        return capped

    def discard(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        self._axpy(entry.payload, entry.norm, -entry.weight)
        self._sum_w -= entry.weight
        self._sum_w_norm -= entry.weight * entry.norm

    def _axpy(self, payload: bytes, norm: float, weight: float) -> None:
        if self.rda and norm <= EPS:
            return  # no direction; it still counts in the magnitude
        alpha = weight / norm if self.rda else weight
        self._touched = True
        if self._fast:
            scales, packed = self._split(payload)
            int4_axpy(scales, packed, self.numel, self.codec.block_size, alpha, self._acc)  # type: ignore[attr-defined]
        else:
            torch.from_numpy(self._acc).add_(self.codec.decode(payload, self.numel), alpha=alpha)

    def _split(self, payload: bytes) -> tuple[np.ndarray, np.ndarray]:
        blocks = -(-self.numel // self.codec.block_size)  # type: ignore[attr-defined]
        return (np.frombuffer(payload, dtype="<f4", count=blocks),
                np.frombuffer(payload, dtype=np.uint8, offset=4 * blocks))

    # ---- the round's close -----------------------------------------------------------------

    def accumulated(self) -> Accumulated:
        """The sum, its factor (Σw‖Δ‖ / ‖acc‖ for RDA, 1 / Σw for the mean) and its coherence.

        The factor is 0 when the directions cancel or nothing has weight.
        """
        acc = self._acc
        if not self._entries or self._sum_w <= 0:
            return Accumulated(acc, 0.0, 0.0)
        summed_norms = self._sum_w if self.rda else self._sum_w_norm  # Σ w_m‖x_m‖
        length = math.sqrt(norm_squared(acc))
        coherence = length / summed_norms if summed_norms > EPS else 0.0
        if not self.rda:
            return Accumulated(acc, 1.0 / self._sum_w, coherence)
        if length / self._sum_w <= EPS:
            return Accumulated(acc, 0.0, coherence)
        return Accumulated(acc, (self._sum_w_norm / self._sum_w) / length, coherence)

    def merged(self) -> torch.Tensor:
        acc, factor, _ = self.accumulated()
        return torch.from_numpy(acc * np.float32(factor))

    def clear(self, *, zeroed: bool = False) -> None:
        """Forget the round; ``zeroed``: the caller has already zeroed the accumulator (the fused close does)."""
        if self._touched and not zeroed:
            self._acc.fill(0.0)
        self._touched = False
        self._entries.clear()
        self._sum_w = self._sum_w_norm = 0.0
