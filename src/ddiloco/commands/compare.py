"""``ddiloco compare``: the four modes on the same workload, seed, budget and failure trace."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ddiloco.commands.display import console, print_table, progress_bar, summary_table
from ddiloco.commands.options import add_cluster_options, config_from_args
from ddiloco.config import MODES
from ddiloco.experiment import run_virtual
from ddiloco.reporting import plot_runs, prepare_out, write_run
from ddiloco.workload.device import resolve_device
from ddiloco.workload.workload import Workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "compare",
        help="run decoupled, diloco, dp and dp-elastic side by side",
        description="Run every mode on the same workload, seed, budget and failure trace; print a table, "
        "write compare.json and compare.png (and each mode's own outputs in a subdirectory).",
    )
    add_cluster_options(parser, with_mode=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = config_from_args(args)
    device = resolve_device(args.device)
    out = prepare_out(args.out or "runs/compare")
    workload = Workload.build(base, device)
    summaries, curves = [], {}
    for mode in MODES:
        config = replace(base, run=replace(base.run, mode=mode)).validate()
        with progress_bar(f"{mode:<10}") as progress:
            summary, rows = run_virtual(config, workload=workload, progress=progress)
        write_run(out / mode, config, summary, rows)
        summaries.append(summary)
        curves[mode] = rows
    (out / "compare.json").write_text(json.dumps(summaries, indent=2) + "\n")
    plot_runs(out / "compare.png", curves, title=f"M={base.run.learners}, seed {base.run.seed}, "
              f"MTBF {base.faults.mtbf_s:g}s, downtime {base.faults.downtime_s:g}s")
    print_table(summary_table(summaries, title="ddiloco compare"))
    console.print(f"wrote {out}/compare.json and compare.png")
    return 0
