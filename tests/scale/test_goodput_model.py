"""The at-scale goodput simulator: calibration, shapes, analytic limits and validation."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from ddiloco.core.shared.errors import ConfigError
from ddiloco.scale.goodput_fit import fit_recovery_constants, held_out_goodput
from ddiloco.scale.goodput_model import (
    CALIBRATION_CHIPS,
    DEFAULT_CHIPS,
    DEFAULT_CONFIGS,
    PUBLISHED_GOODPUT_1_2M,
    ClusterModel,
    expected_max_normal,
    parse_config,
    simulate_cell,
    simulate_table,
    smallest_learners,
)
from ddiloco.scale.small_cluster import predict_small_cluster

MODEL = ClusterModel()
SHORT_S = 6 * 3600.0


def goodput_by_cell(rows):
    return {(r.config, r.chips): r.goodput for r in rows}


@pytest.fixture(scope="module")
def default_table():
    return simulate_table(DEFAULT_CONFIGS, DEFAULT_CHIPS, MODEL, seeds=3, seed=0)


def test_defaults_reproduce_published_column_within_3_points():
    rows = simulate_table(DEFAULT_CONFIGS, [CALIBRATION_CHIPS], MODEL, seeds=5, seed=0)
    for row in rows:
        published = PUBLISHED_GOODPUT_1_2M[row.config]
        assert abs(row.goodput - published) <= 0.03, (row.config, row.goodput, published)


def test_dp_goodput_falls_as_the_cluster_grows(default_table):
    cells = goodput_by_cell(default_table)
    for config in ("dp", "dp-elastic", "decoupled-M4"):
        series = [cells[(config, n)] for n in DEFAULT_CHIPS]
        assert all(a > b for a, b in zip(series, series[1:])), (config, series)


def test_decoupled_goodput_rises_with_learners(default_table):
    cells = goodput_by_cell(default_table)
    for n in DEFAULT_CHIPS:
        configs = ("dp-elastic", "decoupled-M2", "decoupled-M4", "decoupled-M8", "decoupled-M16")
        series = [cells[(c, n)] for c in configs]
        assert all(a < b for a, b in zip(series, series[1:])), (n, series)
        assert cells[("dp", n)] < cells[("dp-elastic", n)]


def test_uptime_is_about_one_for_four_learners_or_more(default_table):
    for row in default_table:
        if row.chips == CALIBRATION_CHIPS and row.config in ("decoupled-M4", "decoupled-M8", "decoupled-M16"):
            assert row.uptime > 0.995, row
        if row.config == "dp":
            assert row.uptime < 0.9


def test_more_frequent_failures_cost_goodput():
    monthly = replace(MODEL, mtbi_s=30 * 86_400.0)
    for config in ("dp-elastic", "decoupled-M8"):
        yearly_row = simulate_table([config], [600_000], MODEL, seeds=2, horizon_s=SHORT_S)[0]
        monthly_row = simulate_table([config], [600_000], monthly, seeds=2, horizon_s=SHORT_S)[0]
        assert monthly_row.goodput < yearly_row.goodput - 0.1


def test_stalls_alone_match_the_renewal_formula():
    # No stragglers, instant slice recovery, tiny steps: goodput = 1 / (1 + rate * stall).
    model = ClusterModel(straggler_sigma=0.0, recovery_mean_s=1e-3, step_s=1e-3, checkpoint_interval_s=1e-3,
                         reconfig_s=20.0, restart_s=60.0)
    for config, stall_s in (("dp", 60.0), ("dp-elastic", 20.0), ("decoupled-M4", 20.0)):
        learners = parse_config(config).learners
        rate = 1_200_000 / model.mtbi_s / learners
        row = simulate_table([config], [1_200_000], model, seeds=3)[0]
        assert row.goodput == pytest.approx(1.0 / (1.0 + rate * stall_s), abs=0.01), config


def test_recovering_slices_cost_their_stationary_share():
    model = ClusterModel(straggler_sigma=0.0, reconfig_s=1e-3, step_s=1e-3, recovery_mean_s=3600.0)
    row = simulate_table(["dp-elastic"], [1_200_000], model, seeds=3)[0]
    down_per_up = model.slice_chips / model.mtbi_s * model.recovery_mean_s
    assert row.goodput == pytest.approx(1.0 / (1.0 + down_per_up), abs=0.005)


def test_stragglers_cost_more_in_bigger_lock_step_groups():
    calm, jittery = replace(MODEL, straggler_sigma=0.0), replace(MODEL, straggler_sigma=0.05)
    cost = {}
    for config in ("dp-elastic", "decoupled-M16"):
        a = simulate_cell(parse_config(config), 600_000, calm, horizon_s=SHORT_S, seed=3).goodput
        b = simulate_cell(parse_config(config), 600_000, jittery, horizon_s=SHORT_S, seed=3).goodput
        cost[config] = (a - b) / a
    assert cost["dp-elastic"] > cost["decoupled-M16"] > 0


def test_expected_max_of_normals_matches_known_values():
    for n, expected in ((1, 0.0), (2, 1 / math.sqrt(math.pi)), (10, 1.538753), (1000, 3.241436)):
        assert expected_max_normal(n) == pytest.approx(expected, abs=1e-4)


def test_same_seed_same_result_and_seeds_differ():
    spec = parse_config("decoupled-M4")
    a = simulate_cell(spec, 300_000, MODEL, horizon_s=SHORT_S, seed=7)
    assert simulate_cell(spec, 300_000, MODEL, horizon_s=SHORT_S, seed=7) == a
    assert simulate_cell(spec, 300_000, MODEL, horizon_s=SHORT_S, seed=8) != a


def test_quorum_of_all_learners_costs_goodput_and_uptime():
    any_one = simulate_table(["decoupled-M4"], [1_200_000], MODEL, seeds=2, horizon_s=SHORT_S)[0]
    all_four = simulate_table(["decoupled-M4"], [1_200_000], replace(MODEL, quorum=4), seeds=2, horizon_s=SHORT_S)[0]
    assert all_four.uptime < any_one.uptime - 0.2
    assert all_four.goodput < any_one.goodput - 0.05


def test_grace_window_costs_nothing_until_it_exceeds_the_overlap_slack():
    def goodput(grace_s):
        model = replace(MODEL, grace_s=grace_s)
        return simulate_table(["decoupled-M4"], [1_200_000], model, seeds=2, horizon_s=SHORT_S)[0].goodput

    adaptive = simulate_table(["decoupled-M4"], [1_200_000], MODEL, seeds=2, horizon_s=SHORT_S)[0].goodput
    assert goodput(0.0) == adaptive == goodput(MODEL.slack_s)
    assert goodput(MODEL.slack_s + 5.0) < adaptive - 0.02


def test_smallest_learners_answers_the_planning_question():
    m, goodput = smallest_learners(0.85, CALIBRATION_CHIPS, MODEL, seeds=2, horizon_s=SHORT_S)
    assert m == 8 and goodput >= 0.85
    m_small, _ = smallest_learners(0.85, 150_000, MODEL, seeds=2, horizon_s=SHORT_S)
    assert m_small is not None and m_small < 8
    none, best = smallest_learners(0.999, CALIBRATION_CHIPS, MODEL, seeds=1, horizon_s=SHORT_S, max_learners=64)
    assert none is None and 0.9 < best < 0.999


def test_fit_recovers_known_constants_from_their_own_column():
    truth = replace(MODEL, reconfig_s=25.0, restart_s=80.0, recovery_mean_s=3000.0)
    targets = {r.config: r.goodput for r in simulate_table(DEFAULT_CONFIGS, [CALIBRATION_CHIPS], truth, seeds=1,
                                                           horizon_s=SHORT_S)}
    fitted = fit_recovery_constants(MODEL, seeds=1, horizon_s=SHORT_S, targets=targets)
    assert fitted.reconfig_s == pytest.approx(25.0, rel=0.1)
    assert fitted.restart_s == pytest.approx(80.0, rel=0.1)
    rows = simulate_table(DEFAULT_CONFIGS, [CALIBRATION_CHIPS], fitted, seeds=1, horizon_s=SHORT_S)
    for row in rows:
        assert row.goodput == pytest.approx(targets[row.config], abs=0.01)


def test_each_elastic_cell_is_predicted_within_a_few_points_by_a_fit_that_did_not_see_it():
    predicted = held_out_goodput(MODEL, seeds=1, horizon_s=SHORT_S)
    assert set(predicted) == set(PUBLISHED_GOODPUT_1_2M) - {"dp"}
    for config, goodput in predicted.items():
        assert goodput == pytest.approx(PUBLISHED_GOODPUT_1_2M[config], abs=0.05), config


@pytest.mark.parametrize(
    "call",
    [
        lambda: simulate_table(["dp"], [0], MODEL),
        lambda: simulate_table(["dp"], [-100], MODEL),
        lambda: simulate_table(["decoupled-M16"], [8], MODEL),
        lambda: simulate_table(["decoupled-M2"], [150_000], replace(MODEL, quorum=3)),
        lambda: simulate_table(["zero-bubble"], [150_000], MODEL),
        lambda: simulate_table(["decoupled-M0"], [150_000], MODEL),
        lambda: simulate_table(["dp"], [150_000], MODEL, seeds=0),
        lambda: simulate_cell(parse_config("dp"), 150_000, MODEL, horizon_s=-1.0),
        lambda: ClusterModel(mtbi_s=-1.0),
        lambda: ClusterModel(mtbi_s=0.0),
        lambda: ClusterModel(reconfig_s=-5.0),
        lambda: ClusterModel(recovery_mean_s=float("nan")),
        lambda: ClusterModel(grace_s=-1.0),
        lambda: ClusterModel(quorum=0),
        lambda: ClusterModel(slice_chips=0),
        lambda: smallest_learners(1.5, 150_000, MODEL),
    ],
)
def test_invalid_parameters_raise_config_error(call):
    with pytest.raises(ConfigError):
        call()


def test_small_cluster_prediction_matches_a_direct_monte_carlo():
    rng = np.random.default_rng(1)
    mtbf_s, downtime_s, step_s, h = 60.0, 10.0, 1.0, 8
    up_s = rng.exponential(mtbf_s, 50_000)
    steps = np.floor(up_s / step_s).astype(int)
    offsets = np.arange(1, h + 1)  # fragment p is sent after steps p, p + H, ...
    last_sent = np.where(steps[:, None] >= offsets, offsets + (steps[:, None] - offsets) // h * h, 0)
    measured = last_sent.mean(axis=1).sum() * step_s / (up_s.sum() + downtime_s * up_s.size)
    predicted = predict_small_cluster(learners=4, mtbf_s=mtbf_s, downtime_s=downtime_s, step_s=step_s, inner_steps=h)
    assert predicted.goodput == pytest.approx(measured, abs=0.005)
    assert predicted.availability == pytest.approx(60 / 70)
    assert predicted.uptime == pytest.approx(1 - (10 / 70) ** 4)


def test_small_cluster_without_failures_is_perfect_and_validates():
    assert predict_small_cluster(learners=2, mtbf_s=math.inf, downtime_s=5, step_s=1, inner_steps=4).goodput == 1.0
    with pytest.raises(ConfigError):
        predict_small_cluster(learners=2, mtbf_s=100, downtime_s=-1, step_s=1, inner_steps=4)
    with pytest.raises(ConfigError):
        predict_small_cluster(learners=2, mtbf_s=100, downtime_s=1, step_s=1, inner_steps=4, quorum=3)
