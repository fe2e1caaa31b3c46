"""Soak: N learner kill -9 and S synchronizer kill -9 in one run of real processes, sampled every K kills.

    python benchmarks/bench_soak.py --kills 2000 --sync-kills 20 --json docs/results/soak_2000kills.json
    python benchmarks/bench_soak.py --quick            # 8 kills, 1 synchronizer kill, a sample every 2
    python benchmarks/bench_soak.py --schedule my.toml --sample-every 10

One ``ddiloco chaos`` run (its runner, its supervisor, its report: ``ddiloco.chaos``), 5
learners of the reference workload's tiny preset: a restarted learner imports torch, loads
the corpus and joins in seconds, so a kill costs seconds and thousands fit in hours; the
soak's subject is what processes and the state directory keep per incarnation, not the
model. Kills come KILL_GAP_S apart on the schedule's clock, each lap of the learners in a
seeded order, the synchronizer kills half-way between samples (restarted with --resume),
plus a few freezes and partitions. Every K kills (``--sample-every``) it reads the
synchronizer's RSS, peak RSS, fds and threads, the state directory's size, each learner's
and link helper's RSS, goodput and the global model's eval loss (``ddiloco.chaos.soak``).
At the end: a table, the promises, a plot over the kill count and ``--json`` (stamped);
exit 0 only if every promise holds, 2 on bad input (nothing started), 130 if stopped.
Leases 3 s, heartbeats 0.5 s, learners paced to 5 steps/s, as in bench_chaos.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from stamp import load_now, stamp

LEARNERS = 5
LEASE_S = 3.0
MIN_STEP_S = 0.2
CHAOS_ARGS = ["--preset", "tiny", "--set", f"protocol.lease_s={LEASE_S}", "--set", "protocol.heartbeat_s=0.5",
              "--min-step-s", str(MIN_STEP_S), "--learners", str(LEARNERS)]
QUICK = {"kills": 8, "sync_kills": 1, "sample_every": 2, "settle": 15.0}
KEPT = ("faults", "rejoins", "rejected", "refused_steps", "honest_refused_steps", "goodput", "uptime", "tokens",
        "eval_loss", "baseline_eval_loss", "baseline_tokens", "longest_pause_s", "pause_bound_s",
        "sync_downtime_s", "learners_alive_at_end", "learners", "batch_period", "batches_trained",
        "batches_retrained", "batches_retrained_beyond_period", "batches_skipped", "completed", "violations",
        "run_budget_s", "fault_window_s", "wall_s")
"""chaos.json's keys the soak's JSON keeps (the whole report stays in the run's directory)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, help="learner kills (default 2000, --quick 8)")
    parser.add_argument("--sync-kills", type=int, help="synchronizer kills among them (default 20, --quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=int, help="kills between samples (default 100, --quick 2)")
    parser.add_argument("--freezes", type=int, help="freezes (default kills/100, at least 1)")
    parser.add_argument("--partitions", type=int, help="partitions (default kills/100, at least 1)")
    parser.add_argument("--kill-gap-s", type=float, help="seconds between kills on the schedule's clock (default 9)")
    parser.add_argument("--settle", type=float, help="seconds without faults at the end (default 30 + a lease)")
    parser.add_argument("--schedule", metavar="FILE.toml", help="the faults from this file instead (ddiloco chaos's)")
    parser.add_argument("--quick", action="store_true", help="8 kills, 1 synchronizer kill, a sample every 2")
    parser.add_argument("--baseline", action="store_true", help="also the same run without faults, to equal tokens")
    parser.add_argument("--no-eval", action="store_true", help="no eval loss at the samples (the final one stays)")
    parser.add_argument("--out", help="the run's directory (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="write the promises and the samples here")
    parser.add_argument("--plot", metavar="PATH", help="the plot over the kill count (default OUT/soak.png)")
    args = parser.parse_args(argv)
    for key, quick in QUICK.items():
        if getattr(args, key) is None and args.quick:
            setattr(args, key, quick)
    args.kills = 2000 if args.kills is None else args.kills
    args.sync_kills = 20 if args.sync_kills is None else args.sync_kills
    args.sample_every = args.sample_every or 100
    return args


def plan(args: argparse.Namespace) -> tuple[Any, list[Any], float]:
    """(config, faults, fault window), every input checked: ConfigError or ValueError before anything starts."""
    from ddiloco.chaos.schedule import check_targets, load_schedule
    from ddiloco.chaos.soak import KILL_GAP_S, soak_schedule
    from ddiloco.commands.chaos import add_parser, chaos_config
    from ddiloco.core.shared.errors import ConfigError

    if args.schedule:
        faults = load_schedule(args.schedule)
        if not faults:
            raise ConfigError(f"schedule file {args.schedule}: no [[fault]]")
        window_s = max(f.end_s for f in faults) + 1.0
    else:
        per = max(1, args.kills // 100)
        faults, window_s = soak_schedule(kills=args.kills, sync_kills=args.sync_kills, learners=LEARNERS,
                                         seed=args.seed, sample_every=args.sample_every, lease_s=LEASE_S,
                                         freezes=per if args.freezes is None else args.freezes,
                                         partitions=per if args.partitions is None else args.partitions,
                                         gap_s=args.kill_gap_s or KILL_GAP_S)
    sub = argparse.ArgumentParser(prog="ddiloco").add_subparsers()
    add_parser(sub)
    chaos_argv = ["chaos", *CHAOS_ARGS, "--seed", str(args.seed), "--time", f"{window_s:.2f}",
                  *([] if args.settle is None else ["--settle", str(args.settle)])]
    config = chaos_config(sub.choices["chaos"].parse_args(chaos_argv[1:]))
    check_targets(faults, config.run.learners, window_s, config.protocol.shards)
    config.validate_for_processes()
    return config, faults, window_s


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from ddiloco.core.shared.errors import ConfigError

    if args.kills < 1 or args.sync_kills < 0 or args.sample_every < 1:
        print("bench_soak: error: --kills must be >= 1, --sync-kills >= 0, --sample-every >= 1", file=sys.stderr)
        return 2
    try:
        config, faults, window_s = plan(args)
    except (ConfigError, ValueError) as err:
        print(f"bench_soak: error: {err}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # the evaluations share this process with the runner and every proxy
    started = stamp(__file__, sys.argv[1:] if argv is None else argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    wall0 = time.monotonic()
    outcome, samples = soak(config, faults, window_s, out, args)
    baseline = run_baseline(config, outcome, out) if args.baseline and outcome.completed else None

    from ddiloco.chaos.report import build_report, write_report
    from ddiloco.chaos.soak import judge

    report = build_report(outcome, config, window_s=window_s, seed=args.seed, baseline=baseline,
                          min_step_s=MIN_STEP_S)
    write_report(out, report)
    promises = judge(report, samples)
    wall_s = time.monotonic() - wall0
    kills = report["faults"]["learner_crash"]
    at = [r["started_s"] for r in report["schedule"] if r["fault"] == "learner_crash" and r["started_s"] is not None
          and "skipped" not in r]
    rate = (len(at) - 1) / ((max(at) - min(at)) / 60) if len(at) > 1 and max(at) > min(at) else None
    result = {**started, "load_at_end": load_now(), "wall_s": round(wall_s, 1), "out": str(out),
              "learners": LEARNERS, "preset": "tiny", "seed": args.seed, "sample_every": args.sample_every,
              "kills": kills, "sync_kills": report["faults"]["sync_crash"],
              "kills_per_minute": None if rate is None else round(rate, 2),
              "kills_window_s": round(max(at) - min(at), 1) if at else None,
              "promises": {str(p): held for p, held in promises.items()}, "all_promises_held": all(promises.values()),
              "samples": [s.to_dict() for s in samples],
              "baseline_goodput": baseline["goodput"] if baseline else None,
              "chaos": {key: report[key] for key in KEPT},
              "sync_restarts": report["sync_restarts"]}
    plot_path = Path(args.plot) if args.plot else out / "soak.png"
    plot(plot_path, samples, f"soak: {kills} learner kills, {result['sync_kills']} synchronizer kills, "
         f"seed {args.seed}, M={LEARNERS}, tiny")
    show(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"run kept in {out}; plot {plot_path}" + (f"; wrote {args.json}" if args.json else ""))
    if outcome.stopped:
        return 130
    return 0 if result["all_promises_held"] else 1


def soak(config: Any, faults: list[Any], window_s: float, out: Path, args: argparse.Namespace) -> tuple[Any, list]:
    """The chaos run, sampled; progress on a terminal, a line per sample either way, events in OUT/events.log."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ddiloco.chaos.runner import ChaosRun
    from ddiloco.chaos.soak import SoakSampler
    from ddiloco.settings.fault_kinds import FaultKind
    from ddiloco.workload.device import resolve_device

    total = sum(1 for f in faults if f.kind is FaultKind.LEARNER_CRASH)
    events = open(out / "events.log", "a")
    print(f"bench_soak: {total} learner kills, {sum(f.kind is FaultKind.SYNC_CRASH for f in faults)} synchronizer "
          f"kills, {len(faults)} faults in {window_s:.0f}s of schedule, run budget {config.run.time_s:.0f}s; "
          f"run in {out}", flush=True)
    with Progress(TextColumn("kills"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[line]}"), disable=not sys.stdout.isatty()) as progress:
        task = progress.add_task("kills", total=total, line="")

        def sampled(s: Any) -> None:
            line = (f"kill {s.kills}: sync RSS {_mib(s.sync_rss_kib)} fds {s.sync_fds} threads {s.sync_threads}, "
                    f"state dir {s.state_dir_bytes / 1e6:.2f} MB, settled {s.state_dir_settled_bytes / 1e6:.2f} MB "
                    f"({s.state_dir_files} files), goodput "
                    f"{_pct(s.goodput)}, {s.learners_alive} alive" + ("" if s.quiet else " (not quiet)"))
            progress.console.print(line) if progress.console.is_terminal else print(line, flush=True)

        sampler = SoakSampler(config, args.sample_every, evaluate=not args.no_eval, on_sample=sampled)

        def tick(state: Any) -> None:
            sampler.tick(state)
            progress.update(task, completed=state.faults_so_far.get(str(FaultKind.LEARNER_CRASH), 0))

        run = ChaosRun(config, out, faults, window_s=window_s, device=str(resolve_device("cpu")),
                       min_step_s=MIN_STEP_S, on_sample=tick,
                       on_event=lambda text: print(text, file=events, flush=True))
        sampler.attach(run)
        try:
            outcome = run.run()
        finally:
            sampler.join()
            events.close()
    return outcome, sampler.samples


def run_baseline(config: Any, outcome: Any, out: Path) -> dict[str, Any]:
    """The same run without faults, to the same token count (as ``ddiloco chaos``'s baseline)."""
    from ddiloco.runtime.launch.launcher import run_processes

    tokens = int(outcome.final_status["tokens"])
    print(f"bench_soak: baseline, the same run without faults to {tokens:,} tokens", flush=True)
    same = replace(config, run=replace(config.run, tokens=tokens, time_s=0.0)).validate()
    summary, _ = run_processes(same, out / "baseline", None, device="cpu", min_step_s=MIN_STEP_S)
    return {"eval_loss": summary["eval_loss"], "tokens": summary["tokens"], "goodput": summary["goodput"]}


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def show(result: dict[str, Any]) -> None:
    """The samples as a table, the promises, and what the chaos report says of the run."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"soak: {result['kills']} kills, {result['sync_kills']} synchronizer kills "
                  f"({result['wall_s'] / 60:.1f} min, {result['kills_per_minute']} kills/min)")
    for column in ("kills", "sync kills", "t s", "sync RSS", "peak", "fds", "threads", "status page",
                   "state dir", "settled", "files", "harness", "learners max", "helpers max", "goodput", "eval loss"):
        table.add_column(column, justify="right")
    for s in result["samples"]:
        learners = [v for v in s["learner_rss_kib"].values() if v]
        helpers = [v for v in s["helper_rss_kib"].values() if v]
        table.add_row(str(s["kills"]), str(s["sync_kills"]), f"{s['t_s']:.0f}", _mib(s["sync_rss_kib"]),
                      _mib(s["sync_hwm_kib"]), str(s["sync_fds"]), str(s["sync_threads"]),
                      _mib(s["status_page_rss_kib"]), f"{s['state_dir_bytes'] / 1e6:.2f} MB",
                      f"{s['state_dir_settled_bytes'] / 1e6:.2f} MB",
                      str(s["state_dir_files"]), _mib(s["harness_rss_kib"]), _mib(max(learners, default=None)),
                      _mib(max(helpers, default=None)), _pct(s["goodput"]),
                      "-" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}")
    console = Console(width=200)
    console.print(table)
    c = result["chaos"]
    console.print(f"faults {c['faults']}; rejoins {c['rejoins']}; rejected {c['rejected'] or 'none'}; honest steps "
                  f"refused {c['honest_refused_steps']}; batches trained {c['batches_trained']:,}, again "
                  f"{c['batches_retrained']:,} ({c['batches_retrained_beyond_period']} beyond H={c['batch_period']}),"
                  f" skipped {c['batches_skipped']}; longest pause {c['longest_pause_s']:.2f}s (bound "
                  f"{c['pause_bound_s']:.2f}s); goodput {_pct(c['goodput'])} (baseline "
                  f"{_pct(result['baseline_goodput'])}); eval loss {c['eval_loss']} (baseline "
                  f"{c['baseline_eval_loss']}, tokens {c['tokens']} vs {c['baseline_tokens']})", highlight=False)
    for violation in c["violations"]:
        console.print(f"chaos: {violation}", highlight=False, markup=False)
    for promise, held in result["promises"].items():
        console.print(f"{'held  ' if held else 'BROKEN'} {promise}", highlight=False)


def plot(path: Path, samples: list[Any], title: str) -> None:
    """Six panels over the kill count: synchronizer RSS, fds, threads, state-directory bytes, goodput, eval loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("sync_rss_kib", "synchronizer RSS (MiB)", 1 / 1024), ("sync_fds", "synchronizer open fds", 1),
              ("sync_threads", "synchronizer threads", 1),
              ("state_dir_settled_bytes", "state directory, settled (MB)", 1e-6),
              ("goodput", "goodput so far", 1), ("eval_loss", "eval loss", 1)]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, label, scale) in zip(axes.flat, panels):
        points = [(s.kills, getattr(s, key) * scale) for s in samples if getattr(s, key) is not None]
        ax.plot([k for k, _ in points], [v for _, v in points], marker="o", markersize=3)
        for s in samples:
            if not s.quiet:
                ax.axvline(s.kills, color="0.85", lw=0.8, zorder=0)
        if len(points) > 2:  # the band the last sample must stay in
            ref = points[1][1]
            if key not in ("goodput", "eval_loss"):
                ax.axhspan(ref * 0.9, ref * 1.1, color="C2", alpha=0.12, lw=0)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("learner kills")
        ax.set_ylim(bottom=0)
    fig.suptitle(title + " (green: ±10% of the second sample)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
