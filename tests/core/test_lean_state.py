"""The synchronizer's lean outer state (bf16 momentum, int8 residual) against an fp32 one.

The fused close keeps momentum in bf16 and the downlink residual in int8 (``core/shared/kernels.py``,
``core/sync_side/rounds.py``). Both roundings are local: what the int8 residual drops is at most half of
1/254 of a quantization step per round, and the bf16 momentum's relative error (2⁻⁹) decays
with the momentum itself. This test runs 200 rounds of the same contributions through the
fused close and through the fp32 reference step (``GlobalFragment.step``) and bounds how far
the two global models drift apart, relative to how far they moved: the documented tolerance
(docs/runtime.md, the synchronizer's memory) is ``DRIFT_MAX``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from protocol_helpers import merged

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.sync_side.accumulate import RoundAccumulator
from ddiloco.core.sync_side.merge import merge_rule
from ddiloco.core.sync_side.outer import NesterovSGD
from ddiloco.core.sync_side.rounds import GlobalFragment

INT4 = get_codec("int4", block_size=128)
DRIFT_MAX = 0.01
"""‖Θ_lean − Θ_fp32‖ / ‖Θ_fp32 − Θ_0‖ after 200 rounds: at most 1% of the distance moved."""


def run_rounds(frag: GlobalFragment, rounds: int, learners: int, seed: int, *, fused: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    numel = frag.value.numel()
    direction = torch.randn(numel, generator=g)
    outer = NesterovSGD(lr=0.4, momentum=0.9)
    for r in range(rounds):
        for m in range(learners):
            delta = 0.01 * (direction + 2.0 * torch.randn(numel, generator=g))
            payload = INT4.encode(delta)
            frag.accumulator.add(m, payload, 1000.0 + m, frag.accumulator.measure(payload))
        plain = r == rounds - 1
        if fused:
            frag.close(outer, INT4, plain=plain)
        else:
            delta = merged(frag.accumulator)
            frag.accumulator.clear()
            frag.step(delta, outer, INT4, plain=plain)


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_200_rounds_of_the_lean_state_stay_within_the_documented_tolerance_of_fp32(rule):
    numel = 20_000
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 0.02
    lean = GlobalFragment(value=start.clone(), is_embedding=False,
                          accumulator=RoundAccumulator(numel, INT4, merge_rule(rule)))
    fp32 = copy.deepcopy(lean)
    run_rounds(lean, 200, 4, seed=7, fused=True)
    run_rounds(fp32, 200, 4, seed=7, fused=False)
    assert lean.momentum.dtype == torch.bfloat16 and lean.residual.dtype == torch.int8
    assert fp32.momentum.dtype == torch.float32 and fp32.residual.dtype == torch.float32
    moved = float(torch.linalg.vector_norm(fp32.value - start))
    drift = float(torch.linalg.vector_norm(lean.value - fp32.value)) / moved
    print(f"{rule}: drift {drift:.2e} of the distance moved ({moved:.3f})")
    assert moved > 1.0  # the rounds did move the model
    assert drift <= DRIFT_MAX


def test_the_lean_state_holds_three_bytes_per_parameter_and_no_accumulator_between_rounds():
    numel = 4096
    frag = GlobalFragment(value=torch.zeros(numel), is_embedding=False,
                          accumulator=RoundAccumulator(numel, INT4, merge_rule("rda")))
    run_rounds(frag, 3, 2, seed=0, fused=True)
    held = sum(t.numel() * t.element_size() for t in (frag.momentum, frag.residual))
    assert held == 3 * numel
    assert frag.residual_scales.numel() == numel // 128
    assert frag.accumulator._acc is None  # given back to the pool at the close
