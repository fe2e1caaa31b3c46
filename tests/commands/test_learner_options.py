"""Issue 29, item 5: a learner's workload options apply to the run it joins, and a model mismatch names both sides."""

from __future__ import annotations

import argparse

from ddiloco.commands.learner import _resolve_config
from ddiloco.commands.learner_process import describe_model
from ddiloco.settings.config_sources import build_config


def args(**given) -> argparse.Namespace:
    defaults = {"preset": None, "config": None, "overrides": [], "corpus": None, "seed": None}
    return argparse.Namespace(**{**defaults, **given})


def test_one_set_option_changes_that_value_of_the_synchronizers_run_not_the_preset():
    """``--set protocol.quorum=2`` once switched the learner to the default preset silently, and
    it then failed on a shape the synchronizer did not have."""
    sync = build_config(preset="tiny", overrides=("run.learners=3",))
    config = _resolve_config(args(overrides=["protocol.quorum=2"]), sync.to_dict())
    assert config.model == sync.model and config.run.learners == 3
    assert config.protocol.quorum == 2


def test_a_model_is_described_by_its_size_for_errors_that_compare_two_sides():
    assert describe_model(build_config(preset="tiny")) == "d_model 32, 2 layers, 2 heads, seq_len 32"
