"""A synchronizer restarted from its checkpoint and round log (``GlobalFragment.replay``).

The round log keeps the update each merged round sent. Replayed after the checkpoint, it
gives Θ back bit for bit (Θ is the sum of the updates sent) and the outer momentum within
the documented tolerance (the log does not hold the error-feedback residual, so each
replayed round's momentum is off by that round's quantization error, fading by μ per
round); the run that goes on from the recovered state stays within ``DRIFT_MAX`` of the one
that never crashed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import FragmentUpdate
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.accumulate import RoundAccumulator
from ddiloco.core.sync_side.merge import merge_rule
from ddiloco.core.sync_side.outer import NesterovSGD
from ddiloco.core.sync_side.rounds import GlobalFragment
from ddiloco.core.sync_side.synchronizer import Synchronizer

INT4 = get_codec("int4", block_size=128)
OUTER = NesterovSGD(lr=0.4, momentum=0.9)
MOMENTUM_ERROR_MAX = 0.10
"""‖m_recovered − m‖ / ‖m‖ after replaying 20 rounds (docs/design.md, the round log)."""
DRIFT_MAX = 0.01
"""‖Θ_recovered − Θ‖ / ‖Θ − Θ_0‖ after 100 more rounds from the recovered state."""


def rounds(frag: GlobalFragment, count: int, seed: int, codec=INT4) -> list[bytes]:
    """``count`` rounds of four learners' contributions (a drift plus noise); the updates sent."""
    g = torch.Generator().manual_seed(seed)
    numel = frag.value.numel()
    direction = torch.randn(numel, generator=g)
    sent = []
    for _ in range(count):
        for m in range(4):
            payload = INT4.encode(0.01 * (direction + 2.0 * torch.randn(numel, generator=g)))
            frag.accumulator.add(m, payload, 1000.0 + m, frag.accumulator.measure(payload))
        sent.append(frag.close(OUTER, codec, plain=False)[0])
    return sent


def fragment(numel: int = 20_000, codec=INT4) -> GlobalFragment:
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 0.02
    return GlobalFragment(value=start, is_embedding=False, accumulator=RoundAccumulator(numel, INT4, merge_rule("rda")))


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_replaying_the_log_after_a_checkpoint_restores_theta_exactly_and_momentum_within_tolerance(codec):
    downlink = get_codec(codec, block_size=128)
    live = fragment()
    start = live.value.clone()
    rounds(live, 10, seed=3, codec=downlink)
    checkpoint = live.state_dict()
    logged = rounds(live, 20, seed=4, codec=downlink)

    recovered = fragment()
    recovered.load_state_dict(checkpoint, lean=codec == "int4")
    for payload in logged:
        recovered.replay(payload, OUTER, downlink, plain=False)

    assert recovered.version == live.version == 30
    assert torch.equal(recovered.value, live.value)  # bit for bit: what every learner holds
    error = float(torch.linalg.vector_norm(recovered.momentum.float() - live.momentum.float())
                  / torch.linalg.vector_norm(live.momentum.float()))
    print(f"{codec}: momentum off by {error:.2e} after 20 replayed rounds")
    assert error <= MOMENTUM_ERROR_MAX

    rounds(live, 100, seed=5, codec=downlink)
    rounds(recovered, 100, seed=5, codec=downlink)
    moved = float(torch.linalg.vector_norm(live.value - start))
    drift = float(torch.linalg.vector_norm(recovered.value - live.value)) / moved
    print(f"{codec}: drift {drift:.2e} of the distance moved ({moved:.3f}) 100 rounds after the recovery")
    assert moved > 1.0 and drift <= DRIFT_MAX


def test_the_drains_plain_step_replays_without_touching_the_momentum():
    live = fragment(4096)
    rounds(live, 3, seed=0)
    checkpoint = copy.deepcopy(live.state_dict())
    live.accumulator.add(0, INT4.encode(torch.full((4096,), 0.01)), 1.0, 1.0)
    payload, _ = live.close(OUTER, INT4, plain=True)
    recovered = fragment(4096)
    recovered.load_state_dict(checkpoint, lean=True)
    recovered.replay(payload, OUTER, INT4, plain=True)
    assert torch.equal(recovered.value, live.value)
    assert torch.equal(recovered.momentum, checkpoint["momentum"])


def test_a_synchronizer_replays_only_what_follows_its_state_and_names_a_gap():
    config = ProtocolConfig(period=4, fragments=1, quorum=1)
    sync = Synchronizer(config, [torch.zeros(256)], embedding_fragments=[])
    update = lambda version: FragmentUpdate(0, version, "int4", INT4.encode(torch.full((256,), 0.1)), 0)  # noqa: E731
    assert sync.replay_round(update(1), plain=False)
    assert not sync.replay_round(update(1), plain=False)  # already held (the checkpoint was newer)
    with pytest.raises(ValueError, match="from version 1 to 3"):
        sync.replay_round(update(3), plain=False)
    assert sync.versions() == (1,)
