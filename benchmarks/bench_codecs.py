"""int4 against bf16 and fp32, on both directions at once, over several seeds.

Each run is the `small` preset on the virtual cluster (M = 4, no failures, equal tokens),
with one codec for the outer gradients (uplink) and the same for the merged updates
(downlink). A seed fixes the model's initialization, the data order and the step-time
jitter, so runs of one seed differ only by their codec: the per-seed difference against
fp32 is the comparison, and the spread of fp32 itself across seeds is the noise floor it
is read against.

    python benchmarks/bench_codecs.py --json docs/results/codecs_small.json   # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from stamp import load_now, stamp

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual

CODECS = ("fp32", "bf16", "int4")
TOKENS = 4 * 400 * 16 * 64  # as bench_ablations' codec rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", metavar="FILE", help="also write every run and the summary as JSON")
    args = parser.parse_args()
    stamped = stamp(__file__)
    torch.set_num_threads(1)
    runs: dict[str, dict[int, dict]] = {codec: {} for codec in CODECS}
    for seed in args.seeds:
        for codec in CODECS:
            config = build_config(preset="small", overrides=("train.evals=4", f"protocol.codec={codec}",
                                                             f"protocol.downlink_codec={codec}"),
                                  run__tokens=TOKENS, run__seed=seed)
            summary, _ = run_virtual(config, check_invariants=False)
            runs[codec][seed] = {k: summary[k] for k in ("eval_loss", "bytes_up", "bytes_down", "tokens")}
            print(f"  seed {seed} {codec:<5} eval loss {summary['eval_loss']:.4f}  MB up {summary['bytes_up'] / 1e6:6.2f}"
                  f"  MB down {summary['bytes_down'] / 1e6:6.2f}", flush=True)
    fp32 = [runs["fp32"][s]["eval_loss"] for s in args.seeds]
    noise = max(fp32) - min(fp32)
    summary = {}
    print(f"\n{'codec':<6} {'median loss':>11} {'range':>17} {'median vs fp32 (same seed)':>27} {'MB up+down':>11}")
    for codec in CODECS:
        losses = [runs[codec][s]["eval_loss"] for s in args.seeds]
        diffs = [runs[codec][s]["eval_loss"] - runs["fp32"][s]["eval_loss"] for s in args.seeds]
        mb = statistics.median((runs[codec][s]["bytes_up"] + runs[codec][s]["bytes_down"]) / 1e6 for s in args.seeds)
        summary[codec] = {"median_loss": statistics.median(losses), "min_loss": min(losses), "max_loss": max(losses),
                          "median_diff_vs_fp32": statistics.median(diffs), "diffs_vs_fp32": diffs, "mb_up_down": mb}
        print(f"{codec:<6} {statistics.median(losses):11.4f} {min(losses):8.4f}-{max(losses):.4f} "
              f"{statistics.median(diffs):+27.4f} {mb:11.2f}")
    print(f"noise floor: fp32's eval loss ranges over {noise:.4f} across seeds {args.seeds}")
    if args.json:
        Path(args.json).write_text(json.dumps({**stamped, "preset": "small", "tokens": TOKENS, "seeds": args.seeds,
                                               "runs": runs, "summary": summary, "fp32_seed_range": noise,
                                               "load_after": load_now()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
