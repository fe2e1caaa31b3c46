"""``ddiloco chaos``: a real run on this host with faults injected on a schedule, and what it survived.

It runs what ``ddiloco run --runtime processes`` runs (a synchronizer and M learner
processes, each learner behind a fault-injecting proxy), kills, freezes and cuts them on a
seeded schedule or a schedule file, watches the synchronizer, then runs the same
configuration without faults to the same number of tokens as the baseline. Exit code 0
when the run completed, every learner not deliberately left down was alive at the end, and
the global model never stood still longer than one grace window plus one lease; 1
otherwise, naming the property; 130 when SIGINT or SIGTERM stopped it (cleanly: chaos.json
and every synchronizer's final checkpoint are written). With ``--hosts netns`` every
process has its own network namespace and capped link, and link faults act on the real
links (:mod:`ddiloco.chaos.cluster`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ddiloco.core.shared.errors import ConfigError

if TYPE_CHECKING:
    from rich.table import Table

    from ddiloco.chaos.runner import LiveState
    from ddiloco.chaos.schedule import Fault
    from ddiloco.runtime.launch.topology import Topology
    from ddiloco.settings.config import Config

HELP = "inject faults into a real run on this host (kill -9, SIGSTOP, synchronizer crash, bad links)"

DEFAULT_WINDOW_S = 180.0
SETTLE_S = 30.0
"""By default the run goes on this long plus one lease after the fault window: every learner must be back."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddiloco.commands.options import add_device_option, add_hosts_options, add_workload_options  # torch

    parser = sub.add_parser(
        "chaos",
        help=HELP,
        description="Run a synchronizer and M learner processes on 127.0.0.1 (or each in its own network "
        "namespace with --hosts netns), as `ddiloco run --runtime processes` does, and inject faults on a seeded "
        "schedule (every kind within --time 180) or from --schedule FILE: kill -9 and restart of learners, "
        "SIGSTOP longer than the lease, kill -9 of the synchronizer (or of one shard) and restart with --resume, "
        "and latency, bandwidth caps, resets and partitions on a learner's link. Writes OUT/chaos.json and "
        "OUT/chaos.png; exit 0 when the run kept its promises.",
    )
    add_workload_options(parser)
    parser.add_argument("--mode", choices=("decoupled", "diloco"), help="decoupled (default) or diloco")
    parser.add_argument("--learners", type=int, metavar="M", help="number of learners (at least 2; default 4)")
    parser.add_argument("--time", type=float, default=DEFAULT_WINDOW_S, metavar="SECONDS",
                        help=f"wall seconds of faults after the first join (default {DEFAULT_WINDOW_S:.0f}); the "
                        "run then goes on for --settle seconds without faults")
    parser.add_argument("--settle", type=float, metavar="SECONDS",
                        help=f"seconds without faults after --time before the run ends, for the last restart and "
                        f"rejoin (default {SETTLE_S:.0f} plus one lease)")
    parser.add_argument("--schedule", metavar="FILE.toml",
                        help="faults from this file ([[fault]] tables: time, fault, target, duration) instead of "
                        "the seeded schedule")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the same run without faults, trained to the same number of tokens (its eval "
                        "loss is the comparison)")
    parser.add_argument("--min-step-s", type=float, default=0.0, metavar="SECONDS",
                        help="pad every learner's inner step to at least this long, in the run and its baseline "
                        "(leaves CPU for restarts when many processes share a small machine)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default runs/chaos)")
    add_hosts_options(parser)
    add_device_option(parser)
    parser.set_defaults(func=run)


def chaos_config(args: argparse.Namespace) -> Config:
    """The run's configuration: the workload options and a time budget of --time plus --settle seconds."""
    from ddiloco.commands.options import config_from_args

    if not math.isfinite(args.time) or args.time <= 0:
        raise ConfigError(f"--time must be a positive number of seconds, got {args.time}")
    if not math.isfinite(args.min_step_s) or args.min_step_s < 0:
        raise ConfigError(f"--min-step-s must be a number of seconds >= 0, got {args.min_step_s}")
    config = config_from_args(args)
    if config.run.learners < 2:
        raise ConfigError(f"ddiloco chaos needs at least 2 learners, got {config.run.learners} "
                          "(a fault on the only learner stops training by design)")
    if config.cluster.late_learners:
        raise ConfigError(f"cluster.late_learners={config.cluster.late_learners}: ddiloco chaos starts every learner "
                          "at once (late learners join a ddiloco run, on the virtual cluster or --runtime processes)")
    settle_s = SETTLE_S + config.protocol.lease_s if args.settle is None else args.settle
    if not math.isfinite(settle_s) or settle_s < 0:
        raise ConfigError(f"--settle must be a number of seconds >= 0, got {settle_s}")
    run_s = args.time + settle_s
    return replace(config, run=replace(config.run, time_s=run_s, tokens=0)).validate()


