"""Decoupled DiLoCo against its baselines on the virtual cluster, side by side.

Three measurements, each printed as a table with ratios and written to JSON:

1. parity: no failures, equal tokens — eval loss of Decoupled DiLoCo (M=4, K=1) / data parallel;
2. failures: a failure rate at which non-elastic data parallel's goodput falls below 50% —
   goodput, uptime and eval loss of all four modes at equal virtual time, same failure trace;
3. determinism: the same seed twice gives the same weights hash; another seed does not.

    python benchmarks/bench_modes.py                 # the recorded results (~30 min on 2 cores)
    python benchmarks/bench_modes.py --quick         # tiny preset, a minute
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ddiloco.config import MODES, Config, build_config
from ddiloco.experiment import plot_runs, run_virtual
from ddiloco.sim.harness import Workload


def run_modes(base: Config, modes: tuple[str, ...]) -> tuple[dict[str, dict[str, Any]], dict[str, list]]:
    workload = Workload.build(base)
    summaries, curves = {}, {}
    for mode in modes:
        config = replace(base, run=replace(base.run, mode=mode)).validate()
        summary, rows = run_virtual(config, workload=workload)
        summaries[mode], curves[mode] = summary, rows
        print(f"  {mode:<10} eval_loss {summary['eval_loss']:.4f}  goodput {summary['goodput']:6.1%}  "
              f"uptime {summary['uptime']:6.1%}  tokens {summary['tokens']:>10,}  "
              f"virtual {summary['virtual_time_s']:7.0f}s  wall {summary['wall_time_s']:6.1f}s", flush=True)
    return summaries, curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset: a smoke run of the benchmark")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results", help="where the JSON and plots go")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = "tiny" if args.quick else "default"
    started = time.perf_counter()
    results: dict[str, Any] = {"preset": preset, "seed": args.seed}

    print(f"1. parity: no failures, equal tokens ({preset} preset)")
    base = build_config(preset=preset, run__seed=args.seed)
    parity, parity_curves = run_modes(base, ("decoupled", "dp"))
    ratio = parity["decoupled"]["eval_loss"] / parity["dp"]["eval_loss"]
    print(f"  eval loss decoupled / dp = {ratio:.4f}  (must be within 1.02)")
    results["parity"] = {"summaries": parity, "loss_ratio": ratio}
    plot_runs(out / f"parity_{preset}.png", parity_curves, title=f"No failures, equal tokens ({preset})")

    failures = dict(faults__mtbf_s=300.0, faults__downtime_s=40.0, run__time_s=400.0)
    if args.quick:
        failures = dict(faults__mtbf_s=40.0, faults__downtime_s=10.0, run__time_s=100.0)
    print(f"2. failures: MTBF {failures['faults__mtbf_s']:g}s, downtime {failures['faults__downtime_s']:g}s "
          f"per learner, {failures['run__time_s']:g} virtual seconds")
    base = build_config(preset=preset, run__seed=args.seed, **failures)
    chaos, chaos_curves = run_modes(base, MODES)
    d, dp = chaos["decoupled"], chaos["dp"]
    print(f"  goodput decoupled {d['goodput']:.1%} vs dp {dp['goodput']:.1%}  (must be >= 85% and < 50%)")
    print(f"  uptime decoupled {d['uptime']:.1%} (must be >= 99%)")
    print(f"  eval loss at equal virtual time: decoupled / dp = {d['eval_loss'] / dp['eval_loss']:.4f} (must be < 1)")
    results["failures"] = {"settings": failures, "summaries": chaos}
    plot_runs(out / f"failures_{preset}.png", chaos_curves,
              title=f"Same failure trace: MTBF {failures['faults__mtbf_s']:g}s, downtime {failures['faults__downtime_s']:g}s")

    print("3. determinism (tiny preset)")
    hashes = [run_virtual(build_config(preset="tiny", run__seed=s), check_invariants=False)[0]["weights_sha256"]
              for s in (args.seed, args.seed, args.seed + 1)]
    print(f"  seed {args.seed} twice: {'same' if hashes[0] == hashes[1] else 'DIFFERENT'} weights; "
          f"seed {args.seed + 1}: {'different' if hashes[2] != hashes[0] else 'SAME'} weights")
    results["determinism"] = {"hashes": hashes}

    results["wall_time_s"] = round(time.perf_counter() - started, 1)
    (out / f"bench_modes_{preset}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}/bench_modes_{preset}.json and plots in {results['wall_time_s']:.0f}s")


if __name__ == "__main__":
    main()
