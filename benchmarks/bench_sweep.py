"""Sweep protocol settings against data parallel at equal tokens, on a small model.

Each line is one virtual run of the ``small`` preset (no failures, M = 4, 400 inner steps
per learner of a d_model 64, 2-layer byte transformer): final eval loss, its ratio to data parallel's, the
lowest loss seen during the run, and how many rounds closed. This is how the defaults in
``ProtocolConfig`` were chosen; docs/results.md records the table.

    python benchmarks/bench_sweep.py                       # the recorded grid (~15 min on 2 busy cores)
    python benchmarks/bench_sweep.py "protocol.outer_lr=0.5" "train.lr=0.002,protocol.period=24"
"""

from __future__ import annotations

import argparse
import json

import torch
from stamp import load_now, stamp

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual

GRID = (
    "run.mode=dp",
    "run.mode=dp,train.lr=0.006",
    "",
    "protocol.outer_lr=0.7",
    "protocol.outer_lr=0.25",
    "protocol.merge=mean",
    "protocol.alpha=0.0",
    "protocol.quorum=4",
    "protocol.codec=fp32,protocol.downlink_codec=fp32",
    "run.mode=diloco",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", help="comma-separated --set overrides per run (default: the grid)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    stamped = stamp(__file__)
    torch.set_num_threads(1)
    rows = []
    reference = None
    print(f"{'settings':<70} {'final':>7} {'vs dp':>6} {'min':>7} {'rounds':>7}")
    for settings in args.settings or GRID:
        extra = tuple(s for s in settings.split(",") if s)
        config = build_config(preset="small", overrides=("train.evals=16", *extra))
        summary, metrics = run_virtual(config, check_invariants=False)
        if extra == ("run.mode=dp",):
            reference = summary["eval_loss"]
        ratio = summary["eval_loss"] / reference if reference else float("nan")
        row = {
            "settings": settings or "(defaults)",
            "eval_loss": summary["eval_loss"],
            "vs_dp": ratio,
            "min_eval_loss": min(r["eval_loss"] for r in metrics),
            "rounds": sum(summary.get("rounds_closed", {}).values()),
        }
        rows.append(row)
        print(f"{row['settings']:<70} {row['eval_loss']:7.4f} {ratio:6.3f} {row['min_eval_loss']:7.4f} "
              f"{row['rounds']:7d}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**stamped, "rows": rows, "load_after": load_now()}, f, indent=2)


if __name__ == "__main__":
    main()
