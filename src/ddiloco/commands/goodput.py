"""``ddiloco goodput``: goodput and uptime at datacenter scale, under chip failures.

Three questions, one model (:mod:`ddiloco.scale.goodput_model`, documented in docs/goodput.md):
the table (configurations x cluster sizes x failure rates, over seeds), the planning answer
(``--target-goodput``: the smallest M that reaches it), and the calibration (``--calibrate``:
re-fit the recovery-cost constants on the published 1.2M-chip column).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from typing import TYPE_CHECKING, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from ddiloco.core.shared.errors import ConfigError

if TYPE_CHECKING:
    from ddiloco.scale import goodput_model as gp

DAY_S = 86_400.0


HELP = "simulate goodput and uptime of data parallel vs Decoupled DiLoCo on 150k-2.4M chips"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ddiloco.scale import goodput_model as gp  # its Mode: torch

    parser = sub.add_parser(
        "goodput",
        help=HELP,
        description="Simulate training on N chips under per-chip Poisson interruptions: goodput (useful "
        "chip-time / provisioned chip-time) and uptime (share of wall time the global model advances) "
        "of data parallel, elastic data parallel and Decoupled DiLoCo with M learners. "
        "Recovery costs are calibrated on the paper's 1.2M-chip column; see docs/goodput.md.",
    )
    what = parser.add_argument_group("what to simulate")
    what.add_argument("--chips", nargs="+", metavar="N", help="cluster sizes, e.g. 150k 1.2M 5000000 "
                      "(default: 150k 300k 600k 1.2M 2.4M)")
    what.add_argument("--configs", nargs="+", metavar="CONFIG",
                      help="dp, dp-elastic, decoupled-M<n> (default: dp dp-elastic decoupled-M2 M4 M8 M16)")
    what.add_argument("--mtbi-days", nargs="+", type=float, metavar="DAYS",
                      help="mean time between interruptions of one chip; several values sweep it (default 365.25)")
    what.add_argument("--seeds", type=int, default=gp.DEFAULT_SEEDS, help="seeded runs per cell (default 5)")
    what.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    what.add_argument("--horizon-hours", type=float, default=gp.DEFAULT_HORIZON_S / 3600,
                      help="simulated wall time per run (default 24)")

    model = parser.add_argument_group("failure and recovery model (defaults: docs/goodput.md)")
    defaults = gp.ClusterModel()
    for flag, field, help_text in (
        ("--reconfig-s", "reconfig_s", "elastic stall per interruption (fit)"),
        ("--restart-s", "restart_s", "non-elastic restart per interruption (fit)"),
        ("--recovery-mean-s", "recovery_mean_s", "mean time a failed slice stays out (fit)"),
        ("--recovery-sigma", "recovery_sigma", "log-normal shape of the recovery time"),
        ("--slice-chips", "slice_chips", "chips taken out by one chip failure"),
        ("--checkpoint-interval-s", "checkpoint_interval_s", "progress between dp checkpoints"),
        ("--step-s", "step_s", "inner step time"),
        ("--straggler-sigma", "straggler_sigma", "per-slice, per-step relative step-time jitter"),
        ("--overlap-steps", "overlap_steps", "tau: steps before a learner needs the merged fragment"),
        ("--quorum", "quorum", "K: learners needed to close a round"),
    ):
        kind = int if isinstance(getattr(defaults, field), int) else float
        default = getattr(defaults, field)
        model.add_argument(flag, dest=field, type=kind, metavar="X", help=f"{help_text} (default {default})")
    model.add_argument("--grace-s", dest="grace_s", type=float, metavar="X",
                       help="fixed grace window (default: adaptive, half the overlap slack)")

    mode = parser.add_argument_group("planning and calibration")
    mode.add_argument("--target-goodput", type=float, metavar="G",
                      help="print the smallest M (power of two) whose goodput reaches G on each cluster size")
    mode.add_argument("--max-learners", type=int, default=1024, metavar="M", help="upper bound for --target-goodput")
    mode.add_argument("--calibrate", action="store_true",
                      help="re-fit reconfig-s, restart-s and recovery-mean-s on the published 1.2M-chip column")

    out = parser.add_argument_group("output")
    out.add_argument("--plot", metavar="FILE", help="also write a PNG of goodput against cluster size")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run)


def parse_chips(text: str) -> int:
    """'150k', '1.2M', '2400000' -> chip count (a ConfigError names what could not be read)."""
    match = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([kKmM]?)\s*", text)
    if match is None:
        raise ConfigError(f"cannot read chip count {text!r}; try 150k, 1.2M or 2400000")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[match.group(2).lower()]
    if value < 1 or value != math.floor(value):
        raise ConfigError(f"chips must be a whole number >= 1, got {text!r}")
    return int(value)


def _model(args: argparse.Namespace, mtbi_days: float) -> gp.ClusterModel:
    from ddiloco.scale import goodput_model as gp

    if not (mtbi_days > 0 and math.isfinite(mtbi_days)):
        raise ConfigError(f"mtbi-days must be positive, got {mtbi_days}")
    overrides = {f: getattr(args, f) for f in gp.ClusterModel.__slots__ if getattr(args, f, None) is not None}
    return gp.ClusterModel(**{**overrides, "mtbi_s": mtbi_days * DAY_S})


def run(args: argparse.Namespace) -> int:
    from ddiloco.scale import goodput_model as gp
    from ddiloco.settings.config import check_seed

    chips = [parse_chips(c) for c in args.chips] if args.chips else list(gp.DEFAULT_CHIPS)
    configs = list(args.configs or gp.DEFAULT_CONFIGS)
    mtbis = args.mtbi_days or [gp.SECONDS_PER_YEAR / DAY_S]
    if not (args.horizon_hours > 0 and math.isfinite(args.horizon_hours)):
        raise ConfigError(f"horizon-hours must be positive, got {args.horizon_hours}")
    horizon_s = args.horizon_hours * 3600
    check_seed(args.seed, "--seed")
    models = [_model(args, d) for d in mtbis]
    for name in configs:
        gp.parse_config(name)
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise ConfigError(f"cannot write plot {args.plot!r}: its directory does not exist")
    if args.calibrate:
        if args.mtbi_days and args.mtbi_days != [gp.SECONDS_PER_YEAR / DAY_S]:
            raise ConfigError("--calibrate fits the published 1.2M-chip column, measured at an MTBI of 365.25 days; "
                              f"drop --mtbi-days {' '.join(f'{d:g}' for d in args.mtbi_days)}")
        return _calibrate(models[0], args, horizon_s)
    if args.target_goodput is not None:
        return _plan(models, chips, args, horizon_s)

    rows = [r for m in models for r in gp.simulate_table(configs, chips, m, seeds=args.seeds, seed=args.seed,
                                                         horizon_s=horizon_s)]
    if args.plot:
        plot_goodput(rows, args.plot)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
        return 0
    console = Console()
    for m in models:
        console.print(_table(rows, m, configs, chips, "goodput", args.seeds))
        console.print(_table(rows, m, configs, chips, "uptime", args.seeds))
    if gp.CALIBRATION_CHIPS in chips and any(abs(m.mtbi_s - gp.SECONDS_PER_YEAR) < 1 for m in models):
        published = "  ".join(f"{c} {v:.0%}" for c, v in gp.PUBLISHED_GOODPUT_1_2M.items())
        console.print(f"published goodput at 1.2M chips, MTBI 1 year: {published}")
    if args.plot:
        console.print(f"wrote {args.plot}")
    return 0


def _table(rows: Sequence[gp.Row], model: gp.ClusterModel, configs: Sequence[str], chips: Sequence[int],
           metric: str, seeds: int) -> Table:

    title = f"{metric} % (mean ± std over {seeds} seeds), MTBI {model.mtbi_s / DAY_S:g} days per chip"
    table = Table(title=title, box=box.SIMPLE_HEAD)
    table.add_column("config", no_wrap=True)
    for n in chips:
        table.add_column(_chips_label(n), justify="right", no_wrap=True)
    cells = {(r.config, r.chips): r for r in rows if r.mtbi_s == model.mtbi_s}
    for name in configs:
        values = [cells[(name, n)] for n in chips]
        mean_std = ((getattr(r, metric), getattr(r, f"{metric}_std")) for r in values)
        table.add_row(name, *(f"{100 * mean:.1f}±{100 * std:.1f}" for mean, std in mean_std))
    return table


def _chips_label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k" if n >= 1000 else str(n)


def _plan(models: Sequence[gp.ClusterModel], chips: Sequence[int], args: argparse.Namespace, horizon_s: float) -> int:
    from ddiloco.scale import goodput_model as gp

    if args.max_learners < 1:
        raise ConfigError(f"max-learners must be >= 1, got {args.max_learners}")
    answers = []
    for m in models:
        for n in chips:
            learners, goodput = gp.smallest_learners(args.target_goodput, n, m, max_learners=args.max_learners,
                                                     seeds=args.seeds, seed=args.seed, horizon_s=horizon_s)
            answers.append({"chips": n, "mtbi_days": m.mtbi_s / DAY_S, "target_goodput": args.target_goodput,
                            "learners": learners, "goodput": goodput})
    if args.json:
        print(json.dumps(answers, indent=1))
        return 0
    console = Console()
    for a in answers:
        where = f"{_chips_label(int(a['chips']))} chips, MTBI {a['mtbi_days']:g} days"
        if a["learners"] is None:
            console.print(f"{where}: no M up to {args.max_learners} reaches {a['target_goodput']:.0%} "
                          f"(best {a['goodput']:.1%})")
        else:
            console.print(f"{where}: M = {a['learners']} reaches {a['goodput']:.1%} (target {a['target_goodput']:.0%})")
    return 0


def _calibrate(model: gp.ClusterModel, args: argparse.Namespace, horizon_s: float) -> int:
    from ddiloco.scale import goodput_model as gp
    from ddiloco.scale.goodput_fit import FIT_NAMES, fit_recovery_constants, held_out_goodput

    fitted = fit_recovery_constants(model, seeds=args.seeds, horizon_s=horizon_s)
    rows = gp.simulate_table(gp.DEFAULT_CONFIGS, [gp.CALIBRATION_CHIPS], fitted, seeds=args.seeds, horizon_s=horizon_s)
    held_out = held_out_goodput(model, seeds=args.seeds, horizon_s=horizon_s)
    constants = {k: getattr(fitted, k) for k in FIT_NAMES}
    cells = [{"config": r.config, "goodput": r.goodput, "published": gp.PUBLISHED_GOODPUT_1_2M[r.config],
              "held_out_goodput": held_out.get(r.config)} for r in rows]
    if args.json:
        print(json.dumps({"constants": constants, "cells": cells}, indent=1))
        return 0
    console = Console()
    console.print("fitted on the 1.2M-chip column: " + ", ".join(f"{k} = {v:g}" for k, v in constants.items()))
    table = Table(title="calibration at 1.2M chips, MTBI 1 year")
    for col in ("config", "fitted", "published", "error", "held out", "error"):
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for c in cells:
        out = c["held_out_goodput"]
        table.add_row(c["config"], f"{c['goodput']:.1%}", f"{c['published']:.0%}",
                      f"{100 * (c['goodput'] - c['published']):+.1f}",
                      "-" if out is None else f"{out:.1%}",
                      "-" if out is None else f"{100 * (out - c['published']):+.1f}")
    console.print(table)
    console.print("errors in points; held out: the cell predicted by a fit on the other elastic cells of the column "
                  "(dp has a constant of its own). Every cell of every other column is a prediction the paper gives "
                  "nothing to check against.")
    return 0


def plot_goodput(rows: Sequence[gp.Row], path: str) -> None:
    """Goodput against cluster size, one line per configuration (one panel per failure rate)."""
    import matplotlib

    from ddiloco.scale import goodput_model as gp

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mtbis = sorted({r.mtbi_s for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(mtbis), figsize=(6.5 * len(mtbis), 4.6), squeeze=False, sharey=True)
    for ax, mtbi in zip(axes[0], mtbis):
        configs = list(dict.fromkeys(r.config for r in rows if r.mtbi_s == mtbi))
        for name in configs:
            series = sorted((r for r in rows if r.mtbi_s == mtbi and r.config == name), key=lambda r: r.chips)
            x = [r.chips for r in series]
            ax.errorbar(x, [100 * r.goodput for r in series], yerr=[100 * r.goodput_std for r in series],
                        marker="o", capsize=3, label=name)
            published = gp.PUBLISHED_GOODPUT_1_2M.get(name)
            if published is not None and abs(mtbi - gp.SECONDS_PER_YEAR) < 1:
                color = ax.lines[-1].get_color()
                ax.scatter([gp.CALIBRATION_CHIPS], [100 * published], marker="*", s=140, color=color,
                           edgecolor="black", zorder=5)
        ax.set_xscale("log")
        ticks = sorted({r.chips for r in rows})
        ax.set_xticks(ticks, [_chips_label(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("chips")
        ax.set_title(f"MTBI {mtbi / DAY_S:g} days per chip (★ = published, 1.2M)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, 100)
    axes[0][0].set_ylabel("goodput (%)")
    axes[0][-1].legend(loc="lower left", fontsize=8, title="bars: ±1 std over seeds", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
