"""``ddiloco simtest``: swarm simulation testing of the protocol (see :mod:`ddiloco.sim.swarm`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.fault_kinds import SIMULATED

if TYPE_CHECKING:
    from ddiloco.sim.swarm import SeedResult, SimtestReport


HELP = "attack the protocol on the virtual cluster over many seeds and check its invariants"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddiloco.sim.swarm import DEFAULT_SEEDS, default_workers  # the simulator: torch

    parser = sub.add_parser(
        "simtest",
        help=HELP,
        description="Swarm simulation testing: each seed draws its own world (learners, protocol settings, and "
        "which faults attack at what rates: message loss, duplication, reordering, partitions, freezes, learner "
        "and synchronizer crashes), runs a safety phase with faults and invariant checks after every event, then "
        "a liveness phase without faults in which every learner must catch up and the run must finish.",
    )
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, metavar="N",
                        help=f"how many seeds to run (default {DEFAULT_SEEDS})")
    parser.add_argument("--first-seed", type=int, default=0, metavar="S", help="first seed (default 0)")
    parser.add_argument("--workers", type=int, default=default_workers(), metavar="W",
                        help="worker processes (default: one per core)")
    parser.add_argument("--faults", default=",".join(SIMULATED), metavar="KINDS",
                        help=f"fault kinds the seeds may draw, comma-separated (default all: {','.join(SIMULATED)})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="fix one setting for every seed instead of drawing it, e.g. --set faults.loss=0.1")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddiloco.commands.display import console
    from ddiloco.sim.swarm import run_simtest

    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    progress = Progress(TextColumn("[bold]simtest"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[found]}"), console=console,
                        disable=args.json or not sys.stderr.isatty())
    found = 0
    with progress:
        task = progress.add_task("seeds", total=args.seeds, found="")

        def advance(result: SeedResult) -> None:
            nonlocal found
            found += bool(result.violation or result.liveness)
            progress.update(task, advance=1, found=f"{found} failing" if found else "")

        report = run_simtest(args.seeds, first_seed=args.first_seed, workers=args.workers,
                             overrides=tuple(args.overrides), kinds=kinds, progress=advance)
    summary = report_json(report, tuple(args.overrides), kinds)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_report(report, summary)
    return 1 if summary["violations"] or summary["liveness_failures"] else 0


def report_json(report: SimtestReport, overrides: tuple[str, ...], kinds: tuple[str, ...]) -> dict:
    from ddiloco.sim.swarm import replay_command

    def failure(r: SeedResult, message: str | None) -> dict:
        return {"seed": r.seed, "message": message, "replay": replay_command(r.seed, overrides, kinds)}

    return {
        "seeds": len(report.seeds),
        "first_seed": report.seeds[0].seed if report.seeds else None,
        "violations": [failure(r, r.violation) for r in report.violations],
        "liveness_failures": [failure(r, r.liveness) for r in report.liveness_failures],
        "faults": report.faults(),
        "seeds_with_fault": report.seeds_with(),
        "events": sum(r.events for r in report.seeds),
        "virtual_s": round(sum(r.virtual_s for r in report.seeds), 1),
        "wall_s": round(report.wall_s, 1),
    }


def print_report(report: SimtestReport, summary: dict) -> None:
    from ddiloco.commands.display import console, print_table

    table = Table(title=f"ddiloco simtest: {summary['seeds']} seeds, {summary['events']:,} events, "
                        f"{summary['virtual_s']:,.0f} virtual s in {summary['wall_s']:.0f} s")
    for column in ("fault", "injected", "seeds with it"):
        table.add_column(column, justify="left" if column == "fault" else "right")
    for kind in SIMULATED:
        table.add_row(kind, f"{summary['faults'][kind]:,}", str(summary["seeds_with_fault"][kind]))
    print_table(table)
    for title, items in (("invariant violations", summary["violations"]),
                         ("liveness failures", summary["liveness_failures"])):
        console.print(f"{title}: {len(items)}")
        for item in items:
            console.print(f"  seed {item['seed']}: {item['message']}\n    replay: {item['replay']}")
