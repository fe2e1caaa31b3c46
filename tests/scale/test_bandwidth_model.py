"""The bandwidth model: the paper's figures from stated inputs, scaling laws, consistency."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ddiloco.core.shared.errors import ConfigError
from ddiloco.scale.bandwidth_model import (
    GBIT,
    PRESET_LINKS_GBPS,
    BandwidthInputs,
    decoupled_step_s,
    dp_step_s,
    evaluate,
    learner_bytes_per_step,
    parse_params,
    preset,
    required_bps,
    with_overrides,
)


def test_paper_8dc_reproduces_198_vs_0_84_gbps():
    result = evaluate(preset("paper-8dc"))
    assert result.dp_gbps == pytest.approx(198.0, rel=0.03)
    assert result.decoupled_gbps == pytest.approx(0.84, rel=0.03)
    assert result.reduction > 200


def test_paper_12b_fits_in_2_to_5_gbps_and_beats_data_parallel_by_20x():
    result = evaluate(preset("paper-12b-4regions"), PRESET_LINKS_GBPS["paper-12b-4regions"])
    assert result.decoupled_gbps <= 2.0
    assert [link.link_gbps for link in result.links] == [2.0, 5.0]
    for link in result.links:
        assert link.decoupled_utilization == pytest.approx(1.0)
        assert link.speedup > 20.0


def test_required_bandwidth_is_exactly_where_utilization_reaches_the_target():
    x = preset("paper-8dc")
    for step_time in (dp_step_s, decoupled_step_s):
        link = required_bps(x, step_time)
        assert x.step_s / step_time(x, link) == pytest.approx(x.target_utilization, rel=1e-6)
        assert x.step_s / step_time(x, 0.9 * link) < x.target_utilization


def test_scaling_with_size_step_bits_and_period():
    base = evaluate(preset("paper-8dc"))
    bigger = evaluate(replace(preset("paper-8dc"), params=20e9))
    slower = evaluate(replace(preset("paper-8dc"), step_s=4.0))
    longer_period = evaluate(replace(preset("paper-8dc"), inner_steps=80))
    eight_bit = evaluate(replace(preset("paper-8dc"), bits=8.0))
    assert bigger.dp_gbps == pytest.approx(2 * base.dp_gbps, rel=1e-6)
    assert bigger.decoupled_gbps == pytest.approx(2 * base.decoupled_gbps, rel=1e-6)
    assert slower.dp_gbps == pytest.approx(base.dp_gbps / 2, rel=1e-6)
    assert longer_period.decoupled_gbps == pytest.approx(base.decoupled_gbps / 2, rel=1e-6)
    assert longer_period.dp_gbps == pytest.approx(base.dp_gbps, rel=1e-6)
    assert eight_bit.decoupled_gbps == pytest.approx(2 * base.decoupled_gbps, rel=1e-6)


def test_one_site_needs_no_wide_area_link():
    result = evaluate(replace(preset("paper-8dc"), sites=1), (1.0,))
    assert result.dp_gbps == result.decoupled_gbps == 0.0
    assert result.links[0].speedup == 1.0


def test_latency_hurts_a_short_overlap_and_can_make_dp_unreachable():
    far = replace(preset("paper-8dc"), latency_s=0.5)
    assert required_bps(far, dp_step_s) == math.inf  # 14 hops of 0.5 s exceed the whole budget
    short = replace(far, overlap_steps=0)
    assert required_bps(short, decoupled_step_s) > required_bps(far, decoupled_step_s)


def test_learner_bytes_per_step_counts_payload_and_block_scales():
    x = preset("paper-8dc")
    assert learner_bytes_per_step(x) == pytest.approx(10e9 * 4 / 40 / 8)
    blocked = replace(x, block_size=128)  # one float32 scale per 128 values, as the runtime codec
    assert learner_bytes_per_step(blocked) == pytest.approx(10e9 * (4 + 32 / 128) / 40 / 8)


def test_speedup_on_a_link_is_the_ratio_of_step_times():
    x = preset("paper-12b-4regions")
    link = evaluate(x, (5.0,)).links[0]
    assert link.speedup == pytest.approx(dp_step_s(x, 5 * GBIT) / decoupled_step_s(x, 5 * GBIT))


def test_parse_params_and_overrides():
    assert parse_params("12B") == 12e9
    assert parse_params("350M") == 350e6
    assert parse_params("1.5e10") == 1.5e10
    assert with_overrides(preset("paper-8dc"), sites=4, step_s=None).sites == 4
    with pytest.raises(ConfigError):
        parse_params("twelve billion")


@pytest.mark.parametrize(
    "call",
    [
        lambda: preset("paper-9dc"),
        lambda: BandwidthInputs(params=0),
        lambda: BandwidthInputs(step_s=-1.0),
        lambda: BandwidthInputs(sites=0),
        lambda: BandwidthInputs(target_utilization=1.5),
        lambda: BandwidthInputs(latency_s=-0.1),
        lambda: BandwidthInputs(inner_steps=0),
        lambda: BandwidthInputs(fragments=0),
        lambda: evaluate(preset("paper-8dc"), (-2.0,)),
        lambda: with_overrides(preset("paper-8dc"), colour="blue"),
    ],
)
def test_invalid_inputs_raise_config_error(call):
    with pytest.raises(ConfigError):
        call()
