"""Compiled loops for the synchronizer's hot path on int4 payloads (numba, parallel over blocks).

The int4 wire layout (``core/codecs.py``): one float32 scale per block, then 4-bit codes
packed two per byte, low nibble first; a value is ``(code - 7) * scale``. Working on that
layout directly, a contribution costs one pass over its payload to check and measure
(``int4_stats``: every scale finite, ‖Δ‖² = Σ_blocks scale² · Σ (code − 7)²) and one pass
to add α·Δ into the round's float32 accumulator (``int4_axpy``) — no decoded copy. The
close of a round is one pass too (``outer_step_int4``): merged Δ, Nesterov momentum, error
feedback, int4 encoding of the update, and Θ += decoded update, block by block.

Why numba: measured in ``benchmarks/bench_merge.py`` against vectorized torch on the same
machine, the fused loops touch each byte once where torch's unpack/scale/norm/add chain
touches it five or six times; numba installs from PyPI as a wheel, compiles these loops on
first use (cached on disk afterwards) and runs them on every core.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np
from numba import njit, prange

# numba's OpenMP threading layer, when it starts, resets the process's OpenMP thread count:
# torch's own intra-op threads change under it (torch.set_num_threads(1) became 2, and a
# run's weights moved in the last bits). Its own simple thread pool leaves torch alone.
numba.config.THREADING_LAYER = "workqueue"

_LAUNCH = threading.Lock()
"""The workqueue pool runs one parallel kernel at a time and aborts the whole process when two
threads launch at once (two shards hosted in one process do). Every kernel launches under
this lock; a kernel already uses every core, so serializing them costs no throughput."""

K = TypeVar("K", bound=Callable)


def _serialized(kernel: K) -> K:
    @functools.wraps(kernel)
    def launch(*args):  # type: ignore[no-untyped-def]
        with _LAUNCH:
            return kernel(*args)

    return launch  # type: ignore[return-value]

QMAX = 7
# Per packed byte (two codes): each level as float32.
_BYTES = np.arange(256)
LOW = ((_BYTES & 15) - QMAX).astype(np.float32)
HIGH = ((_BYTES >> 4) - QMAX).astype(np.float32)


@_serialized
@njit(parallel=True, cache=True)
def int4_stats(scales: np.ndarray, packed: np.ndarray, numel: int, block_size: int) -> tuple[float, int]:
    """(‖Δ‖² in float64, number of non-finite scales) of an int4 payload (``block_size`` even).

    Each block's share is computed in parallel into its own slot and the slots are summed in
    order afterwards: a parallel reduction would add in an order that depends on the threads,
    and the same run must give the same weights bit for bit.
    """
    blocks = scales.shape[0]
    half = block_size // 2
    whole = numel // 2  # bytes holding two codes; an odd numel leaves one code in a last byte
    shares = np.zeros(blocks, dtype=np.float64)
    bad = np.zeros(blocks, dtype=np.int64)
    for b in prange(blocks):
        s = np.float64(scales[b])
        if not np.isfinite(s):
            bad[b] = 1
            continue
        squares = np.int32(0)
        for j in range(b * half, min((b + 1) * half, whole)):
            byte = np.int32(packed[j])
            low, high = (byte & 15) - QMAX, (byte >> 4) - QMAX
            squares += low * low + high * high
        if numel & 1 and b == blocks - 1:
            d = (np.int32(packed[whole]) & 15) - QMAX
            squares += d * d
        shares[b] = s * s * squares
    total = 0.0
    for b in range(blocks):
        total += shares[b]
    return total, int(bad.sum())


@_serialized
@njit(parallel=True, cache=True)
def int4_axpy(scales: np.ndarray, packed: np.ndarray, numel: int, block_size: int, alpha: float,
              acc: np.ndarray) -> None:
    """acc += alpha · decode(payload), in float32 (``block_size`` even)."""
    blocks = scales.shape[0]
    half = block_size // 2
    whole = numel // 2
    for b in prange(blocks):
        s = np.float32(alpha * np.float64(scales[b]))
        for j in range(b * half, min((b + 1) * half, whole)):
            byte = packed[j]
            acc[2 * j] += LOW[byte] * s
            acc[2 * j + 1] += HIGH[byte] * s
        if numel & 1 and b == blocks - 1:
            acc[numel - 1] += LOW[packed[whole]] * s


@njit(cache=True, inline="always")
def _update(acc: np.ndarray, i: int, f_scale: np.float32, f_lr: np.float32, f_mu: np.float32, first: bool,
            plain: bool, momentum: np.ndarray, residual: np.ndarray) -> np.float32:
    merged = acc[i] * f_scale
    acc[i] = 0.0  # ready for the next round
    if plain:
        update = merged * -f_lr
    else:
        buf = merged if first else momentum[i] * f_mu + merged
        momentum[i] = buf
        update = (merged + buf * f_mu) * -f_lr
    return update + residual[i]


@_serialized
@njit(parallel=True, cache=True)
def norm_squared(x: np.ndarray, block_size: int) -> float:
    """Σ x² in float64, block by block in parallel, the blocks summed in order (deterministic)."""
    blocks = -(-x.shape[0] // block_size)
    shares = np.zeros(blocks, dtype=np.float64)
    for b in prange(blocks):
        total = 0.0
        for i in range(b * block_size, min((b + 1) * block_size, x.shape[0])):
            total += np.float64(x[i]) * np.float64(x[i])
        shares[b] = total
    total = 0.0
    for b in range(blocks):
        total += shares[b]
    return total


ROUNDING = np.float32(1.5 * 2**23)
"""Adding and subtracting 1.5·2²³ rounds a float32 of magnitude below 2²² to the nearest integer,
ties to even — what ``torch.round`` does — in two additions the compiler can vectorize,
where a call to ``rint`` per element cannot be."""


@njit(cache=True, inline="always")
def _encode(update: np.float32, divisor: np.float32, block_scale: np.float32, i: int, residual: np.ndarray,
            value: np.ndarray) -> int:
    q = min(max((update / divisor + ROUNDING) - ROUNDING, np.float32(-QMAX)), np.float32(QMAX))
    sent = np.float32(np.float32(q) * block_scale)
    residual[i] = update - sent
    value[i] += sent
    return int(q) + QMAX


@_serialized
@njit(parallel=True, cache=True)
def outer_step_int4(acc: np.ndarray, scale: float, lr: float, mu: float, first: bool, plain: bool,
                    momentum: np.ndarray, residual: np.ndarray, value: np.ndarray, block_size: int,
                    scales_out: np.ndarray, packed_out: np.ndarray) -> float:
    """One pass: merged = scale·acc (and acc ← 0); Nesterov (or a plain −lr step); + residual;
    int4 encode; residual ← update − decoded; value ← value + decoded. Returns ‖value‖² (the
    next round's norm bound is relative to it). Same float32 operations, in the same
    order, as ``NesterovSGD.update`` followed by the int4 codec and ``GlobalFragment.step``
    (``block_size`` even: a packed byte never straddles two blocks)."""
    numel = acc.shape[0]
    f_scale, f_lr, f_mu = np.float32(scale), np.float32(lr), np.float32(mu)
    blocks = scales_out.shape[0]
    value_squares = np.zeros(blocks, dtype=np.float64)
    for b in prange(blocks):
        start, end = b * block_size, min((b + 1) * block_size, numel)
        absmax = np.float32(0.0)
        for i in range(start, end):
            update = _update(acc, i, f_scale, f_lr, f_mu, first, plain, momentum, residual)
            residual[i] = update  # the update for now; the residual once the block is encoded
            absmax = max(absmax, abs(update))
        block_scale = absmax / np.float32(QMAX)
        scales_out[b] = block_scale
        divisor = block_scale if block_scale > 0 else np.float32(1.0)
        pairs_end = start + (end - start) // 2 * 2
        for i in range(start, pairs_end, 2):
            low = _encode(residual[i], divisor, block_scale, i, residual, value)
            high = _encode(residual[i + 1], divisor, block_scale, i + 1, residual, value)
            packed_out[i >> 1] = np.uint8(low | (high << 4))
        if pairs_end < end:  # an odd numel: the last byte holds one code
            packed_out[pairs_end >> 1] = np.uint8(_encode(residual[pairs_end], divisor, block_scale, pairs_end,
                                                          residual, value))
        squares = 0.0
        for i in range(start, end):
            squares += np.float64(value[i]) * np.float64(value[i])
        value_squares[b] = squares
    total = 0.0
    for b in range(blocks):
        total += value_squares[b]
    return total


def compile_kernels() -> None:
    """Compile every kernel now (or load it from numba's on-disk cache, and start its threads).

    A synchronizer calls this before it serves: compiling on the first contribution instead
    stalls the first rounds for seconds, during which learners that never wait train ahead
    on anchors the synchronizer will call stale. The argument types are the fast path's own:
    payloads arrive as bytes, so their arrays are read-only, and numba compiles a read-only
    array type separately.
    """
    block = 4
    acc = np.zeros(2 * block, dtype=np.float32)
    scales = np.frombuffer(np.ones(2, dtype=np.float32).tobytes(), dtype="<f4")
    packed = np.frombuffer(bytes(block), dtype=np.uint8)
    int4_stats(scales, packed, acc.shape[0], block)
    int4_axpy(scales, packed, acc.shape[0], block, 1.0, acc)
    norm_squared(acc, block)
    state = [np.zeros_like(acc) for _ in range(3)]
    outer_step_int4(acc, 1.0, 1.0, 0.9, True, False, *state, block, np.empty(2, dtype=np.float32),
                    np.zeros(block, dtype=np.uint8))
