"""`ddiloco goodput` and `ddiloco bandwidth` through the real dispatcher."""

from __future__ import annotations

import json

import pytest

from ddiloco.cli import main

FAST = ["--seeds", "2", "--horizon-hours", "6"]


def run_json(capsys, *argv: str):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_goodput_json_rows_have_the_documented_schema(capsys):
    rows = run_json(capsys, "goodput", "--chips", "150k", "1.2M", "--json", *FAST)
    assert {(r["config"], r["chips"]) for r in rows} == {
        (c, n) for c in ("dp", "dp-elastic", "decoupled-M2", "decoupled-M4", "decoupled-M8", "decoupled-M16")
        for n in (150_000, 1_200_000)
    }
    for row in rows:
        assert {"config", "chips", "goodput", "uptime", "goodput_std"} <= row.keys()
        assert 0.0 <= row["goodput"] <= 1.0 and 0.0 <= row["uptime"] <= 1.0 and row["goodput_std"] >= 0.0


def test_goodput_sweeps_failure_rates(capsys):
    rows = run_json(capsys, "goodput", "--chips", "600k", "--configs", "dp-elastic", "--mtbi-days", "90", "365.25",
                    "--json", *FAST)
    by_mtbi = {round(r["mtbi_days"], 2): r["goodput"] for r in rows}
    assert by_mtbi[90.0] < by_mtbi[365.25]


def test_goodput_table_and_plot(tmp_path, capsys):
    png = tmp_path / "goodput.png"
    assert main(["goodput", "--chips", "150k", "300k", "--plot", str(png), *FAST]) == 0
    out = capsys.readouterr().out
    assert "decoupled-M16" in out and "uptime" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_target_prints_the_smallest_m(capsys):
    answers = run_json(capsys, "goodput", "--chips", "1.2M", "--target-goodput", "0.85", "--json", *FAST)
    assert answers[0]["learners"] == 8 and answers[0]["goodput"] >= 0.85
    assert main(["goodput", "--chips", "1.2M", "--target-goodput", "0.85", *FAST]) == 0
    assert "M = 8" in capsys.readouterr().out


def test_bandwidth_presets_in_json(capsys):
    eight = run_json(capsys, "bandwidth", "--preset", "paper-8dc", "--json")
    assert eight["dp_gbps"] == pytest.approx(198, rel=0.03)
    assert eight["decoupled_gbps"] == pytest.approx(0.84, rel=0.03)
    twelve = run_json(capsys, "bandwidth", "--preset", "paper-12b-4regions", "--json")
    assert twelve["decoupled_gbps"] <= 2.0
    assert all(link["speedup"] > 20 for link in twelve["links"])
    custom = run_json(capsys, "bandwidth", "--params", "1B", "--sites", "2", "--link-gbps", "1", "--json")
    assert custom["inputs"]["params"] == 1e9 and custom["links"][0]["link_gbps"] == 1.0


def test_bandwidth_table(capsys):
    assert main(["bandwidth", "--preset", "paper-12b-4regions"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "data parallel" in out and "speed-up" in out
    assert "published: on 2 and 5 Gbit/s links, Decoupled DiLoCo trains more than 20x faster than data parallel" in out


def test_bandwidth_shows_the_published_figures_in_its_table(capsys):
    assert main(["bandwidth"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "published Gbit/s" in "".join(lines) and not any("{" in line for line in lines)
    (dp,) = [line.split("│")[1:-1] for line in lines if "data parallel" in line]
    (decoupled,) = [line.split("│")[1:-1] for line in lines if "Decoupled DiLoCo" in line]
    assert (dp[2].strip(), decoupled[2].strip()) == ("198", "0.84")


@pytest.mark.parametrize(
    "argv",
    [
        ["goodput", "--chips", "0"],
        ["goodput", "--chips=-150k"],
        ["goodput", "--chips", "-150k"],  # argparse reads it as an option: still one line, exit 2
        ["goodput", "--chips", "many"],
        ["goodput", "--chips", "10", "--configs", "decoupled-M16"],
        ["goodput", "--configs", "pipeline"],
        ["goodput", "--mtbi-days", "-1"],
        ["goodput", "--reconfig-s", "-3"],
        ["goodput", "--recovery-mean-s", "0"],
        ["goodput", "--quorum", "5", "--configs", "decoupled-M4"],
        ["goodput", "--target-goodput", "2"],
        ["goodput", "--plot", "/no/such/dir/x.png"],
        ["bandwidth", "--preset", "paper-9dc"],
        ["bandwidth", "--sites", "0"],
        ["bandwidth", "--step-s", "-2"],
        ["bandwidth", "--params=-5B"],
        ["bandwidth", "--link-gbps", "-1"],
    ],
)
def test_invalid_parameters_give_one_error_line_and_exit_2(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors (OneLineParser) exit directly
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddiloco: error: ")
