"""One learner on a long link: is its late work worth merging (issue 42, ``core/shared/staleness.py``)?

Learners on the virtual cluster, the same virtual (wall) time for every run; three near
learners on the default link, and a fourth whose round trip spans ``k`` times
``protocol.staleness_max`` rounds of a fragment (k = 2, 4, 8 by default). The runs:

- ``without``: the three near learners alone (the far learner's chip left out);
- ``near``: a fourth learner on the default link too (what any fourth learner does here);
- ``refuse``: the far learner, every contribution more than ``staleness_max`` versions late
  refused (the rule before issue 42: ``protocol.staleness_reach=1``, no bound in time:
  ``protocol.staleness_leases=0``);
- ``weighted``: the far learner, late work merged with weight (staleness_max + 1) / (lag + 1)
  at any lag (``protocol.staleness_reach`` far above it);
- ``default``: the far learner under the shipped rule (the same weight, merged up to
  ``staleness_reach`` x ``staleness_max`` versions late or, beyond that, when its base version
  was superseded less than ``staleness_leases`` leases ago).

Three things make the comparison sound, each found wrong in the first version of this
benchmark, which read a fourth near learner as 0.5 worse than three:

- **One held-out set.** The corpus split's chunk size depends on the number of shards, so a
  3-learner run and a 4-learner run were evaluated on different held-out bytes (three near
  learners measured 2.43 on their own split, 2.87 on the four-shard one, at 4 virtual s). Every run here splits the corpus into four shards and evaluates on that
  split's held-out data; ``without`` trains learners 0-2 on shards 0-2.
- **Paired seeds.** A seed fixes the initial weights and every learner's data order; the
  loss of one setting moves by 0.1-0.3 between seeds, far more than the rules differ. Each
  row's figure is the per-seed difference against ``without`` of the same seed, with its
  mean, spread and the count of seeds where the run with the far learner is no worse.
- **One torch thread.** The cluster runs every learner in one process; torch's default
  thread pool on a shared 2-core machine made each step 30 times slower (the first version
  took 40 minutes).

``--json FILE`` writes every run and the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from stamp import load_now, stamp

from ddiloco.settings.config_sources import PRESETS, build_config
from ddiloco.sim.harness import Recorder
from ddiloco.sim.virtual_cluster import VirtualCluster
from ddiloco.workload.corpus import load_corpus
from ddiloco.workload.workload import Workload

FAR = "learner-3"
SHARDS = 4
"""Every run's corpus split: four shards, so every run is evaluated on the same held-out data."""
RULES = {"refuse": ("protocol.staleness_reach=1", "protocol.staleness_leases=0"),
         "weighted": ("protocol.staleness_reach=1000",), "default": ()}
STEP_S = 0.01
"""The virtual step time: a fragment's round every period x this."""
EVAL_BATCHES = 32
LEASE_S = 2.0
"""The lease, and so the bound in time (``protocol.staleness_leases`` leases): shorter than the
tiny preset's 10 s, so that within a run of 8 virtual seconds the far learner's lateness outlasts
it, as it would in any run of hours."""
PERIOD = 3
"""H: shorter than the tiny preset's 6, so that a round trip of 8 x staleness_max rounds (0.96 s)
fits eight times in a run of 8 virtual seconds."""


def run_one(preset: str, rule: str, spans: int, seed: int, time_s: float, data: bytes) -> dict[str, float]:
    """``spans``: the far learner's round trip in units of staleness_max rounds (``rule`` "without": no far learner)."""
    common = (f"run.seed={seed}", f"run.time_s={time_s}", "run.tokens=0", f"cluster.step_time_s={STEP_S}",
              f"protocol.period={PERIOD}", f"protocol.lease_s={LEASE_S}", "faults.mtbf_s=0",
              f"train.eval_batches={EVAL_BATCHES}",
              *RULES.get(rule, ()))
    learners = 3 if rule == "without" else SHARDS
    config = build_config(preset=preset, overrides=(f"run.learners={learners}", *common))
    split = build_config(preset=preset, overrides=(f"run.learners={SHARDS}", *common))
    workload = dataclasses.replace(Workload.build(split, None, data=data), config=config)
    round_s = config.protocol.period * STEP_S
    cluster = VirtualCluster(workload, Recorder(config, workload))
    if rule in RULES:
        cluster.network.set_latency(FAR, spans * config.protocol.staleness_max * round_s / 2)
    result = cluster.run()
    far = [lr for sync in cluster.syncs for lr in sync.core.status().learners if lr.learner_id == FAR]
    return {"eval_loss": result["final"]["eval_loss"], "goodput": result["final"]["goodput"],
            "far_accepted": sum(lr.accepted for lr in far),
            "far_refused_steps": sum(sum(lr.refused_steps.values()) for lr in far),
            "honest_refused_steps": result["honest_refused_steps"], "merge_width": result["merge_width"] or 0.0}


