"""Scavenging: extra learners join a running job mid-run, on the virtual cluster or real processes.

The paper's last claim: learners on capacity that frees up join a Decoupled DiLoCo run under
way and it reaches the same loss in 0.62-0.90x the time. Here, for each seed:

- **base**: ``--base`` learners train ``--budget`` times the preset's token budget;
- **scavenging**: the same job with ``K`` more learners that join at a share of the base run's
  duration (``cluster.late_learners``, ``cluster.late_join_s``: they join as a restarted
  learner does, fetch the global state and train their own data shards), for as long as the
  base run took.

No failures (``faults.mtbf_s=0``), the same seed, a constant inner learning rate (the
default) and 16 evaluation batches (a time to a loss read off a noisy curve is noise).
Reported per setting: the time the scavenging run took to reach the base run's final eval
loss (linear between its evaluations), as a share of the base run's time
(``time_to_base_loss``; none if it did not within that time), its loss at the base run's end
against the base's, and its tokens against the base's. ``--json FILE`` writes every run and
its curve.

``--processes``: the same on real processes (``ddiloco run --runtime processes``: a real
synchronizer, learner processes each stepping at most every ``--min-step-s`` wall seconds,
as chips of a fixed speed would; the late ones are started when their time comes), in wall
seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from stamp import load_now, stamp

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.config_sources import PRESETS, build_config
from ddiloco.sim.experiment import run_virtual

SETTINGS = ((2, 0.25), (4, 0.25), (4, 0.5))
"""(learners that join, when, as a share of the base run's duration)."""
EVALS = 24
"""Evaluations per run: the curve the time to the base run's loss is read from."""
EVAL_BATCHES = 16


class Runner:
    """One run of a setting, on the virtual cluster or (``min_step_s`` given) on real processes."""

    def __init__(self, preset: str, budget: float, min_step_s: float | None) -> None:
        self.preset = preset
        self.tokens = int(budget * build_config(preset=preset).run.tokens)
        self.min_step_s = min_step_s

    def __call__(self, seed: int, learners: int, late: int = 0, join_s: float = 0.0, time_s: float = 0.0) -> dict:
        """A token budget, or with ``time_s`` a time budget instead."""
        budget = f"run.time_s={time_s}" if time_s else f"run.tokens={self.tokens}"
        overrides = (f"run.learners={learners}", f"run.seed={seed}", "faults.mtbf_s=0", f"train.evals={EVALS}",
                     f"train.eval_batches={EVAL_BATCHES}", budget,
                     f"cluster.late_learners={late}", f"cluster.late_join_s={join_s}")
        config = build_config(preset=self.preset, overrides=overrides)
        if self.min_step_s is None:
            return _outcome(*run_virtual(config))
        from ddiloco.runtime.launch.launcher import run_processes  # grpc only when asked for

        with tempfile.TemporaryDirectory() as out:
            return _outcome(*run_processes(config.validate_for_processes(), Path(out) / "run",
                                           min_step_s=self.min_step_s, timeout_s=1800))


def _outcome(summary: dict, rows: list[dict]) -> dict:
    curve = [(r["virtual_time_s"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    return {"time_s": curve[-1][0], "eval_loss": curve[-1][1], "tokens": summary["tokens"], "curve": curve,
            "goodput": summary.get("goodput"),
            "rejections": summary.get("rejections", {}),  # refused contributions, by reason
            "honest_refused_steps": summary.get("honest_refused_steps", 0)}  # honest work refused (issue 42)


def time_to_loss(curve: list[tuple[float, float]], loss: float) -> float | None:
    """When ``curve`` first reaches ``loss`` (linear between evaluations); None if it never does."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l0 <= loss:
            return t0
        if l1 <= loss:
            return t0 + (t1 - t0) * (l0 - loss) / (l0 - l1)
    return curve[-1][0] if curve and curve[-1][1] <= loss else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help=f"one of {', '.join(PRESETS)} (default small; tiny's "
                        "1 MiB corpus holds out an eval set that depends on the number of learners, so its "
                        "losses do not compare across M)")
    parser.add_argument("--base", type=int, default=4, help="learners from the start (default 4)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds (default 5)")
    parser.add_argument("--budget", type=float, default=1.0, help="times the preset's token budget (default 1)")
    parser.add_argument("--processes", action="store_true", help="real processes instead of the virtual cluster")
    parser.add_argument("--min-step-s", type=float, default=0.1,
                        help="with --processes: a learner's inner step lasts at least this long (default 0.1)")
    parser.add_argument("--json", metavar="FILE", help="write every run as JSON")
    args = parser.parse_args(argv)
    stamped = stamp(__file__, argv)
    if args.preset not in PRESETS:
        raise SystemExit(f"bench_scavenging: error: --preset {args.preset!r}: choose from {', '.join(PRESETS)}")
    for flag, value in (("--base", args.base), ("--seeds", args.seeds)):
        if value < 1:
            raise SystemExit(f"bench_scavenging: error: {flag} {value}: must be at least 1")
    for flag, number in (("--min-step-s", args.min_step_s), ("--budget", args.budget)):
        if not number > 0:
            raise SystemExit(f"bench_scavenging: error: {flag} {number}: must be positive")
    run_one = Runner(args.preset, args.budget, args.min_step_s if args.processes else None)
    where = "real processes (wall s)" if args.processes else "virtual cluster"
    console = Console()
    runs: list[dict] = []
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=args.seeds * (1 + len(SETTINGS)))
        for seed in range(args.seeds):
            try:
                base = run_one(seed, args.base)
                progress.advance(task)
                for late, at in SETTINGS:
                    scav = run_one(seed, args.base + late, late, at * base["time_s"], base["time_s"])
                    reach = time_to_loss(scav["curve"], base["eval_loss"])
                    runs.append({"seed": seed, "late": late, "join_at": at, "base": base, "scavenging": scav,
                                 "time_to_base_loss": None if reach is None else round(reach / base["time_s"], 4),
                                 "tokens_ratio": round(scav["tokens"] / base["tokens"], 4)})
                    progress.advance(task)
            except ConfigError as err:
                console.print(f"error: {err}")
                return 2
    rows = []
    for late, at in SETTINGS:
        mine = [r for r in runs if (r["late"], r["join_at"]) == (late, at)]
        reached = [r["time_to_base_loss"] for r in mine if r["time_to_base_loss"] is not None]
        rows.append({"late": late, "join_at": at, "seeds": len(mine), "reached": len(reached),
                     "time_to_base_loss_median": round(statistics.median(reached), 4) if reached else None,
                     "time_to_base_loss_range": [min(reached), max(reached)] if reached else None,
                     "tokens_ratio_median": round(statistics.median(r["tokens_ratio"] for r in mine), 4),
                     "goodput_median": round(statistics.median(r["scavenging"]["goodput"] or 0.0 for r in mine), 4),
                     "honest_refused_steps": sum(r["scavenging"]["honest_refused_steps"] for r in mine),
                     "loss_delta_median": round(statistics.median(r["scavenging"]["eval_loss"] - r["base"]["eval_loss"]
                                                                  for r in mine), 4)})
    table = Table(title=f"{where}, {args.preset} preset: {args.base} learners from the start, K more join "
                        f"later; {args.seeds} seeds, no failures")
    for column in ("K join", "at (share of base time)", "time to base's final loss [range]", "reached",
                   "tokens vs base", "loss at base's end - base's (median)", "goodput (median)",
                   "honest steps refused (all seeds)"):
        table.add_column(column)
    for r in rows:
        reach = ("never" if r["time_to_base_loss_median"] is None else
                 f"{r['time_to_base_loss_median']:.2f}x [{r['time_to_base_loss_range'][0]:.2f}, "
                 f"{r['time_to_base_loss_range'][1]:.2f}]")
        table.add_row(str(r["late"]), f"{r['join_at']:.2f}", reach, f"{r['reached']}/{r['seeds']}",
                      f"{r['tokens_ratio_median']:.2f}x", f"{r['loss_delta_median']:+.4f}",
                      f"{r['goodput_median']:.1%}", f"{r['honest_refused_steps']:,}")
    console.print(table)
    bases = {r["seed"]: r["base"] for r in runs}
    console.print(f"base runs: goodput {[round(b['goodput'] or 0.0, 4) for b in bases.values()]}, honest steps "
                  f"refused {sum(b['honest_refused_steps'] for b in bases.values()):,}")
    if args.json:
        Path(args.json).write_text(json.dumps({**stamped, "where": where, "preset": args.preset,
                                               "min_step_s": args.min_step_s if args.processes else None,
                                               "tokens": run_one.tokens,
                                               "base_learners": args.base,
                                               "seeds": args.seeds, "rows": rows, "runs": runs,
                                               "load_after": load_now()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
