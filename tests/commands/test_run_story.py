"""`ddiloco run`'s main job: failures and a slow learner by default, a live view, a closing summary."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from ddiloco.cli import build_parser, main
from ddiloco.commands.display import what_happened
from ddiloco.commands.live_view import live_view
from ddiloco.commands.options import config_from_args
from ddiloco.settings.config_sources import MAIN_JOB, PRESETS, build_config
from ddiloco.sim.experiment import run_virtual


@pytest.mark.parametrize("preset", list(PRESETS))
def test_only_ddiloco_run_adds_failures_and_a_slow_learner(preset):
    plain = build_config(preset=preset)
    assert plain.faults.mtbf_s == 0 and plain.cluster.slow_fraction == 0  # compare, benchmarks, tests
    story = build_config(preset=preset, main_job=True)
    assert story.faults.mtbf_s == MAIN_JOB[preset]["faults"]["mtbf_s"] > 0
    assert story.cluster.slow_fraction == 0.25
    off = build_config(preset=preset, main_job=True, overrides=("cluster.slow_fraction=0",), faults__mtbf_s=0.0)
    assert off.faults.mtbf_s == 0 and off.cluster.slow_fraction == 0


def test_compare_keeps_the_failure_free_default():
    args = build_parser().parse_args(["compare", "--preset", "tiny"])
    assert args.func.__module__ == "ddiloco.commands.compare"
    assert config_from_args(args).faults.mtbf_s == 0


def run_cli(tmp_path, capsys, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "out"
    assert main(["run", "--preset", "tiny", "--out", str(out), *argv]) == 0
    return json.loads((out / "summary.json").read_text()), capsys.readouterr().out


def panel_words(summary: dict) -> str:
    """The closing summary's text, as one line."""
    return " ".join(" ".join(what_happened(summary, slow_factor=1.18)).split())


def test_run_tells_what_happened(tmp_path, capsys):
    summary, stdout = run_cli(tmp_path, capsys)
    events = summary["events"]
    assert events["failures"] > 0 and events["rejoins"] > 0 and events["slow_learners"] == [3]
    assert 0 < events["longest_pause_s"] < summary["virtual_time_s"]
    assert "what happened" in stdout and "ddiloco run (tiny preset, seed 0)" in stdout
    words = panel_words(summary)
    assert f"{events['failures']} learner failures and {events['rejoins']} rejoins" in words
    assert "learner-3 on 18% slower hardware" in words
    assert f"longest pause without one was {events['longest_pause_s']:.1f} virtual s" in words
    assert f"Goodput {summary['goodput']:.0%}" in words and f"eval loss {summary['eval_loss']:.4f}" in words
    config = (tmp_path / "out" / "config.toml").read_text()
    assert f"mtbf_s = {MAIN_JOB['tiny']['faults']['mtbf_s']}" in config and "slow_fraction = 0.25" in config


def test_mtbf_0_and_no_slow_fraction_turn_the_story_off(tmp_path, capsys):
    summary, _ = run_cli(tmp_path, capsys, "--mtbf", "0", "--set", "cluster.slow_fraction=0")
    events = summary["events"]
    assert (events["failures"], events["rejoins"], events["slow_learners"]) == (0, 0, [])
    assert "faults" not in summary or "learner_crash" not in summary["faults"]
    assert "0 learner failures and 0 rejoins: no failures in this run" in panel_words(summary)
    assert "slower hardware" not in panel_words(summary)


def test_the_live_view_on_a_terminal_trains_the_same_weights():
    config = build_config(preset="tiny", main_job=True, run__tokens=6144)
    screen = io.StringIO()
    with live_view("decoupled M=4", Console(file=screen, force_terminal=True, width=120)) as (progress, observer):
        watched, _ = run_virtual(config, progress=progress, observer=observer)
    unwatched, _ = run_virtual(config)
    assert watched["weights_sha256"] == unwatched["weights_sha256"]
    shown = screen.getvalue()
    assert "learner-3" in shown and "slow" in shown and "fragment versions" in shown


def test_plain_progress_where_there_is_no_terminal():
    config = build_config(preset="tiny", main_job=True, run__tokens=6144)
    screen = io.StringIO()
    with live_view("decoupled M=4", Console(file=screen, force_terminal=False)) as (progress, observer):
        _, rows = run_virtual(config, progress=progress, observer=observer)
    lines = screen.getvalue().splitlines()
    assert len(lines) == len(rows) and "\x1b" not in screen.getvalue()  # one line per evaluation
    assert lines[-1].startswith("decoupled M=4  100%") and "failures" in lines[-1]
