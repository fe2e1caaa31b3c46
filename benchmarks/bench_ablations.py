"""The paper's orderings at this project's scale: mixed hardware, merge rule, codecs.

Every run is the `small` preset on the virtual cluster, seed 0, printed as
one table row (eval loss, goodput, uptime, rounds, bytes up) under its experiment:

1. mixed hardware — half the learners 18% slower, with jitter: K = M, K = 1 without a
   grace window, K = 1 with it (equal virtual time);
2. merge rule — RDA against the plain weighted mean, M = 4 and 8 (equal tokens);
3. codecs — int4, bf16, int2, int1 for the outer gradients (equal tokens).

    python benchmarks/bench_ablations.py            # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from stamp import load_now, stamp

from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual

EXPERIMENTS: dict[str, list[tuple[str, tuple[str, ...], dict[str, Any]]]] = {
    "mixed hardware (half the learners 18% slower, jitter 0.1), 400 virtual s": [
        (label, ("cluster.slow_fraction=0.5", "cluster.slow_factor=1.18", "cluster.jitter=0.1", *sets),
         {"run__time_s": 400.0})
        for label, sets in (
            ("K=M", ("protocol.quorum=4",)),
            ("K=1, no grace", ("protocol.quorum=1", "protocol.grace_gamma=0.0")),
            ("K=1, grace", ("protocol.quorum=1",)),
        )
    ],
    "merge rule (equal tokens)": [
        (f"{rule}, M={m}", (f"protocol.merge={rule}",), {"run__learners": m, "run__tokens": m * 400 * 16 * 64})
        for m in (4, 8)
        for rule in ("rda", "mean")
    ],
    "codec of the outer gradients (equal tokens)": [
        (codec, (f"protocol.codec={codec}",), {"run__tokens": 4 * 400 * 16 * 64})
        for codec in ("bf16", "int4", "int2", "int1")
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    stamped = stamp(__file__)
    torch.set_num_threads(1)
    rows = []
    for title, runs in EXPERIMENTS.items():
        print(f"\n{title}")
        print(f"  {'setting':<16} {'eval loss':>9} {'goodput':>8} {'uptime':>7} {'rounds':>7} {'MB up':>7}")
        for label, sets, flags in runs:
            summary, _ = run_virtual(build_config(preset="small", overrides=("train.evals=4", *sets), **flags),
                                     check_invariants=False)
            row = {"experiment": title, "setting": label, **{k: summary[k] for k in (
                "eval_loss", "goodput", "uptime", "bytes_up", "tokens", "virtual_time_s")},
                   "rounds": sum(summary["rounds_closed"].values())}
            rows.append(row)
            print(f"  {label:<16} {row['eval_loss']:9.4f} {row['goodput']:8.1%} {row['uptime']:7.1%} "
                  f"{row['rounds']:7d} {row['bytes_up'] / 1e6:7.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**stamped, "rows": rows, "load_after": load_now()}, f, indent=2)


if __name__ == "__main__":
    main()
