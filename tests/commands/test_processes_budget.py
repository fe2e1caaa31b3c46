"""Issue 57, item 3: ``ddiloco run --runtime processes --preset tiny --learners 2`` (the documented
real-process run) spent the tiny preset's 49,152 tokens in 1-2 s of training, before a round could
merge on a busy 2-core machine (eval loss 4.997, goodput 5% at load 5.5). Without a budget of its
own, a run of real processes on the tiny preset trains for a time instead."""

from __future__ import annotations

import pytest

from ddiloco.settings.config_sources import PROCESSES_TIME_S, build_config


def test_the_documented_run_of_real_processes_trains_for_a_time():
    run = build_config(preset="tiny", processes=True, run__learners=2).run
    assert (run.tokens, run.time_s) == (0, PROCESSES_TIME_S["tiny"])
    virtual = build_config(preset="tiny", run__learners=2).run
    assert virtual.tokens == 4 * 48 * 8 * 32 and virtual.time_s == 0  # the virtual cluster keeps its tokens


@pytest.mark.parametrize("budget", [{"run__tokens": 1000}, {"run__time_s": 5.0}, {"overrides": ("run.tokens=77",)}])
def test_a_budget_the_user_gives_is_kept(budget):
    run = build_config(preset="tiny", processes=True, **budget).run
    assert run.time_s != PROCESSES_TIME_S["tiny"] or run.tokens


def test_presets_without_a_training_time_keep_their_tokens():
    assert build_config(preset="small", processes=True).run.time_s == 0
