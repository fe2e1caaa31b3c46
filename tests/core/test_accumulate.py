"""The synchronizer's fast merge path against the float64 references, over many shapes."""

from __future__ import annotations

import copy
import math
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from protocol_helpers import merged

from ddiloco.core.shared import kernels
from ddiloco.core.shared.codecs import CODEC_NAMES, get_codec
from ddiloco.core.shared.messages import Rejected
from ddiloco.core.sync_side.accumulate import RoundAccumulator
from ddiloco.core.sync_side.merge import MERGE_RULES, MergeRuleName, merge_rule
from ddiloco.core.sync_side.outer import NesterovSGD
from ddiloco.core.sync_side.rounds import GlobalFragment

FAST = get_codec("int4", block_size=128)


def reference(deltas: list[torch.Tensor], weights: list[float], rule: str) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return merge_rule(rule).reference(deltas, w / w.sum())


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 3000),
    block=st.sampled_from([2, 8, 64, 128, 7, 33]),
    codec=st.sampled_from(CODEC_NAMES),
    rule=st.sampled_from(MERGE_RULES),
    count=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_accumulated_merge_equals_the_reference(numel, block, codec, rule, count, seed):
    """Every merge rule, on every codec's payloads: the fast path is the rule's float64 reference."""
    c = get_codec(codec, block_size=block)
    g = torch.Generator().manual_seed(seed)
    acc = RoundAccumulator(numel, c, merge_rule(rule))
    deltas, weights = [], []
    for m in range(count):
        payload = c.encode(torch.randn(numel, generator=g) * float(torch.rand(1, generator=g)) * 0.1)
        weight = float(torch.randint(1, 2000, (1,), generator=g))
        acc.add(m, payload, weight, acc.measure(payload))
        deltas.append(c.decode(payload, numel))
        weights.append(weight)
    want = reference(deltas, weights, rule)
    got = merged(acc)
    scale = max(float(want.abs().max()), 1e-12)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * scale)  # float32 accumulation


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(2, 2000), seed=st.integers(0, 2**16), ops=st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_replacing_and_discarding_equals_merging_what_is_left(numel, seed, ops):
    g = torch.Generator().manual_seed(seed)
    acc = RoundAccumulator(numel, FAST, merge_rule("rda"))
    held: dict[int, tuple[bytes, float]] = {}
    for key in ops:
        if key in held and bool(torch.rand(1, generator=g) < 0.3):
            acc.discard(key)
            del held[key]
            continue
        payload = FAST.encode(torch.randn(numel, generator=g) * 0.01)
        weight = float(torch.randint(1, 100, (1,), generator=g))
        acc.add(key, payload, weight, acc.measure(payload))  # replaces what the key held
        held[key] = (payload, weight)
    if not held:
        assert len(acc) == 0
        return
    deltas, weights = [FAST.decode(p, numel) for p, _ in held.values()], [w for _, w in held.values()]
    # Directions that (nearly) cancel leave RDA's step 0/0: int4 codes make exact opposites likely in
    # 2 dimensions (seed 65535: two Δ of the same weight, exactly opposite). The accumulator says "no
    # step"; the reference amplifies rounding residue. Only well-posed rounds are compared.
    units = sum(w * d / d.norm() for d, w in zip(deltas, weights) if float(d.norm()) > 0)
    assume(float(torch.as_tensor(units).norm()) > 1e-3 * sum(weights))
    want = reference(deltas, weights, "rda")
    assert torch.allclose(merged(acc), want, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("codec", ["int4", "int8", "fp32"])
def test_non_finite_contributions_are_refused_and_change_nothing(codec):
    c = get_codec(codec)
    numel = 300
    acc = RoundAccumulator(numel, c, merge_rule("rda"))
    good = c.encode(torch.full((numel,), 0.01))
    acc.add("a", good, 10.0, acc.measure(good))
    before = merged(acc).clone()
    if codec == "fp32":
        bad = struct.pack("<f", math.nan) + good[4:]
    else:
        bad = struct.pack("<f", math.inf) + good[4:]  # the first block's scale
    with pytest.raises(Rejected, match="non_finite"):
        acc.measure(bad)
    assert torch.equal(merged(acc), before) and len(acc) == 1


def test_zero_deltas_count_in_the_magnitude_and_cancelling_directions_give_zero():
    numel = 256
    acc = RoundAccumulator(numel, FAST, merge_rule("rda"))
    zero = FAST.encode(torch.zeros(numel))
    acc.add("z", zero, 1.0, acc.measure(zero))
    assert torch.equal(merged(acc), torch.zeros(numel))
    up = FAST.encode(torch.full((numel,), 0.5))
    down = FAST.encode(torch.full((numel,), -0.5))
    acc.add("u", up, 1.0, acc.measure(up))
    acc.add("d", down, 1.0, acc.measure(down))
    assert torch.equal(merged(acc), torch.zeros(numel))


@settings(max_examples=25, deadline=None)
@given(numel=st.integers(1, 4000), rounds=st.integers(1, 4), plain_last=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_close_matches_the_reference_step_and_learners_rebuild_the_value_exactly(numel, rounds, plain_last,
                                                                                       seed):
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(numel, generator=g)
    fast = GlobalFragment(value=value.clone(), is_embedding=False, accumulator=RoundAccumulator(numel, FAST, merge_rule("rda")))
    ref = copy.deepcopy(fast)
    outer = NesterovSGD(lr=0.4, momentum=0.9)
    for r in range(rounds):
        plain = plain_last and r == rounds - 1
        payloads = [FAST.encode(torch.randn(numel, generator=g) * 0.05) for _ in range(3)]
        for m, p in enumerate(payloads):
            for frag in (fast, ref):
                frag.accumulator.add(m, p, 5.0 + m, frag.accumulator.measure(p))
        before = fast.value.clone()
        delta = merged(ref.accumulator)
        ref.accumulator.clear()
        ref_payload = ref.step(delta, outer, FAST, plain=plain)
        payload, coherence = fast.close(outer, FAST, plain=plain)
        assert 0.0 < coherence <= 1.0 + 1e-6
        # The learner's reconstruction: previous value + decode(payload), bit for bit.
        assert torch.equal(fast.value, before + FAST.decode(payload, numel))
        # Same arithmetic as the reference up to float32 rounding and the lean residual: a value
        # that lands on a rounding tie may take the neighbouring int4 code, and error feedback
        # carries the difference (value + residual is what the update meant); the int8 residual
        # keeps it to half of 1/254 of its block's scale.
        unit = fast.residual_scales.repeat_interleave(FAST.block_size)[:numel] / 254
        assert torch.all((fast.value + lean_residual(fast) - ref.value - ref.residual).abs() <= 0.51 * unit + 1e-6)
        # A block's scale may be one float32 ulp apart (the fused step rounds its absmax
        # differently): scales within that, codes apart only at such ties.
        blocks = -(-numel // FAST.block_size)
        scales, ref_scales = (np.frombuffer(p, "<f4", count=blocks) for p in (payload, ref_payload))
        assert np.allclose(scales, ref_scales, rtol=1e-5, atol=0), (scales, ref_scales)
        codes, ref_codes = (np.frombuffer(p, np.uint8, offset=4 * blocks) for p in (payload, ref_payload))
        assert np.count_nonzero(codes != ref_codes) <= 2 + len(payload) // 100
        assert fast.version == ref.version == r + 1
        # Go on from the same state: the reference holds the lean state in float32.
        ref.value, ref.residual = fast.value.clone(), lean_residual(fast)
        ref.momentum = None if fast.momentum is None else fast.momentum.float()


def lean_residual(frag: GlobalFragment) -> torch.Tensor:
    """The fused path's int8 residual in float32 (units of its block's scale / 254)."""
    unit = frag.residual_scales.repeat_interleave(FAST.block_size)[: frag.value.numel()] / 254
    return frag.residual.float() * unit


CONCURRENT = """
import math, threading, torch
from ddiloco.core.shared import kernels
from ddiloco.core.sync_side.accumulate import RoundAccumulator
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.sync_side.merge import merge_rule
codec = get_codec("int4", block_size=128)
numel = 1 << 20
payload = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.01)
results = []
def shard():
    acc = RoundAccumulator(numel, codec, merge_rule("rda"))
    for m in range(30):
        acc.add(m, payload, 1.0 + m, acc.measure(payload))
    total, factor, _ = acc.accumulated()
    results.append(torch.from_numpy(total * factor))
threads = [threading.Thread(target=shard) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert len(results) == 3 and all(torch.equal(r, results[0]) for r in results)
"""


def test_kernels_launched_from_several_threads_at_once_neither_crash_nor_mix():
    """Two shards hosted in one process call the kernels from their own core threads; numba's
    workqueue pool aborts the process on concurrent launches unless they are serialized. Run
    in a child so that an abort fails this test, not the whole suite."""
    done = subprocess.run([sys.executable, "-c", CONCURRENT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_compiling_up_front_covers_the_types_a_round_uses():
    """A synchronizer compiles before it serves; a type it missed (payload arrays are read-only)
    would compile during the first contribution and stall the first rounds for seconds."""
    kernels.compile_kernels()
    compiled = [kernels._stats_block, kernels._axpy_block, kernels.norm_squared, kernels._outer_step_block]
    before = [len(k.signatures) for k in compiled]
    numel = 1000
    fragment = GlobalFragment(value=torch.randn(numel), is_embedding=False,
                              accumulator=RoundAccumulator(numel, FAST, merge_rule("rda")))
    payload = FAST.encode(torch.randn(numel) * 0.01)
    fragment.accumulator.add(0, payload, 1.0, fragment.accumulator.measure(payload))
    fragment.close(NesterovSGD(lr=0.7, momentum=0.9), FAST, plain=False)
    assert [len(k.signatures) for k in compiled] == before


@pytest.mark.parametrize("rda", [True, False])
def test_coherence_is_one_for_aligned_and_one_over_root_m_for_orthogonal_gradients(rda: bool) -> None:
    """The round's coherence measures how much a plain average would shrink the step."""
    numel, m = 4096, 4
    aligned = RoundAccumulator(numel, FAST, merge_rule("rda" if rda else "mean"))
    orthogonal = RoundAccumulator(numel, FAST, merge_rule("rda" if rda else "mean"))
    direction = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    for k in range(m):
        same = FAST.encode(direction * (0.01 * (k + 1)))
        aligned.add(k, same, 1.0, aligned.measure(same))
        disjoint = torch.zeros(numel)  # disjoint supports: exactly orthogonal, equal norms
        disjoint[k * numel // m:(k + 1) * numel // m] = direction[:numel // m]
        payload = FAST.encode(disjoint * 0.01)
        orthogonal.add(k, payload, 1.0, orthogonal.measure(payload))
    assert aligned.accumulated().coherence == pytest.approx(1.0, abs=1e-4)
    assert orthogonal.accumulated().coherence == pytest.approx(1 / math.sqrt(m), rel=1e-3)


def test_mean_coherence_is_the_merged_norm_over_the_mean_norm() -> None:
    numel = 2048
    g = torch.Generator().manual_seed(5)
    acc = RoundAccumulator(numel, FAST, merge_rule("mean"))
    deltas, weights = [], [3.0, 1.0, 2.0]
    for k, w in enumerate(weights):
        payload = FAST.encode(torch.randn(numel, generator=g) * 0.02 + 0.01)
        deltas.append(FAST.decode(payload, numel))
        acc.add(k, payload, w, acc.measure(payload))
    w = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    want = merge_rule(MergeRuleName.MEAN).reference(deltas, w)
    mean_norm = sum(wi * float(torch.linalg.vector_norm(d.double())) for wi, d in zip(w.tolist(), deltas))
    assert acc.accumulated().coherence == pytest.approx(float(torch.linalg.vector_norm(want.double())) / mean_norm,
                                                         rel=1e-4)


@pytest.mark.parametrize("rule", MERGE_RULES)
def test_no_contribution_weighs_more_than_the_cap_times_the_lower_median_weight(rule):
    """The per-learner weight cap (protocol.max_weight_ratio): a member claiming 100 times the
    others' work counts for 4 times the round's lower-median weight; the others keep theirs."""
    numel = 512
    g = torch.Generator().manual_seed(3)
    payloads = [FAST.encode(torch.randn(numel, generator=g) * 0.01) for _ in range(3)]
    capped = RoundAccumulator(numel, FAST, merge_rule(rule))
    for m, (payload, weight) in enumerate(zip(payloads, (1.0, 2.0, 200.0))):
        capped.add(m, payload, weight, capped.measure(payload))
    assert capped.cap_weights(4.0) == 1
    want = reference([FAST.decode(p, numel) for p in payloads], [1.0, 2.0, 8.0], rule)
    assert torch.allclose(merged(capped), want, rtol=1e-4, atol=1e-7)
    assert capped.cap_weights(0.0) == 0  # 0: no cap


def test_open_rounds_hold_their_payloads_and_the_closes_share_one_buffer():
    """An open round costs its compressed payloads, not a float32 accumulator: eight fragments
    with rounds open hold about 8 × 4 int4 payloads, and closing them one after the other
    borrows one buffer (the memory a 1B-parameter synchronizer is sized by)."""
    import tracemalloc

    from ddiloco.core.sync_side.accumulate import BufferPool

    numel, fragments, learners = 1 << 20, 8, 4
    g = torch.Generator().manual_seed(5)
    payloads = [FAST.encode(torch.randn(numel, generator=g) * 0.01) for _ in range(learners)]
    pool = BufferPool()
    rounds = [RoundAccumulator(numel, FAST, merge_rule("rda"), pool) for _ in range(fragments)]
    fp32 = 4 * numel
    tracemalloc.start()
    try:
        for acc in rounds:
            for m, payload in enumerate(payloads):
                acc.add(m, payload, 1.0 + m, acc.measure(payload))
        held, _ = tracemalloc.get_traced_memory()
        assert held < fp32 // 4  # the payloads are the callers' bytes: the rounds add only bookkeeping
        tracemalloc.reset_peak()
        for acc in rounds:
            assert acc.accumulated().factor > 0
            acc.clear()
        _, peak = tracemalloc.get_traced_memory()
        assert fp32 <= peak - held < 1.5 * fp32  # one buffer for all eight closes
    finally:
        tracemalloc.stop()



@pytest.mark.parametrize("rule", MERGE_RULES)
def test_a_capped_weight_leaves_the_other_contributions_whole(rule):
    """A member claiming a weight 10^12 times the others' is capped at the close; the merge is the
    reference with the capped weight. (When contributions were added on arrival, the cap was a
    float32 correction subtracted from a sum dominated by the huge weight, and the honest Δs
    were lost in its rounding.)"""
    numel, c = 4096, get_codec("int4", block_size=128)
    g = torch.Generator().manual_seed(3)
    acc = RoundAccumulator(numel, c, merge_rule(rule))
    payloads = [c.encode(torch.randn(numel, generator=g) * 0.01) for _ in range(3)]
    weights = [1000.0, 1200.0, 1e15]
    for m, (payload, weight) in enumerate(zip(payloads, weights)):
        acc.add(m, payload, weight, acc.measure(payload))
    assert acc.cap_weights(4.0) == 1
    want = reference([c.decode(p, numel) for p in payloads], [1000.0, 1200.0, 4 * 1200.0], rule)
    assert torch.allclose(merged(acc), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
