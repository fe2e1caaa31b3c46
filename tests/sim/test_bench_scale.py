"""``benchmarks/bench_scale.py`` at tiny sizes: the table, the plot, resuming, bad sizes; the warm start."""

from __future__ import annotations

import json
import math

import bench_scale as bench
import pytest

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_warm_started

ARGS = ["--preset", "test", "--device", "cpu", "--sizes", "7k"]


@pytest.mark.slow
def test_a_plan_gives_one_row_per_run_the_gaps_and_a_plot_and_resumes(tmp_path, capsys):
    out = tmp_path / "scale"
    assert bench.main([*ARGS, "--variants", "base,dp-warm-start", "--out", str(out)]) == 0
    table = json.loads((out / "table.json").read_text())
    runs = {(r["mode"], r["variant"]): r for r in table["runs"]}
    assert set(runs) == {("dp", "base"), ("decoupled", "base"), ("decoupled", "dp-warm-start"), ("diloco", "base"),
                         ("diloco", "dp-warm-start")}
    assert all(r["params"] == 7472 and r["tokens"] == 7472 and math.isfinite(r["eval_loss"]) for r in runs.values())
    gap = {(g["mode"], g["variant"]): g for g in table["gaps"]}
    base = gap[("decoupled", "base")]
    dp_loss = runs[("dp", "base")]["eval_loss"]
    assert math.isclose(base["gap_pct"], 100 * (base["eval_loss"] / dp_loss - 1), abs_tol=1e-3)
    assert (out / "gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert bench.main([*ARGS, "--variants", "base,dp-warm-start", "--out", str(out)]) == 0  # everything is done
    assert "eval loss" not in capsys.readouterr().out
    assert len(json.loads((out / "table.json").read_text())["runs"]) == len(runs)


def test_an_estimate_times_every_run_of_the_plan_and_trains_nothing_else(tmp_path, capsys):
    out = tmp_path / "scale"
    assert bench.main([*ARGS, "--modes", "dp,decoupled", "--estimate", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["dp", "decoupled"] and lines[-1].startswith("projected: ")
    assert not (out / "table.json").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["--sizes", "16384x64"], "size '16384x64' ("),
    (["--sizes", "huge"], "unknown size 'huge'"),
    (["--variants", "magic"], "--variants: unknown 'magic'"),
    (["--precision", "fp32", "--modes", "dp,sgd"], "--modes: unknown 'sgd'"),
])
def test_bad_input_is_one_line_exit_2_and_creates_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "scale"
    assert bench.main(["--preset", "test", "--device", "cpu", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_a_size_that_does_not_fit_names_what_it_needs():
    size = bench.parse_size("16384x64", bench.PLANS["gpu"])
    assert size.params > 2e11
    with pytest.raises(ConfigError, match=r"16384x64.*GiB on cpu"):
        bench.check_fits([size], bench.torch.device("cpu"), "fp32")


def test_a_warm_start_spends_one_budget_and_ends_in_the_protocol_mode():
    config = build_config(preset="tiny", overrides=("run.tokens=6144", "train.evals=2", "train.schedule=cosine"))
    summary, rows = run_warm_started(config, 0.25)
    step = 4 * 8 * 32  # one data-parallel step of the tiny preset, in tokens
    assert summary["mode"] == "decoupled" and 6144 // 4 <= summary["warm_start_tokens"] < 6144 // 4 + step
    assert summary["tokens"] >= 6144 and math.isfinite(summary["eval_loss"])
    assert [r["tokens"] for r in rows] == sorted(r["tokens"] for r in rows)
    with pytest.raises(ConfigError, match="must be in"):
        run_warm_started(config, 1.0)
