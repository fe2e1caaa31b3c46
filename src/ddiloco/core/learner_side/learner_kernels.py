"""Compiled loops for the learner's int4 hot path on the training thread (numba).

A learner touches a fragment twice per period between two inner steps: when the fragment
falls due (Δ = anchor − θ, to be sent) and when an update arrives (anchor ← anchor + u,
θ ← α·θ + (1−α)·anchor). With the fragment's parameters laid out as one flat buffer
(``core/learner_side/flat.py``) each is a single pass here, straight from and to the int4 wire layout
(``core/shared/codecs.py``: one float32 scale per block, then codes packed two per byte, low nibble
first; a value is ``(code − 7) · scale``):

- ``delta_int4``: reads anchor and θ once and writes the payload (0.53 B per parameter) —
  no Δ tensor, none of the codec's temporaries, nothing for the sender thread to compute;
- ``apply_int4``: reads the payload, anchor and θ once, writes anchor and θ — no decoded
  tensor, no flatten/unflatten copies.

Both release the GIL (``nogil``): the link's threads serve the network meanwhile, and on a
training loop that runs Python between kernels they do not take the GIL away from it.

Bit for bit what the torch path computes (``AbsmaxCodec`` followed by the core's torch ops):
the same float32 operations in the same order — a true division by 7 and by the scale,
rounding to nearest with ties to even, ``(code − 7) · scale`` then one addition. The α-mix is
``θ·α + anchor·(1−α)`` rounded after each operation; torch's vectorized ``add_(alpha=)``
may fuse the second product into its addition, which changes nothing when ``anchor·(1−α)``
is exact (α ∈ {0, ½, 1}, the default ½ included) and at most the last bit otherwise.

Specialized like ``core/shared/kernels.py``: each body is inlined into an entry point for the
codec's default block size (a constant trip count, so the block loops vectorize) and one
for any other even size.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ddiloco.core.shared.kernels import BLOCK, ROUNDING

_ABS_BITS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
"""A float32's magnitude as an integer orders like the float, NaN above infinity: the block's
largest magnitude and its finiteness come out of one integer max (which vectorizes)."""
_SEVEN = np.float32(7.0)
_LOW_MASK = np.int32(15)
_SHIFT = np.int32(4)


@njit(cache=True, nogil=True, inline="always")
def _delta(anchor: np.ndarray, local: np.ndarray, block: int, scales: np.ndarray, packed: np.ndarray) -> int:
    numel = anchor.shape[0]
    d = np.empty(block, dtype=np.float32)
    bits = d.view(np.uint32)
    top_bits = np.empty(1, dtype=np.uint32)
    top_float = top_bits.view(np.float32)
    bad = 0
    for b in range(scales.shape[0]):
        start = b * block
        count = min(block, numel - start)
        for k in range(count):
            d[k] = anchor[start + k] - local[start + k]
        top = np.uint32(0)
        for k in range(count):
            top = max(top, bits[k] & _ABS_BITS)
        if top >= _INF_BITS:
            bad += 1
        top_bits[0] = top
        scale = top_float[0] / _SEVEN
        scales[b] = scale
        divisor = scale if scale > 0 else np.float32(1.0)
        for k in range(count):
            d[k] = min(max((d[k] / divisor + ROUNDING) - ROUNDING, -_SEVEN), _SEVEN) + _SEVEN
        for k in range(count // 2):
            packed[(start >> 1) + k] = np.uint8(np.int32(d[2 * k]) | (np.int32(d[2 * k + 1]) << _SHIFT))
        if count & 1:  # an odd numel: the last byte holds one code
            packed[(start + count - 1) >> 1] = np.uint8(np.int32(d[count - 1]))
    return bad


@njit(cache=True, nogil=True)
def _delta_block(anchor: np.ndarray, local: np.ndarray, scales: np.ndarray, packed: np.ndarray) -> int:
    return _delta(anchor, local, BLOCK, scales, packed)


@njit(cache=True, nogil=True)
def _delta_any(anchor: np.ndarray, local: np.ndarray, block: int, scales: np.ndarray, packed: np.ndarray) -> int:
    return _delta(anchor, local, block, scales, packed)


def delta_int4(anchor: np.ndarray, local: np.ndarray, block_size: int, scales: np.ndarray,
               packed: np.ndarray) -> int:
    """Encode Δ = anchor − local as int4 into ``scales`` and ``packed`` (``block_size`` even);
    returns the number of blocks holding a non-finite value (their payload is meaningless)."""
    if block_size == BLOCK:
        return _delta_block(anchor, local, scales, packed)
    return _delta_any(anchor, local, block_size, scales, packed)


@njit(cache=True, nogil=True, inline="always")
def _apply(scales: np.ndarray, packed: np.ndarray, block: int, anchor: np.ndarray, local: np.ndarray,
           alpha: np.float32, beta: np.float32, mix: bool) -> None:
    numel = anchor.shape[0]
    for b in range(scales.shape[0]):
        s = scales[b]
        start = b * block
        count = min(block, numel - start)
        for k in range(count // 2):
            byte = np.int32(packed[(start >> 1) + k])
            i = start + 2 * k
            anchor[i] += np.float32((byte & _LOW_MASK) - 7) * s
            anchor[i + 1] += np.float32((byte >> _SHIFT) - 7) * s
        if count & 1:
            last = start + count - 1
            anchor[last] += np.float32((np.int32(packed[last >> 1]) & _LOW_MASK) - 7) * s
        if mix:
            for k in range(count):
                local[start + k] = local[start + k] * alpha + anchor[start + k] * beta
        else:
            for k in range(count):
                local[start + k] = anchor[start + k]


@njit(cache=True, nogil=True)
def _apply_block(scales: np.ndarray, packed: np.ndarray, anchor: np.ndarray, local: np.ndarray, alpha: np.float32,
                 beta: np.float32, mix: bool) -> None:
    _apply(scales, packed, BLOCK, anchor, local, alpha, beta, mix)


@njit(cache=True, nogil=True)
def _apply_any(scales: np.ndarray, packed: np.ndarray, block: int, anchor: np.ndarray, local: np.ndarray,
               alpha: np.float32, beta: np.float32, mix: bool) -> None:
    _apply(scales, packed, block, anchor, local, alpha, beta, mix)


def apply_int4(scales: np.ndarray, packed: np.ndarray, block_size: int, anchor: np.ndarray, local: np.ndarray,
               alpha: float) -> None:
    """anchor += decode(payload); local ← α·local + (1−α)·anchor (α = 0: a copy), one pass."""
    a, b, mix = np.float32(alpha), np.float32(1.0 - alpha), alpha != 0.0
    if block_size == BLOCK:
        _apply_block(scales, packed, anchor, local, a, b, mix)
    else:
        _apply_any(scales, packed, block_size, anchor, local, a, b, mix)


def compile_learner_kernels() -> None:
    """Compile both kernels now (or load them from numba's disk cache), with the argument types
    of the fast path (an update's payload arrives as bytes: read-only arrays), so the first
    due fragment does not stall the training loop for seconds."""
    for block in (BLOCK, 4):
        anchor, local = np.zeros(2 * block, dtype=np.float32), np.zeros(2 * block, dtype=np.float32)
        scales, packed = np.empty(2, dtype=np.float32), np.empty(block, dtype=np.uint8)
        delta_int4(anchor, local, block, scales, packed)
        payload = scales.tobytes() + packed.tobytes()
        apply_int4(np.frombuffer(payload, dtype="<f4", count=2), np.frombuffer(payload, dtype=np.uint8, offset=8),
                   block, anchor, local, 0.5)
