"""Decoupled DiLoCo against its baselines on the virtual cluster, side by side.

Three measurements, each printed as a table with ratios and written to JSON:

1. parity: no failures, equal tokens — eval loss of Decoupled DiLoCo (M=4, K=1) / data
   parallel, on the default preset;
2. failures: a failure rate at which non-elastic data parallel's goodput falls below 50% —
   goodput, uptime and eval loss of all four modes at equal virtual time through the same
   failure trace, over five seeds with medians and spread (a short run sees few failures, so
   one seed is a lottery); on the `small` preset so that several seeds fit;
3. determinism: the same seed twice gives the same weights hash; another seed does not.

    python benchmarks/bench_modes.py                         # everything (~40 min on 2 cores)
    python benchmarks/bench_modes.py --part failures         # seeds 0-4 (~25 min)
    python benchmarks/bench_modes.py --quick                 # tiny preset, a minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from stamp import load_now, stamp

from ddiloco.outputs.run_plot import plot_runs
from ddiloco.settings.config import MODES, Config
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual
from ddiloco.workload.workload import Workload

FAILURES = dict(faults__mtbf_s=150.0, faults__downtime_s=12.0, run__time_s=600.0)


def run_modes(base: Config, modes: tuple[str, ...]) -> tuple[dict[str, dict[str, Any]], dict[str, list]]:
    workload = Workload.build(base)
    summaries, curves = {}, {}
    for mode in modes:
        config = replace(base, run=replace(base.run, mode=mode)).validate()
        summary, rows = run_virtual(config, workload=workload, check_invariants=False)
        summaries[mode], curves[mode] = summary, rows
        print(f"  {mode:<10} eval_loss {summary['eval_loss']:.4f}  goodput {summary['goodput']:6.1%}  "
              f"uptime {summary['uptime']:6.1%}  tokens {summary['tokens']:>10,}  "
              f"virtual {summary['virtual_time_s']:7.0f}s  wall {summary['wall_time_s']:6.1f}s", flush=True)
    return summaries, curves


def parity(preset: str, seed: int, out: Path) -> dict[str, Any]:
    print(f"1. parity: no failures, equal tokens ({preset} preset, seed {seed})")
    summaries, curves = run_modes(build_config(preset=preset, run__seed=seed), ("decoupled", "dp"))
    ratio = summaries["decoupled"]["eval_loss"] / summaries["dp"]["eval_loss"]
    print(f"  eval loss decoupled / dp = {ratio:.4f}  (target: within 1.02)")
    plot_runs(out / f"parity_{preset}.png", curves, title=f"No failures, equal tokens ({preset} preset)")
    return {"summaries": summaries, "loss_ratio": ratio}


def failures(quick: bool, seeds: list[int], out: Path) -> dict[str, Any]:
    preset, overrides, settings = "tiny", (), dict(faults__mtbf_s=40.0, faults__downtime_s=4.0, run__time_s=100.0)
    if not quick:
        preset, overrides, settings = "small", ("train.evals=8",), FAILURES
    print(f"2. failures: MTBF {settings['faults__mtbf_s']:g}s, downtime {settings['faults__downtime_s']:g}s "
          f"per learner, {settings['run__time_s']:g} virtual seconds, seeds {seeds}")
    per_seed = []
    for seed in seeds:
        print(f" seed {seed}")
        config = build_config(preset=preset, overrides=overrides, run__seed=seed, **settings)
        summaries, curves = run_modes(config, MODES)
        per_seed.append(summaries)
        plot_runs(out / f"failures_seed{seed}.png", curves, title=f"Same failure trace (seed {seed}): MTBF "
                  f"{settings['faults__mtbf_s']:g}s, downtime {settings['faults__downtime_s']:g}s per learner")
    keys = ("goodput", "uptime", "eval_loss")
    spread = {mode: {key: {"median": statistics.median(s[mode][key] for s in per_seed),
                           "min": min(s[mode][key] for s in per_seed), "max": max(s[mode][key] for s in per_seed),
                           "mean": statistics.fmean(s[mode][key] for s in per_seed)} for key in keys}
              for mode in MODES}
    print(f"  over {len(seeds)} seeds, median (min-max):")
    for mode, m in spread.items():
        print(f"  {mode:<10} " + "  ".join(
            f"{key} {m[key]['median']:.4f} ({m[key]['min']:.4f}-{m[key]['max']:.4f})" for key in keys))
    d = spread["decoupled"]
    for other in ("dp", "dp-elastic"):
        o = spread[other]
        print(f"  decoupled vs {other}: median goodput {d['goodput']['median']:.1%} vs {o['goodput']['median']:.1%}, "
              f"median eval loss {d['eval_loss']['median']:.4f} vs {o['eval_loss']['median']:.4f} "
              f"(ratio {d['eval_loss']['median'] / o['eval_loss']['median']:.4f}); decoupled's loss lower in "
              f"{sum(s['decoupled']['eval_loss'] < s[other]['eval_loss'] for s in per_seed)} of {len(seeds)} seeds")
    return {"settings": settings, "overrides": list(overrides), "seeds": seeds, "per_seed": per_seed,
            "spread": spread}


def determinism(seed: int) -> dict[str, Any]:
    print("3. determinism (tiny preset)")
    hashes = [run_virtual(build_config(preset="tiny", run__seed=s), check_invariants=False)[0]["weights_sha256"]
              for s in (seed, seed, seed + 1)]
    print(f"  seed {seed} twice: {'same' if hashes[0] == hashes[1] else 'DIFFERENT'} weights; "
          f"seed {seed + 1}: {'different' if hashes[2] != hashes[0] else 'SAME'} weights")
    return {"hashes": hashes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset: a smoke run of the benchmark")
    parser.add_argument("--part", choices=("all", "parity", "failures", "determinism"), default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds of the failure runs")
    parser.add_argument("--out", default="docs/results", help="where the JSON and plots go")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = "tiny" if args.quick else "default"
    started = time.perf_counter()
    results: dict[str, Any] = {**stamp(__file__), "preset": preset}
    if args.part in ("all", "parity"):
        results["parity"] = parity(preset, args.seeds[0], out)
    if args.part in ("all", "failures"):
        results["failures"] = failures(args.quick, args.seeds, out)
    if args.part in ("all", "determinism"):
        results["determinism"] = determinism(args.seeds[0])
    results["wall_time_s"] = round(time.perf_counter() - started, 1)
    results["load_after"] = load_now()
    name = f"bench_modes_{args.part}_{preset}{'_seeds' + '-'.join(map(str, args.seeds)) if args.part == 'failures' else ''}.json"
    (out / name).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}/{name} in {results['wall_time_s']:.0f}s")


if __name__ == "__main__":
    main()
