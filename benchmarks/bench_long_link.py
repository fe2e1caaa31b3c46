"""One learner on a long link: is its late work worth merging (issue 42, ``core/staleness.py``)?

Four learners on the virtual cluster, three on the default link and one whose round trip spans
``k`` times ``protocol.staleness_max`` rounds of a fragment (k = 2, 4, 8 by default), the same
virtual time for every run. Three ways to run it:

- ``refuse``: every contribution more than ``staleness_max`` versions late is refused (the
  rule before issue 42: ``protocol.staleness_reach=1``); the far learner's work is burnt;
- ``weighted``: late work is merged with weight (staleness_max + 1) / (lag + 1), never refused
  (``protocol.staleness_reach`` far above the lag);
- ``without``: the three near learners alone (the far learner's chip left out);
- ``near``: four learners, the fourth on the default link too (what the far learner's link costs).

Each row: eval loss, goodput, the far learner's accepted contributions and refused steps, mean
and spread over seeds. ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ddiloco.config_sources import PRESETS, build_config
from ddiloco.sim.harness import Recorder
from ddiloco.sim.virtual_cluster import VirtualCluster
from ddiloco.workload.workload import Workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import load_now, stamp  # noqa: E402

FAR = "learner-3"
RULES = {"refuse": ("protocol.staleness_reach=1",), "weighted": ("protocol.staleness_reach=1000",)}
STEP_S = 0.01
"""The virtual step time: a fragment's round every period x this."""
EVAL_BATCHES = 16
"""The tiny preset evaluates on 2 batches: its eval loss moved by ±0.5 between seeds of one setting."""
PERIOD = 3
"""H: shorter than the tiny preset's 6, so that a round trip of 8 x staleness_max rounds (0.96 s)
fits four times in a run of 4 virtual seconds."""


def run_one(preset: str, rule: str, spans: int, seed: int, time_s: float) -> dict[str, float]:
    """``spans``: the far learner's round trip in units of staleness_max rounds (``rule`` "without": no far learner)."""
    learners = 3 if rule == "without" else 4
    overrides = (f"run.learners={learners}", f"run.seed={seed}", f"run.time_s={time_s}", "run.tokens=0",
                 f"cluster.step_time_s={STEP_S}", f"protocol.period={PERIOD}", "faults.mtbf_s=0",
                 f"train.eval_batches={EVAL_BATCHES}",
                 *RULES.get(rule, ()))
    config = build_config(preset=preset, overrides=overrides)
    round_s = config.protocol.period * STEP_S
    workload = Workload.build(config, None)
    cluster = VirtualCluster(workload, Recorder(config, workload))
    if rule in RULES:
        cluster.network.set_latency(FAR, spans * config.protocol.staleness_max * round_s / 2)
    result = cluster.run()
    far = [lr for sync in cluster.syncs for lr in sync.core.status().learners if lr.learner_id == FAR]
    return {"eval_loss": result["final"]["eval_loss"], "goodput": result["final"]["goodput"],
            "far_accepted": sum(lr.accepted for lr in far),
            "far_refused_steps": sum(sum(lr.refused_steps.values()) for lr in far),
            "honest_refused_steps": result["honest_refused_steps"], "merge_width": result["merge_width"] or 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per setting (default 3)")
    parser.add_argument("--spans", default="2,4,8", help="the far round trip in staleness_max rounds (default 2,4,8)")
    parser.add_argument("--time-s", type=float, default=4.0, help="virtual seconds per run (default 4)")
    parser.add_argument("--rules", default="without,near,refuse,weighted",
                        help="which runs (default without,near,refuse,weighted)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    stamped = stamp(__file__, argv)
    try:
        spans = [int(s) for s in args.spans.split(",")]
    except ValueError:
        raise SystemExit(f"bench_long_link: error: --spans {args.spans!r}: comma-separated whole numbers") from None
    if args.preset not in PRESETS or args.seeds < 1 or args.time_s <= 0 or min(spans) < 1:
        raise SystemExit("bench_long_link: error: --preset must be a preset, --seeds, --time-s and --spans positive")
    console = Console()
    rules = args.rules.split(",")
    if not set(rules) <= {"without", "near", *RULES}:
        raise SystemExit(f"bench_long_link: error: --rules {args.rules!r}: choose from without, near, {', '.join(RULES)}")
    cases = [(rule, 0) for rule in ("without", "near") if rule in rules]
    cases += [(rule, k) for k in spans for rule in RULES if rule in rules]
    rows = []
    for rule, k in cases:
        runs = [run_one(args.preset, rule, k, seed, args.time_s) for seed in range(args.seeds)]
        row = {"rule": rule, "spans": k}
        for key in runs[0]:
            values = [r[key] for r in runs]
            row[f"{key}_mean"] = round(statistics.fmean(values), 4)
            row[f"{key}_spread"] = round(max(values) - min(values), 4)
        rows.append(row)
        console.print(f"{rule:9} x{k}: eval loss {row['eval_loss_mean']:.4f} (±{row['eval_loss_spread']:.4f})  "
                      f"goodput {row['goodput_mean']:.3f}  far learner's steps refused {row['far_refused_steps_mean']:.0f}")
    table = Table(title=f"one learner on a long link ({args.preset}, {args.time_s:g} virtual s, {args.seeds} seeds)")
    for col in ("rule", "round trip (x staleness_max rounds)", "eval loss", "goodput", "far accepted",
                "far steps refused"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["rule"], str(r["spans"] or "-"), f"{r['eval_loss_mean']:.4f} ±{r['eval_loss_spread']:.4f}",
                      f"{r['goodput_mean']:.3f}", f"{r['far_accepted_mean']:.0f}", f"{r['far_refused_steps_mean']:.0f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({**stamped, "load_end": load_now(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