def run(args: argparse.Namespace) -> int:
    from ddiloco.chaos.schedule import check_targets, load_schedule, seeded_schedule
    from ddiloco.commands.options import topology_from_args

    config = chaos_config(args)
    window_s = args.time
    shards = config.protocol.shards
    if args.schedule:
        faults = load_schedule(args.schedule)
        check_targets(faults, config.run.learners, window_s, shards)
    else:
        from ddiloco.runtime.layout import reference_layout  # builds the model: only when a schedule is drawn

        plan = reference_layout(config, config.protocol.for_mode(config.run.mode, config.run.learners)).plan
        faults = seeded_schedule(window_s=window_s, learners=config.run.learners, lease_s=config.protocol.lease_s,
                                 fragment_bytes=max(f.numel for f in plan.fragments) // 2, seed=config.run.seed,
                                 shards=shards)
    topology = topology_from_args(args, config.run.learners)
    from ddiloco.commands.interrupt import sigterm_as_interrupt
    from ddiloco.outputs.reporting import prepare_out
    from ddiloco.workload.device import resolve_device

    device = str(resolve_device(args.device))
    config.validate_for_processes()
    out = prepare_out(args.out or "runs/chaos")
    with sigterm_as_interrupt():  # outside a run's own clean stop (runner.py), SIGTERM unwinds like Ctrl-C
        return _run(config, out, faults, window_s, device, args.min_step_s, args.no_baseline, topology)


def _run(config: Config, out: Path, faults: list[Fault], window_s: float, device: str, min_step_s: float,
         no_baseline: bool, topology: Topology | None) -> int:
    from ddiloco.chaos.report import build_report, plot_timeline, report_table, write_events, write_report
    from ddiloco.chaos.runner import ChaosRun
    from ddiloco.commands.display import console, live_lines, print_table, progress_bar

    console.print(f"ddiloco chaos: {len(faults)} faults in {window_s:.0f}s, run budget {config.run.time_s:.0f}s "
                  f"after the first join, M={config.run.learners}, seed {config.run.seed}; logs in {out}/logs")
    with live_lines(_live_view(None), console) as live:
        chaos = ChaosRun(config, out, faults, window_s=window_s, device=device, min_step_s=min_step_s,
                         topology=topology, on_sample=lambda state: live.update(_live_view(state)),
                         on_event=lambda text: live.console.print(text))
        outcome = chaos.run()
    baseline = None
    if not no_baseline and outcome.completed:  # on the same hosts and links
        from ddiloco.runtime.launch.launcher import run_processes

        # The same number of tokens, not the same time: the budget's clock stops while the synchronizer
        # is down, and learners train on meanwhile (work the rollback discards), so at equal time the
        # faulty run would have trained more and the comparison would flatter it.
        tokens = int(outcome.final_status["tokens"])
        same_tokens = replace(config, run=replace(config.run, tokens=tokens, time_s=0.0)).validate()
        with progress_bar(f"baseline (no faults, {tokens:,} tokens) M={config.run.learners}") as progress:
            summary, _ = run_processes(same_tokens, out / "baseline", progress, device=device,
                                       min_step_s=min_step_s, topology=topology)
        baseline = {"eval_loss": summary["eval_loss"], "tokens": summary["tokens"]}
    report = build_report(outcome, config, window_s=window_s, seed=config.run.seed, baseline=baseline,
                          min_step_s=min_step_s)
    path = write_report(out, report)
    write_events(out, outcome.samples)
    plot_timeline(out / "chaos.png", outcome, config.run.learners,
                  title=f"ddiloco chaos: M={config.run.learners}, seed {config.run.seed}, "
                  f"{sum(report['faults'].values())} faults, longest pause {report['longest_pause_s']:.2f}s "
                  f"(bound {report['pause_bound_s']:.2f}s)")
    print_table(report_table(report, title=f"ddiloco chaos (seed {config.run.seed})"))
    console.print(f"wrote {path}, {out / 'chaos.png'} and TensorBoard events")
    for fault in report["not_reached"]:
        console.print(f"ddiloco: chaos: not reached (the run ended first): {fault}", markup=False, highlight=False)
    for violation in report["violations"]:
        console.print(f"ddiloco: chaos: {violation}", markup=False, highlight=False)
    if outcome.stopped:
        console.print(f"ddiloco: interrupted by {outcome.stopped}: stopped cleanly (chaos.json and final checkpoints "
                      "written)", highlight=False)
        return 130
    return 1 if report["violations"] else 0


def _live_view(state: LiveState | None) -> Table:
    """A few short lines: they must read the same in a narrow terminal and in a log."""
    from rich.table import Table

    grid = Table.grid()
    if state is None:
        grid.add_row("starting the synchronizer and the learners ...")
        return grid
    faults = ", ".join(f"{k} {v}" for k, v in sorted(state.faults_so_far.items())) or "none yet"
    grid.add_row(f"[bold]run clock {state.clock_s:.0f}s[/] of {state.run_s:.0f}s (faults until {state.window_s:.0f}s), "
                 f"{state.phase}")
    grid.add_row(f"learners alive {state.alive}/{state.learners}, max version {state.max_version}, "
                 f"longest pause {state.longest_pause_s:.2f}s")
    grid.add_row(f"faults so far: {faults}")
    grid.add_row("active: " + ("; ".join(state.active) or "none"))
    grid.add_row(f"status page {state.status_url}")
    return grid