def summarize(rule: str, spans: int, runs: list[dict[str, float]], without: list[dict[str, float]]) -> dict:
    """Means and spreads over seeds, and the eval loss paired against ``without`` seed by seed."""
    row: dict = {"rule": rule, "spans": spans}
    for key in runs[0]:
        values = [r[key] for r in runs]
        row[f"{key}_mean"] = round(statistics.fmean(values), 4)
        row[f"{key}_spread"] = round(max(values) - min(values), 4)
    diffs = [r["eval_loss"] - w["eval_loss"] for r, w in zip(runs, without)]
    row["vs_without"] = [round(d, 4) for d in diffs]
    row["vs_without_mean"] = round(statistics.fmean(diffs), 4)
    row["no_worse_seeds"] = sum(d <= 0 for d in diffs)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per setting (default 3)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first seed (default 0): more seeds for a row without running the first ones again")
    parser.add_argument("--spans", default="2,4,8", help="the far round trip in staleness_max rounds (default 2,4,8)")
    parser.add_argument("--time-s", type=float, default=8.0, help="virtual seconds per run (default 8)")
    parser.add_argument("--rules", default="near,refuse,weighted,default",
                        help="runs besides without, which every row is paired with (default near,refuse,weighted,default)")
    parser.add_argument("--json", metavar="FILE", help="write the runs and rows as JSON")
    args = parser.parse_args(argv)
    stamped = stamp(__file__, argv)
    try:
        spans = [int(s) for s in args.spans.split(",")]
    except ValueError:
        raise SystemExit(f"bench_long_link: error: --spans {args.spans!r}: comma-separated whole numbers") from None
    if args.preset not in PRESETS or args.seeds < 1 or args.first_seed < 0 or args.time_s <= 0 or min(spans) < 1:
        raise SystemExit("bench_long_link: error: --preset must be a preset, --seeds, --time-s and --spans positive, "
                         "--first-seed not negative")
    rules = [r for r in args.rules.split(",") if r]
    if not set(rules) <= {"near", *RULES}:
        raise SystemExit(f"bench_long_link: error: --rules {args.rules!r}: choose from near, {', '.join(RULES)}")
    torch.set_num_threads(1)
    base = build_config(preset=args.preset)
    data = load_corpus(base.train.corpus or None, max_bytes=base.train.corpus_max_bytes)
    console = Console()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    cases = [("near", 0)] if "near" in rules else []
    cases += [(rule, k) for k in spans for rule in RULES if rule in rules]
    without = [run_one(args.preset, "without", 0, seed, args.time_s, data) for seed in seeds]
    rows = [summarize("without", 0, without, without)]
    console.print(f"without: eval loss {[round(w['eval_loss'], 4) for w in without]}")
    for rule, k in cases:
        runs = [run_one(args.preset, rule, k, seed, args.time_s, data) for seed in seeds]
        row = summarize(rule, k, runs, without)
        rows.append(row)
        console.print(f"{rule:9} x{k}: eval loss {row['eval_loss_mean']:.4f} (±{row['eval_loss_spread']:.4f}), "
                      f"against without {row['vs_without']}  goodput {row['goodput_mean']:.3f}  far learner: "
                      f"{row['far_accepted_mean']:.0f} accepted, {row['far_refused_steps_mean']:.0f} steps refused")
    table = Table(title=f"one learner on a long link ({args.preset}, {args.time_s:g} virtual s, {args.seeds} seeds, "
                        "paired with the three near learners alone)")
    for col in ("rule", "round trip (x staleness_max rounds)", "eval loss (mean ±spread)", "minus without (mean)",
                "no worse (seeds)", "goodput", "far accepted", "far steps refused"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["rule"], str(r["spans"] or "-"), f"{r['eval_loss_mean']:.4f} ±{r['eval_loss_spread']:.4f}",
                      f"{r['vs_without_mean']:+.4f}", f"{r['no_worse_seeds']}/{args.seeds}", f"{r['goodput_mean']:.3f}",
                      f"{r['far_accepted_mean']:.0f}", f"{r['far_refused_steps_mean']:.0f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({**stamped, "load_end": load_now(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
