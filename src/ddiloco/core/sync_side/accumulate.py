"""A round's merge: contributions checked as they arrive, summed once at the close.

Every merge rule (:mod:`ddiloco.core.sync_side.merge`) is a scaled sum: the round adds
Σ scale(w_m, ‖Δ_m‖)·Δ_m into one float32 vector and multiplies it by the rule's factor. A
contribution is checked (finite, norm bound) in one pass over its payload when it arrives,
and only its compressed payload, weight and norm are kept until the close. Summing there
rather than on arrival is what keeps the synchronizer small: an open round holds its
payloads (int4: 0.53 bytes per parameter each) instead of a float32 accumulator (4) plus the
payloads, which it would still need so that a newer contribution from the same learner can
take the older one's place and a weight capped at the close can be corrected. The close
borrows one float32 buffer, shared by every fragment (:class:`BufferPool`), and adds the
payloads in the order they came (the arithmetic the arrivals used to do; summing a cache-sized
chunk at a time measured no faster: the int4 loops, not memory, set the pace). int4 payloads
go through compiled loops (``core/shared/kernels.py``); other codecs are decoded and added with torch.

This path matches each rule's float64 reference within float32 rounding
(``tests/core/test_accumulate.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, NamedTuple

import numpy as np
import torch

from ddiloco.core.shared.codecs import Codec, fused_int4, int4_parts
from ddiloco.core.shared.kernels import int4_axpy, int4_stats, norm_squared
from ddiloco.core.shared.messages import Rejected, RejectReason
from ddiloco.core.sync_side.merge import MergeRule, Summand


@dataclass(frozen=True, slots=True)
class _Entry:
    payload: bytes
    weight: float
    norm: float
    """Of the Δ as summed: the payload's norm times :attr:`clip`."""
    clip: float = 1.0
    """What the payload's Δ and its weight are scaled by at the close (below 1: a norm above the bound)."""


class Accumulated(NamedTuple):
    """A round's sum, ready for the outer step."""

    acc: np.ndarray
    """The float32 accumulator, Σ scale(w_m, ‖Δ_m‖)·Δ_m."""
    factor: float
    """What turns ``acc`` into the merged Δ."""
    coherence: float
    """How aligned the summed vectors were (:meth:`~ddiloco.core.sync_side.merge.MergeRule.coherence`)."""


class BufferPool:
    """The zeroed float32 buffer a round's close sums into, lent to one close at a time.

    The synchronizer closes one round at a time, so one buffer as large as its largest fragment
    serves every fragment (a view of its first ``numel`` values); a second is made only while
    the first is lent. The buffer is kept between closes rather than freed: a fresh one per
    round would cost a page fault per 4 KiB, more than the merge itself on a large fragment."""

    def __init__(self) -> None:
        self._free: np.ndarray | None = None

    def take(self, numel: int) -> np.ndarray:
        free = self._free
        if free is not None and free.shape[0] >= numel:
            self._free = None
            return free[:numel]
        return np.zeros(numel, dtype=np.float32)

    def give(self, buffer: np.ndarray) -> None:
        """Take back a zeroed buffer (or a view of one); the largest is kept."""
        whole = buffer if buffer.base is None else buffer.base
        if self._free is None or whole.shape[0] > self._free.shape[0]:
            self._free = whole


class RoundAccumulator:
    """One round's contributions to one fragment, by key (a learner's session), summed at the close."""

    def __init__(self, numel: int, codec: Codec, rule: MergeRule, pool: BufferPool | None = None) -> None:
        self.numel = numel
        self.codec = codec
        self.rule = rule
        self._fast = fused_int4(codec)
        self._pool = pool or BufferPool()
        self._acc: np.ndarray | None = None
        """Borrowed from the pool by :meth:`accumulated`, given back by :meth:`clear`."""
        self._entries: dict[Hashable, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    # ---- one contribution ----------------------------------------------------------------

    def measure(self, payload: bytes) -> float:
        """‖Δ‖ of a payload, or :class:`Rejected` (``non_finite``); changes nothing. Whether the
        norm is acceptable is the fragment's :class:`~ddiloco.core.sync_side.norm_bound.NormBound`'s to say."""
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
        return norm

    def add(self, key: Hashable, payload: bytes, weight: float, norm: float, clip: float = 1.0) -> None:
        """Count a (measured) contribution, its Δ and (after :meth:`cap_weights`) its weight scaled by
        ``clip`` (the norm bound's, ``core/sync_side/norm_bound.py``); one with the same key is replaced by it."""
        self._entries[key] = _Entry(payload, weight, norm * clip, clip)

    def discard(self, key: Hashable) -> None:
        del self._entries[key]

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
                self._entries[key] = _Entry(entry.payload, cap, entry.norm, entry.clip)
                capped += 1
        return capped

    def _parts(self, payload: bytes) -> tuple[np.ndarray, np.ndarray]:
        return int4_parts(payload, self.numel, self.codec.block_size)  # type: ignore[attr-defined]

    # ---- the round's close -----------------------------------------------------------------

    def accumulated(self) -> Accumulated:
        """The sum, the rule's factor and coherence (factor 0: nothing with weight, or directions
        that cancel). The sum lives in a borrowed buffer until :meth:`clear`."""
        if self._acc is None:
            self._acc = self._pool.take(self.numel)
        else:  # asked again: sum afresh (an entry may have changed since)
            self._acc.fill(0.0)
        summands = [Summand(e.weight * e.clip, e.norm) for e in self._entries.values()]
        if not summands or sum(s.weight for s in summands) <= 0:
            return Accumulated(self._acc, 0.0, 0.0)
        length = math.sqrt(self._sum())
        return Accumulated(self._acc, self.rule.factor(summands, length), self.rule.coherence(summands, length))

    def _sum(self) -> float:
        """Σ scale(w, ‖Δ‖)·Δ into the buffer, in the order the contributions came; returns its ‖·‖²."""
        assert self._acc is not None
        for entry in self._entries.values():
            alpha = self.rule.scale(entry.weight * entry.clip, entry.norm) * entry.clip
            if alpha == 0.0:
                continue
            if self._fast:
                int4_axpy(*self._parts(entry.payload), self.numel, self.codec.block_size, alpha, self._acc)  # type: ignore[attr-defined]
            else:
                torch.from_numpy(self._acc).add_(self.codec.decode(entry.payload, self.numel), alpha=alpha)
        return norm_squared(self._acc)

    def clear(self, *, zeroed: bool = False) -> None:
        """Forget the round and give the buffer back; ``zeroed``: the caller has already zeroed it
        (the fused close does)."""
        if self._acc is not None:
            if not zeroed:
                self._acc.fill(0.0)
            self._pool.give(self._acc)
            self._acc = None
        self._entries.clear()
