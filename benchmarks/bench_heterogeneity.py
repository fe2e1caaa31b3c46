"""Mixed hardware at the paper's shape: quorum K = M against K = 1, with and without the grace window.

Eight learners, four of them 18% slower, 10% step-time jitter, no failures, the same virtual
time for every setting (so a setting that idles trains fewer tokens). Three settings, as in
the paper's heterogeneity table: K = 8; K = 1 without a grace window (``grace_gamma = 0``);
K = 1 with the grace window (the default). With learners waiting (``protocol.max_wait_s``:
a learner that reaches t + τ steps without the update of the fragment it sent at t waits
for it, the paper's behaviour) and, for contrast, never waiting (our default).

Each row: goodput and eval loss, mean and spread over seeds. ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from stamp import load_now, stamp

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.config_sources import PRESETS, build_config
from ddiloco.sim.experiment import run_virtual

SETTINGS = {
    "K=8": ("protocol.quorum=8",),
    "K=1, no grace": ("protocol.quorum=1", "protocol.grace_gamma=0"),
    "K=1, grace": ("protocol.quorum=1",),
}
SHAPE = ("run.learners=8", "cluster.slow_fraction=0.5", "cluster.slow_factor=1.18", "cluster.jitter=0.10",
         "faults.mtbf_s=0")


def run_one(preset: str, setting: str, wait_s: float, seed: int, time_s: float) -> dict[str, float]:
    overrides = (*SHAPE, *SETTINGS[setting], f"protocol.max_wait_s={wait_s}", f"run.time_s={time_s}",
                 f"run.seed={seed}", "run.tokens=0")
    summary, _ = run_virtual(build_config(preset=preset, overrides=overrides))
    return {"goodput": summary["goodput"], "eval_loss": summary["eval_loss"], "tokens": summary["tokens"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per setting (default 3)")
    parser.add_argument("--time-s", type=float, default=400.0, help="virtual seconds per run (default 400)")
    parser.add_argument("--wait-s", type=float, default=30.0,
                        help="protocol.max_wait_s when learners wait (virtual seconds, default 30)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    stamped = stamp(__file__, argv)
    if args.preset not in PRESETS:
        raise SystemExit(f"bench_heterogeneity: error: --preset {args.preset!r}: choose from {', '.join(PRESETS)}")
    for flag, value, ok in (("--seeds", args.seeds, args.seeds >= 1), ("--time-s", args.time_s, args.time_s > 0),
                            ("--wait-s", args.wait_s, args.wait_s > 0)):
        if not ok:
            raise SystemExit(f"bench_heterogeneity: error: {flag} {value}: must be positive")
    console = Console()
    rows = []
    cases = [(waiting, setting) for waiting in (True, False) for setting in SETTINGS]
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=len(cases) * args.seeds)
        for waiting, setting in cases:
            runs = []
            for seed in range(args.seeds):
                try:
                    runs.append(run_one(args.preset, setting, args.wait_s if waiting else 0.0, seed, args.time_s))
                except ConfigError as err:
                    console.print(f"error: {err}")
                    return 2
                progress.advance(task)
            rows.append({
                "waiting": waiting, "setting": setting,
                **{f"{key}_{stat}": round(fn([r[key] for r in runs]), 4)
                   for key in ("goodput", "eval_loss") for stat, fn in (("mean", statistics.fmean),
                                                                        ("min", min), ("max", max))},
                "tokens_mean": round(statistics.fmean(r["tokens"] for r in runs)),
                "runs": runs,
            })
    table = Table(title=f"{args.preset} preset, M=8 (4 x 1.18 slower), jitter 10%, {args.time_s:g} virtual s, "
                        f"{args.seeds} seeds")
    for column in ("learners wait", "setting", "goodput mean [min, max]", "eval loss mean [min, max]", "tokens"):
        table.add_column(column)
    for r in rows:
        table.add_row("yes" if r["waiting"] else "no", r["setting"],
                      f"{r['goodput_mean']:.1%} [{r['goodput_min']:.1%}, {r['goodput_max']:.1%}]",
                      f"{r['eval_loss_mean']:.4f} [{r['eval_loss_min']:.4f}, {r['eval_loss_max']:.4f}]",
                      f"{r['tokens_mean']:,}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({**stamped, "preset": args.preset, "seeds": args.seeds,
                                               "time_s": args.time_s, "wait_s": args.wait_s, "rows": rows,
                                               "load_after": load_now()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
