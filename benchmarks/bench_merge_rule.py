"""The merge rule as M grows: RDA against the plain token-weighted mean, M = 4, 8, 16.

Equal total tokens for every M (the preset's budget), no failures, the same seeds for both
rules. Besides eval loss, each run reports how aligned the learners' outer gradients were
when they were merged: a round's coherence is ‖Σ w_m x_m‖ / Σ w_m ‖x_m‖ (unit directions
for RDA, the Δ_m themselves for the mean), averaged over the rounds that merged two or more
contributions. For the mean rule it is the merged Δ's norm over the learners' mean norm, the
shrinkage RDA undoes (RDA's ratio is 1 by construction); for M orthogonal outer gradients it
would be 1/√M. ``pairwise cosine`` is what a coherence c over n equal-norm contributions
implies for the average cosine between two of them: (c²n² − n) / (n(n − 1)).

    python benchmarks/bench_merge_rule.py --json docs/results/merge_rule_small.json   # ~25 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from stamp import load_now, stamp

from ddiloco.settings.config_sources import PRESETS, build_config
from ddiloco.sim.experiment import run_virtual

RULES = ("rda", "mean")


def pairwise_cosine(coherence: float, width: float) -> float:
    return (coherence**2 * width**2 - width) / (width * (width - 1))


def run_one(preset: str, rule: str, learners: int, seed: int) -> dict[str, float]:
    overrides = (f"protocol.merge={rule}", f"run.learners={learners}", f"run.seed={seed}", "faults.mtbf_s=0",
                 "train.evals=2")
    summary, _ = run_virtual(build_config(preset=preset, overrides=overrides), check_invariants=False)
    return {key: summary[key] for key in ("eval_loss", "merge_coherence", "merge_width", "tokens")}


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help=f"one of {', '.join(PRESETS)} (default small)")
    parser.add_argument("--learners", default="4,8,16", help="values of M, comma-separated (default 4,8,16)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per setting (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    stamped = stamp(__file__, argv)
    if args.preset not in PRESETS:
        raise SystemExit(f"bench_merge_rule: error: --preset {args.preset!r}: choose from {', '.join(PRESETS)}")
    try:
        ms = [int(m) for m in args.learners.split(",")]
    except ValueError:
        ms = []
    if not ms or min(ms) < 2:
        raise SystemExit(f"bench_merge_rule: error: --learners {args.learners!r}: integers of at least 2")
    if args.seeds < 1:
        raise SystemExit(f"bench_merge_rule: error: --seeds {args.seeds}: must be positive")
    torch.set_num_threads(1)
    console = Console(width=150)
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=len(ms) * len(RULES) * args.seeds)
        for m in ms:
            for rule in RULES:
                runs = []
                for seed in range(args.seeds):
                    runs.append(run_one(args.preset, rule, m, seed))
                    progress.advance(task)
                coherence = statistics.fmean(r["merge_coherence"] for r in runs)
                width = statistics.fmean(r["merge_width"] for r in runs)
                rows.append({"learners": m, "rule": rule, "runs": runs,
                             "eval_loss_mean": round(statistics.fmean(r["eval_loss"] for r in runs), 4),
                             "coherence_mean": round(coherence, 4), "width_mean": round(width, 2),
                             "pairwise_cosine": round(pairwise_cosine(coherence, width), 3),
                             "mean_norm_ratio": round(coherence, 4) if rule == "mean" else 1.0})
    table = Table(title=f"merge rule, {args.preset} preset, equal tokens, {args.seeds} seeds")
    for column in ("M", "rule", "eval loss mean [min, max]", "coherence", "contributions / round",
                   "pairwise cosine", "merged / mean norm", "1/√M"):
        table.add_column(column)
    for r in rows:
        table.add_row(str(r["learners"]), r["rule"], spread([x["eval_loss"] for x in r["runs"]]),
                      f"{r['coherence_mean']:.3f}", f"{r['width_mean']:.2f}", f"{r['pairwise_cosine']:.3f}",
                      f"{r['mean_norm_ratio']:.3f}", f"{r['learners'] ** -0.5:.3f}")
    console.print(table)
    by = {(r["learners"], r["rule"]): r["eval_loss_mean"] for r in rows}
    for m in ms:
        console.print(f"M={m}: mean/RDA eval-loss ratio {by[(m, 'mean')] / by[(m, 'rda')]:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**stamped, "preset": args.preset, "seeds": args.seeds, "rows": rows,
                                               "load_after": load_now()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
