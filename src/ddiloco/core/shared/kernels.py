"""Compiled loops for the synchronizer's hot path on int4 payloads (numba).

The int4 wire layout (``core/shared/codecs.py``): one float32 scale per block, then 4-bit codes
packed two per byte, low nibble first; a value is ``(code - 7) * scale``. Working on that
layout directly, a contribution costs one pass over its payload to check and measure
(``int4_stats``: every scale finite, ‖Δ‖² = Σ_blocks scale² · Σ (code − 7)²) on arrival and
one pass at the round's close to add α·Δ into a float32 buffer (``int4_axpy``) — no decoded copy. The
close of a round is one pass too (``outer_step_int4``): merged Δ, Nesterov momentum, error
feedback, int4 encoding of the update, and Θ += decoded update, block by block, keeping the
outer state lean (momentum in bf16, the downlink residual in int8: 3 bytes per parameter
instead of 8).

Every kernel releases the GIL (``nogil``): the synchronizer's core runs them on its own
thread, and the event loop that serves status, uploads and update streams runs meanwhile.

Why numba: the fused loops touch each byte once where torch's unpack/scale/norm/add chain
touches it five or six times (``benchmarks/bench_runtime.py --only merge``); numba installs
from PyPI as a wheel and compiles these loops on first use, cached on disk afterwards.

Why serial: measured on fragments of 0.8M parameters, a ``prange`` launch on numba's
thread pool costs more than the whole vectorized loop (0.5 ms against 0.08 ms for
``int4_stats``), and the pool cannot be entered by two threads at once (two shards hosted
in one process). A synchronizer uses more cores by running more shards.

Why specialized: every loop runs block by block, and a block's inner loop vectorizes only
when its trip count is a compile-time constant. Each kernel is written once as an inlined
body taking the block size; the entry points call it with the codec's default block size
as a constant (``BLOCK``) or, for any other even size, with the size as an argument.

Sums of squares keep a fixed order (four interleaved partial sums, then the blocks in
order): the same payloads give the same bits on every run.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ddiloco.core.shared.codecs import DEFAULT_BLOCK_SIZE

BLOCK = DEFAULT_BLOCK_SIZE
"""The block size the kernels are specialized for (the int4 codec's default)."""
_HALF = BLOCK // 2  # bytes per block

_Q = np.int32(7)  # qmax: a code c stands for c − 7
_LOW_MASK = np.int32(15)
_SHIFT = np.int32(4)


# ---- checking and measuring a contribution -----------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _squares(packed: np.ndarray, start: int, count: int) -> np.int32:
    """Σ (code − 7)² over ``count`` bytes (two codes each), in int32: a block of ≤ 2¹⁶ codes cannot overflow."""
    total = np.int32(0)
    for k in range(count):
        byte = np.int32(packed[start + k])
        low = (byte & _LOW_MASK) - _Q
        high = (byte >> _SHIFT) - _Q
        total += low * low + high * high
    return total


@njit(cache=True, nogil=True, inline="always")
def _stats(scales: np.ndarray, packed: np.ndarray, numel: int, half: int) -> tuple[float, int]:
    whole = numel // 2  # bytes holding two codes; an odd numel leaves one code in a last byte
    total = 0.0
    bad = 0
    for b in range(scales.shape[0]):
        s = np.float64(scales[b])
        if not np.isfinite(s):
            bad += 1
            continue
        start = b * half
        if start + half <= whole:
            squares = _squares(packed, start, half)
        else:  # the last block, partial
            squares = _squares(packed, start, whole - start)
            if numel & 1:
                d = (np.int32(packed[whole]) & _LOW_MASK) - _Q
                squares += d * d
        total += s * s * squares
    return total, bad


@njit(cache=True, nogil=True)
def _stats_block(scales: np.ndarray, packed: np.ndarray, numel: int) -> tuple[float, int]:
    return _stats(scales, packed, numel, _HALF)


@njit(cache=True, nogil=True)
def _stats_any(scales: np.ndarray, packed: np.ndarray, numel: int, half: int) -> tuple[float, int]:
    return _stats(scales, packed, numel, half)


def int4_stats(scales: np.ndarray, packed: np.ndarray, numel: int, block_size: int) -> tuple[float, int]:
    """(‖Δ‖² in float64, number of non-finite scales) of an int4 payload (``block_size`` even)."""
    if block_size == BLOCK:
        return _stats_block(scales, packed, numel)
    return _stats_any(scales, packed, numel, block_size // 2)


# ---- adding a contribution to the round ----------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _axpy_run(packed: np.ndarray, start: int, count: int, s: np.float32, acc: np.ndarray) -> None:
    for k in range(count):
        j = start + k
        byte = np.int32(packed[j])
        acc[2 * j] += np.float32((byte & _LOW_MASK) - _Q) * s
        acc[2 * j + 1] += np.float32((byte >> _SHIFT) - _Q) * s


@njit(cache=True, nogil=True, inline="always")
def _axpy(scales: np.ndarray, packed: np.ndarray, numel: int, half: int, alpha: float, acc: np.ndarray) -> None:
    whole = numel // 2
    for b in range(scales.shape[0]):
        s = np.float32(alpha * np.float64(scales[b]))
        start = b * half
        if start + half <= whole:
            _axpy_run(packed, start, half, s, acc)
        else:
            _axpy_run(packed, start, whole - start, s, acc)
            if numel & 1:
                acc[numel - 1] += np.float32((np.int32(packed[whole]) & _LOW_MASK) - _Q) * s


@njit(cache=True, nogil=True)
def _axpy_block(scales: np.ndarray, packed: np.ndarray, numel: int, alpha: float, acc: np.ndarray) -> None:
    _axpy(scales, packed, numel, _HALF, alpha, acc)


@njit(cache=True, nogil=True)
def _axpy_any(scales: np.ndarray, packed: np.ndarray, numel: int, half: int, alpha: float, acc: np.ndarray) -> None:
    _axpy(scales, packed, numel, half, alpha, acc)


def int4_axpy(scales: np.ndarray, packed: np.ndarray, numel: int, block_size: int, alpha: float,
              acc: np.ndarray) -> None:
    """acc += alpha · decode(payload), in float32 (``block_size`` even)."""
    if block_size == BLOCK:
        _axpy_block(scales, packed, numel, alpha, acc)
    else:
        _axpy_any(scales, packed, numel, block_size // 2, alpha, acc)


# ---- the merged direction's norm -------------------------------------------------------------

@njit(cache=True, nogil=True)
def norm_squared(x: np.ndarray) -> float:
    """Σ x² in float64 over four interleaved partial sums (vectorizable, same order every time)."""
    n = x.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    for i in range(0, n - n % 4, 4):
        a, b, c, d = np.float64(x[i]), np.float64(x[i + 1]), np.float64(x[i + 2]), np.float64(x[i + 3])
        s0 += a * a
        s1 += b * b
        s2 += c * c
        s3 += d * d
    for i in range(n - n % 4, n):
        s0 += np.float64(x[i]) * np.float64(x[i])
    return (s0 + s1) + (s2 + s3)


# ---- closing a round -------------------------------------------------------------------------

ROUNDING = np.float32(1.5 * 2**23)
"""Adding and subtracting 1.5·2²³ rounds a float32 of magnitude below 2²² to the nearest integer,
ties to even — what ``torch.round`` does — in two additions the compiler can vectorize,
where a call to ``rint`` per element cannot be."""

RESIDUAL_LEVELS = np.float32(254.0)
"""The downlink residual is kept as int8 in units of its block's scale / 254: an update is rounded
to the nearest code, so what it could not carry lies within ±scale/2, and 254 levels over that
range keep it to 1/508 of a quantization step (1 byte per parameter instead of 4)."""

_BF16_ROUND = np.uint32(0x7FFF)
_BF16_SHIFT = np.uint32(16)
_ONE = np.uint32(1)


@njit(cache=True, nogil=True, inline="always")
def _round(x: np.float32) -> np.float32:
    return (x + ROUNDING) - ROUNDING


@njit(cache=True, nogil=True, inline="always")
def _close_block(start: int, count: int, acc: np.ndarray, f_scale: np.float32, f_lr: np.float32, f_mu: np.float32,
                 first: bool, plain: bool, momentum: np.ndarray, residual: np.ndarray, residual_scales: np.ndarray,
                 value: np.ndarray, scales_out: np.ndarray, b: int, packed_out: np.ndarray, buf: np.ndarray,
                 buf_bits: np.ndarray, update: np.ndarray) -> None:
    """One block: merged Δ, Nesterov momentum (bf16 in memory, float32 here), + residual,
    absmax, int4 encode, residual ← what the update could not carry, value += decoded."""
    uses_momentum = not plain
    if uses_momentum and not first:
        for k in range(count):  # bf16 -> float32: the high half of the float's bits
            buf_bits[k] = np.uint32(momentum[start + k]) << _BF16_SHIFT
    unit = residual_scales[b] / RESIDUAL_LEVELS
    absmax = np.float32(0.0)
    for k in range(count):
        i = start + k
        merged = acc[i] * f_scale
        acc[i] = 0.0  # ready for the next round
        if plain:
            u = merged * -f_lr
        else:
            m = merged if first else buf[k] * f_mu + merged
            buf[k] = m
            u = (merged + m * f_mu) * -f_lr
        u += np.float32(residual[i]) * unit
        update[k] = u
        absmax = max(absmax, abs(u))
    block_scale = absmax / np.float32(7.0)
    scales_out[b] = block_scale
    residual_scales[b] = block_scale
    divisor = block_scale if block_scale > 0 else np.float32(1.0)
    to_levels = RESIDUAL_LEVELS / divisor
    for k in range(count):
        i = start + k
        q = min(max(_round(update[k] / divisor), np.float32(-7.0)), np.float32(7.0))
        sent = q * block_scale
        value[i] += sent
        r = min(max(_round((update[k] - sent) * to_levels), np.float32(-127.0)), np.float32(127.0))
        residual[i] = np.int8(r)
        update[k] = q + np.float32(7.0)  # the code, for packing
    for k in range(count // 2):
        i = start + 2 * k
        packed_out[i >> 1] = np.uint8(np.int32(update[2 * k]) | (np.int32(update[2 * k + 1]) << _SHIFT))
    if count & 1:  # an odd numel: the last byte holds one code
        packed_out[(start + count - 1) >> 1] = np.uint8(np.int32(update[count - 1]))
    if uses_momentum:
        for k in range(count):  # float32 -> bf16, rounded to nearest, ties to even
            bits = buf_bits[k]
            momentum[start + k] = np.uint16((bits + _BF16_ROUND + ((bits >> _BF16_SHIFT) & _ONE)) >> _BF16_SHIFT)


@njit(cache=True, nogil=True, inline="always")
def _outer_step(acc: np.ndarray, scale: float, lr: float, mu: float, first: bool, plain: bool, momentum: np.ndarray,
                residual: np.ndarray, residual_scales: np.ndarray, value: np.ndarray, block_size: int,
                scales_out: np.ndarray, packed_out: np.ndarray) -> None:
    numel = acc.shape[0]
    f_scale, f_lr, f_mu = np.float32(scale), np.float32(lr), np.float32(mu)
    buf = np.empty(block_size, dtype=np.float32)
    buf_bits = buf.view(np.uint32)
    update = np.empty(block_size, dtype=np.float32)
    for b in range(scales_out.shape[0]):
        start = b * block_size
        count = min(block_size, numel - start)
        _close_block(start, count, acc, f_scale, f_lr, f_mu, first, plain, momentum, residual, residual_scales,
                     value, scales_out, b, packed_out, buf, buf_bits, update)


@njit(cache=True, nogil=True)
def _outer_step_block(acc: np.ndarray, scale: float, lr: float, mu: float, first: bool, plain: bool,
                      momentum: np.ndarray, residual: np.ndarray, residual_scales: np.ndarray, value: np.ndarray,
                      scales_out: np.ndarray, packed_out: np.ndarray) -> None:
    _outer_step(acc, scale, lr, mu, first, plain, momentum, residual, residual_scales, value, BLOCK, scales_out,
                packed_out)


@njit(cache=True, nogil=True)
def _outer_step_any(acc: np.ndarray, scale: float, lr: float, mu: float, first: bool, plain: bool,
                    momentum: np.ndarray, residual: np.ndarray, residual_scales: np.ndarray, value: np.ndarray,
                    block_size: int, scales_out: np.ndarray, packed_out: np.ndarray) -> None:
    _outer_step(acc, scale, lr, mu, first, plain, momentum, residual, residual_scales, value, block_size, scales_out,
                packed_out)


def outer_step_int4(acc: np.ndarray, scale: float, lr: float, mu: float, first: bool, plain: bool,
                    momentum: np.ndarray, residual: np.ndarray, residual_scales: np.ndarray, value: np.ndarray,
                    block_size: int, scales_out: np.ndarray, packed_out: np.ndarray) -> None:
    """One pass: merged = scale·acc (and acc ← 0); Nesterov (or a plain −lr step); + residual;
    int4 encode; residual ← update − decoded; value ← value + decoded. The state it keeps is
    lean: ``momentum`` bf16 (as uint16 bits), ``residual`` int8 in units of
    ``residual_scales`` / 254 (one float32 per block, the scale of the block's last update).
    Otherwise the same float32 operations, in the same order, as ``NesterovSGD.update``
    followed by the int4 codec and ``GlobalFragment.step`` (``block_size`` even: a packed
    byte never straddles two blocks). Releases the GIL: the event loop serves while it runs."""
    if block_size == BLOCK:
        _outer_step_block(acc, scale, lr, mu, first, plain, momentum, residual, residual_scales, value, scales_out,
                          packed_out)
    else:
        _outer_step_any(acc, scale, lr, mu, first, plain, momentum, residual, residual_scales, value, block_size,
                        scales_out, packed_out)


def compile_kernels() -> None:
    """Compile every kernel now (or load it from numba's on-disk cache).

    A synchronizer calls this before it serves: compiling on the first contribution instead
    stalls the first rounds for seconds, during which learners that never wait train ahead
    on anchors the synchronizer will call stale. The argument types are the fast path's own:
    payloads arrive as bytes, so their arrays are read-only, and numba compiles a read-only
    array type separately. Both the specialized and the general entry points are compiled.
    """
    for block in (BLOCK, 4):
        acc = np.zeros(2 * block, dtype=np.float32)
        scales = np.frombuffer(np.ones(2, dtype=np.float32).tobytes(), dtype="<f4")
        packed = np.frombuffer(bytes(block), dtype=np.uint8)
        int4_stats(scales, packed, acc.shape[0], block)
        int4_axpy(scales, packed, acc.shape[0], block, 1.0, acc)
        outer_step_int4(acc, 1.0, 1.0, 0.9, True, False, np.zeros(acc.shape[0], dtype=np.uint16),
                        np.zeros(acc.shape[0], dtype=np.int8), np.zeros(2, dtype=np.float32), np.zeros_like(acc), block,
                        np.empty(2, dtype=np.float32), np.zeros(block, dtype=np.uint8))
    norm_squared(np.zeros(4, dtype=np.float32))
