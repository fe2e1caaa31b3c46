"""A round's merge, accumulated as contributions arrive (the synchronizer's fast path).

Every merge rule (:mod:`ddiloco.core.merge`) is a scaled sum: the round keeps
Σ scale(w_m, ‖Δ_m‖)·Δ_m in one float32 vector and, per contribution, its weight and norm;
closing it costs one pass over the fragment instead of one per contribution. A contribution
is checked (finite, norm bound) and added in one pass over its payload when it arrives;
only its compressed payload is kept, so that a newer one from the same learner can take its
place (subtract, add), and so that a weight capped at the close can be corrected. int4
payloads go through compiled loops (``core/kernels.py``); other codecs are decoded and added
with torch.

This path matches each rule's float64 reference within float32 rounding
(``tests/core/test_accumulate.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, NamedTuple

import numpy as np
import torch

from ddiloco.core.codecs import Codec, fused_int4, int4_parts
from ddiloco.core.kernels import int4_axpy, int4_stats, norm_squared
from ddiloco.core.merge import MergeRule, Summand
from ddiloco.core.messages import RejectReason, Rejected


@dataclass(frozen=True, slots=True)
class _Entry:
    payload: bytes
    weight: float
    norm: float


class Accumulated(NamedTuple):
    """A round's sum, ready for the outer step."""

    acc: np.ndarray
    """The float32 accumulator, Σ scale(w_m, ‖Δ_m‖)·Δ_m."""
    factor: float
    """What turns ``acc`` into the merged Δ."""
    coherence: float
    """How aligned the summed vectors were (:meth:`~ddiloco.core.merge.MergeRule.coherence`)."""


class BufferPool:
    """Zeroed float32 accumulators, lent to open rounds and given back at their close.

    A fragment holds an accumulator only while its round is open, so a synchronizer holds as
    many as it has rounds open at once (not one per fragment: 4 bytes per parameter it need
    not keep). Buffers given back are kept for the next round rather than freed: a fresh
    buffer per round would cost a page fault per 4 KiB, more than the merge itself on a large
    fragment."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}

    def take(self, numel: int) -> np.ndarray:
        free = self._free.get(numel)
        return free.pop() if free else np.zeros(numel, dtype=np.float32)

    def give(self, buffer: np.ndarray) -> None:
        """Take back a zeroed buffer."""
        self._free.setdefault(buffer.shape[0], []).append(buffer)


class RoundAccumulator:
    """Σ of one round's contributions to one fragment, by key (a learner's session)."""

    def __init__(self, numel: int, codec: Codec, rule: MergeRule, pool: BufferPool | None = None) -> None:
        self.numel = numel
        self.codec = codec
        self.rule = rule
        self._fast = fused_int4(codec)
        self._pool = pool or BufferPool()
        self._acc: np.ndarray | None = None
        """Taken from the pool at the round's first contribution, given back at its close."""
        self._entries: dict[Hashable, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    # ---- one contribution ----------------------------------------------------------------

    def measure(self, payload: bytes, norm_bound: float) -> float:
        """‖Δ‖ of a payload, or :class:`Rejected` (``non_finite``, ``norm_bound``); changes nothing."""
        if self._fast:
            square, bad = int4_stats(*self._parts(payload), self.numel, self.codec.block_size)  # type: ignore[attr-defined]
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
        self._axpy(payload, self.rule.scale(weight, norm))
        self._entries[key] = _Entry(payload, weight, norm)

    def discard(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        self._axpy(entry.payload, -self.rule.scale(entry.weight, entry.norm))

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
                self._axpy(entry.payload, self.rule.scale(cap, entry.norm) - self.rule.scale(entry.weight, entry.norm))
                self._entries[key] = _Entry(entry.payload, cap, entry.norm)
                capped += 1
        return capped

    def _axpy(self, payload: bytes, alpha: float) -> None:
        if alpha == 0.0:
            return
        if self._acc is None:
            self._acc = self._pool.take(self.numel)
        if self._fast:
            int4_axpy(*self._parts(payload), self.numel, self.codec.block_size, alpha, self._acc)  # type: ignore[attr-defined]
        else:
            torch.from_numpy(self._acc).add_(self.codec.decode(payload, self.numel), alpha=alpha)

    def _parts(self, payload: bytes) -> tuple[np.ndarray, np.ndarray]:
        return int4_parts(payload, self.numel, self.codec.block_size)  # type: ignore[attr-defined]

    # ---- the round's close -----------------------------------------------------------------

    def accumulated(self) -> Accumulated:
        """The sum, the rule's factor and coherence (factor 0: nothing with weight, or directions that cancel)."""
        if self._acc is None:  # nothing added a vector (zero weights or zero norms)
            self._acc = self._pool.take(self.numel)
        acc = self._acc
        summands = [Summand(e.weight, e.norm) for e in self._entries.values()]
        if not summands or sum(s.weight for s in summands) <= 0:
            return Accumulated(acc, 0.0, 0.0)
        length = math.sqrt(norm_squared(acc))
        return Accumulated(acc, self.rule.factor(summands, length), self.rule.coherence(summands, length))

    def clear(self, *, zeroed: bool = False) -> None:
        """Forget the round and give its accumulator back; ``zeroed``: the caller has already zeroed
        it (the fused close does)."""
        if self._acc is not None:
            if not zeroed:
                self._acc.fill(0.0)
            self._pool.give(self._acc)
            self._acc = None
        self._entries.clear()
