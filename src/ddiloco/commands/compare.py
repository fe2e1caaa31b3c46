"""``ddiloco compare``: the four modes on the same workload, seed, budget and failure trace."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddiloco.settings.config import Config


HELP = "run decoupled, diloco, dp and dp-elastic side by side"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddiloco.commands.options import add_cluster_options  # the presets: torch

    parser = sub.add_parser(
        "compare",
        help=HELP,
        description="Run every mode on the same workload, seed, budget and failure trace; print a table, "
        "write compare.json and compare.png (and each mode's own outputs in a subdirectory).",
    )
    add_cluster_options(parser, with_mode=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddiloco.commands.options import config_from_args
    from ddiloco.settings.config import MODES

    base = config_from_args(args)
    # The configuration is checked: only now what trains it (torch), so a bad value costs no torch import.
    from ddiloco.commands.display import compare_story, console, print_report, progress_bar
    from ddiloco.commands.interrupt import sigterm_as_interrupt
    from ddiloco.outputs.reporting import prepare_out
    from ddiloco.sim.experiment import Interrupted, run_virtual
    from ddiloco.workload.device import resolve_device
    from ddiloco.workload.workload import Workload

    device = resolve_device(args.device)
    out = prepare_out(args.out or "runs/compare")
    workload = Workload.build(base, device)
    summaries, curves = [], {}
    try:
        with sigterm_as_interrupt():
            for mode in MODES:
                config = replace(base, run=replace(base.run, mode=mode)).validate()
                with progress_bar(f"{mode:<10}") as progress:
                    summary, rows = run_virtual(config, workload=workload, progress=progress, out=out / mode)
                summaries.append(summary)
                curves[mode] = rows
    except Interrupted as stop:
        summaries.append(stop.summary)
        curves[stop.summary["mode"]] = stop.rows
        write_compare(out, base, summaries, curves)
        console.print(f"ddiloco: interrupted during {stop.summary['mode']}: wrote what was done to {out}/compare.json "
                      "and compare.png", highlight=False, soft_wrap=True)
        return 130
    write_compare(out, base, summaries, curves)
    story = compare_story(summaries, slow_factor=base.cluster.slow_factor, mtbf_s=base.faults.mtbf_s,
                          downtime_s=base.faults.downtime_s)
    print_report(summaries, "ddiloco compare", story, beside=False)
    console.print(f"wrote {out}/compare.json and compare.png")
    return 0


def write_compare(out: Path, base: Config, summaries: list[dict[str, Any]], curves: dict[str, list[dict[str, Any]]]) -> None:
    from ddiloco.outputs.run_plot import plot_runs

    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(summaries, indent=2) + "\n")
    plot_runs(out / "compare.png", curves, events={s["mode"]: s.get("events") for s in summaries},
              slow_factor=base.cluster.slow_factor,
              title=f"M={base.run.learners}, seed {base.run.seed}, MTBF {base.faults.mtbf_s:g}s, "
              f"downtime {base.faults.downtime_s:g}s")
