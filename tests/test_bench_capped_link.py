"""``benchmarks/bench_capped_link.py`` without a real run: the learner's rate read from its progress
file's successive contents, the ratios, the two command lines, and the one line without root."""

from __future__ import annotations

import os

import bench_capped_link as bench
import pytest


def samples(first: float = 100.0, seconds: float = 10.0, rate: float = 10.0, ms_in_step: float = 2.0) -> list[dict]:
    """What a learner stepping ``rate`` steps/s writes every 0.5 s, then its write after the loop."""
    out = []
    for i in range(1, int(seconds / 0.5) + 1):
        t = first + 0.5 * i
        steps = int(round(rate * 0.5 * i)) + 1
        out.append({"steps": steps, "tokens": steps * 8, "time": t, "first_step_time": first,
                    "contributions_sent": steps // 4, "updates_applied": steps // 5,
                    "step_overhead_s": steps * ms_in_step / 1e3})
    out.append({"steps": out[-1]["steps"] + 3, "tokens": 0, "time": first + seconds + 5, "first_step_time": first})
    return out


def test_the_rate_is_the_training_loops_own_after_the_warmup_and_before_the_flush():
    r = bench.training_rate(samples(), warmup_s=3.0)
    assert r.steps_per_s == pytest.approx(10.0)
    assert r.window == pytest.approx((3.0, 10.0))  # the write after the loop (3 more steps, 5 s later) is not used
    assert r.steps == 101 - 31 and r.contributions_sent == 101 // 4 - 31 // 4 and r.updates_applied == 101 // 5 - 31 // 5
    assert r.step_ms == pytest.approx(2.0)
    assert r.wall == pytest.approx((103.0, 110.0))
    # The order the files were read in does not matter; an older learner's file without the
    # time inside ``runtime.step`` gives no figure for it, not a wrong one.
    older = [{k: v for k, v in s.items() if k != "step_overhead_s"} for s in reversed(samples())]
    assert bench.training_rate(older, warmup_s=3.0).step_ms is None


def test_too_short_a_run_says_so_in_one_line():
    with pytest.raises(ValueError, match=r"trained 10.0s, not 9s of warm-up and 2s of window \(a longer --time\)"):
        bench.training_rate(samples(), warmup_s=9.0)
    with pytest.raises(ValueError, match="never took a step"):
        bench.training_rate([{"steps": 0, "tokens": 0, "time": 1.0, "first_step_time": None}], warmup_s=0.0)


def test_ratios_pair_each_learner_with_itself_and_the_links_rate_is_cut_to_the_window():
    pairs = [{"capped": {"learner-0": 9.8, "learner-1": 5.0}, "uncapped": {"learner-0": 10.0, "learner-1": 5.0}},
             {"capped": {"learner-0": 10.5, "learner-2": 1.0}, "uncapped": {"learner-0": 10.0}}]
    assert bench.ratios(pairs) == pytest.approx([0.98, 1.0, 1.05])
    assert bench.spread([0.98, 1.0, 1.05]) == {"median": 1.0, "min": 0.98, "max": 1.05}
    timeline = [{"time": t, "links": {"learner-0": {"up": 1000 * t, "down": 3000 * t}}} for t in range(10)]
    assert bench.link_rates(timeline, "learner-0", (2.5, 7.5)) == pytest.approx({"up": 1000, "down": 3000})
    rates = bench.link_rates(timeline, "learner-0", (2.5, 2.9))
    assert rates["up"] != rates["up"]  # no two rows in the window: NaN, not a rate


def test_the_capped_and_uncapped_runs_differ_only_in_the_cap(tmp_path):
    args = bench.build_parser().parse_args(["--rate", "2mbit", "--seed", "3", "--set", "protocol.period=4"])
    args.time = 30.0
    capped, uncapped = bench.run_command(args, True, tmp_path), bench.run_command(args, False, tmp_path)
    i = capped.index("--link-rate")
    assert capped[i:i + 2] == ["--link-rate", "2mbit"] and capped[:i] + capped[i + 2:] == uncapped
    assert ["--hosts", "netns"] == uncapped[uncapped.index("--hosts"):uncapped.index("--hosts") + 2]
    assert "protocol.period=4" in uncapped and "model.d_model=128" in uncapped  # bench_runtime's medium model


def test_without_root_it_fails_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["--pairs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_capped_link: --hosts netns needs root")


def test_the_medians_say_where_a_capped_learners_time_went():
    def run(kind: str, rate: float, step_ms: float | None, cores: float) -> "bench.Run":
        r = bench.Rate(rate, 100, (3.0, 13.0), 10, 10, (0.0, 10.0), step_ms)
        return bench.Run(kind, rates={"learner-0": r},
                         cpu={"learner-0": {"training_thread": cores, "other_threads": 0.01, "machine": 2.0}})

    runs = [{"capped": run("capped", 9.0, 0.2, 0.9), "uncapped": run("uncapped", 10.0, 0.4, 1.0)},
            {"capped": run("capped", 8.0, None, 0.8), "uncapped": run("uncapped", 10.0, 0.2, 1.0)}]
    assert bench.where_the_time_went(runs) == {"ms/step inside runtime.step": (0.2, 0.3),
                                               "training thread CPU ms/step": (100.0, 100.0),
                                               "cores it got": (0.85, 1.0), "cores busy on the machine": (2.0, 2.0)}
