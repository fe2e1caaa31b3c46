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

import numba
import numpy as np
from numba import njit, prange

# numba's OpenMP threading layer, when it starts, resets the process's OpenMP thread count:
# torch's own intra-op threads change under it (torch.set_num_threads(1) became 2, and a
# run's weights moved in the last bits). Its own simple thread pool leaves torch alone.
numba.config.THREADING_LAYER = "workqueue"

QMAX = 7


@njit(parallel=True, cache=True)
def int4_stats(scales: np.ndarray, packed: np.ndarray, numel: int, block_size: int) -> tuple[float, int]:
    """(‖Δ‖² in float64, number of non-finite scales) of an int4 payload.

    Each block's share is computed in parallel into its own slot and the slots are summed in
    order afterwards: a parallel reduction would add in an order that depends on the threads,
    and the same run must give the same weights bit for bit.
    """
    blocks = scales.shape[0]
    shares = np.zeros(blocks, dtype=np.float64)
    bad = np.zeros(blocks, dtype=np.int64)
    for b in prange(blocks):
        s = np.float64(scales[b])
        if not np.isfinite(s):
            bad[b] = 1
            continue
        squares = 0
        for i in range(b * block_size, min((b + 1) * block_size, numel)):
            d = ((packed[i >> 1] >> ((i & 1) * 4)) & 15) - QMAX
            squares += d * d
        shares[b] = s * s * squares
    total = 0.0
    for b in range(blocks):
        total += shares[b]
    return total, int(bad.sum())


@njit(parallel=True, cache=True)
def int4_axpy(scales: np.ndarray, packed: np.ndarray, numel: int, block_size: int, alpha: float,
              acc: np.ndarray) -> None:
    """acc += alpha · decode(payload), in float32."""
    for b in prange(scales.shape[0]):
        s = np.float32(alpha * np.float64(scales[b]))
        for i in range(b * block_size, min((b + 1) * block_size, numel)):
            d = ((packed[i >> 1] >> ((i & 1) * 4)) & 15) - QMAX
            acc[i] += np.float32(d) * s


@njit(parallel=True, cache=True)
def outer_step_int4(acc: np.ndarray, scale: float, lr: float, mu: float, first: bool, plain: bool,
                    momentum: np.ndarray, residual: np.ndarray, value: np.ndarray, block_size: int,
                    scales_out: np.ndarray, packed_out: np.ndarray) -> None:
    """One pass: merged = scale·acc; Nesterov (or a plain −lr step); + residual; int4 encode;
    residual ← update − decoded; value ← value + decoded. Same float32 operations, in the same
    order, as ``NesterovSGD.update`` followed by the int4 codec and ``GlobalFragment.step``."""
    numel = acc.shape[0]
    f_scale, f_lr, f_mu = np.float32(scale), np.float32(lr), np.float32(mu)
    for b in prange(scales_out.shape[0]):
        start, end = b * block_size, min((b + 1) * block_size, numel)
        absmax = np.float32(0.0)
        for i in range(start, end):
            merged = acc[i] * f_scale
            if plain:
                update = merged * -f_lr
            else:
                buf = merged if first else momentum[i] * f_mu + merged
                momentum[i] = buf
                update = (merged + buf * f_mu) * -f_lr
            update = update + residual[i]
            residual[i] = update  # the update for now; the residual once the block is encoded
            if abs(update) > absmax:
                absmax = abs(update)
        block_scale = absmax / np.float32(QMAX)
        scales_out[b] = block_scale
        divisor = block_scale if block_scale > 0 else np.float32(1.0)
        for i in range(start, end):
            update = residual[i]
            q = min(max(np.rint(update / divisor), -QMAX), QMAX)
            code = np.uint8(q + QMAX)
            sent = np.float32(np.float32(q) * block_scale)
            residual[i] = update - sent
            value[i] += sent
            if i & 1:
                packed_out[i >> 1] |= code << 4
            else:
                packed_out[i >> 1] = code
