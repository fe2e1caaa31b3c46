"""``ddiloco fingerprint``: the behaviour fingerprint of this tree (:mod:`ddiloco.sim.behaviour_fingerprint`)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "the protocol's decisions on a fixed set of seeded worlds, hashed: which results still hold"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "fingerprint", help=HELP,
        description="Run a fixed set of seeded worlds on the virtual cluster (failures, a slow learner, late "
        "joiners, K = M, a sharded synchronizer, the adversary's faults, synchronous DiLoCo, a flood of "
        "abandoned joins) and hash the protocol's decisions in them (rounds, merges, versions, bytes, "
        "refusals; no floats). Every results file records the fingerprint it was measured at: the same "
        "fingerprint, the same decisions. Seconds on 2 cores.")
    parser.add_argument("--json", action="store_true", help="print the fingerprint and each world's hash as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from ddiloco.commands.display import console
    from ddiloco.sim.behaviour_fingerprint import SCENARIOS, fingerprint

    progress = Progress(TextColumn("[bold]fingerprint"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.description}"), console=console, transient=True,
                        disable=args.json or not sys.stderr.isatty())
    with progress:
        task = progress.add_task(SCENARIOS[0].name, total=len(SCENARIOS))
        whole, parts = fingerprint(lambda done: progress.update(task, advance=1, description=done.name))
    if args.json:
        json.dump({"fingerprint": whole, "worlds": parts}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(whole)
    return 0
