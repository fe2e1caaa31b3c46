"""Decoupled DiLoCo against data parallel on real capped links, with the bandwidth model beside them.

Every point is a real run (``run_real`` with ``--hosts netns``): the synchronizer and
each learner (or each data-parallel rank) in its own network namespace, every learner's link
capped both ways with ``tc``, the same workload and seed in both modes. Per link rate and
mode, from ``timeline.jsonl`` over a window that starts ``--warmup`` seconds after every
learner took its first step (a join's download is not steady state):

- **tokens merged into the global model per second at the mode's own period**, the one
  criterion for both modes. Data parallel merges every step's tokens (its all-reduce is the
  step). A Decoupled DiLoCo learner's accepted contribution merges up to one period H of its
  steps into a fragment: accepted contributions per second x H / P x tokens per step, at most
  the tokens it trained. A learner
  whose link cannot carry a fragment every H steps folds several periods into one
  contribution; those tokens reach the model too, but at a longer period than the protocol's,
  so they do not count as keeping up (counting them, a learner on a 200 kbit/s link would
  merge more tokens than an uncapped one: it trains faster once the link stops taking CPU);
- steps per second per learner (the learner's own count) and, for Decoupled DiLoCo, fragment
  versions merged per minute and each learner's accepted contributions per minute (a learner
  can train at full speed while nothing it sends is merged);
- bytes per second on every learner's link, per direction, and the link's utilization.

Then the smallest link on which each mode keeps >= 95% of the tokens it merges per second
uncapped, their ratio, and the bandwidth model's
(:mod:`ddiloco.scale.bandwidth_model`, fed this workload's parameters, codec, H, P, tau and each
mode's measured uncapped step time) required links and ratio; a plot of throughput against
link capacity for both modes with the model's predictions on the same axes. Points are
kept in ``OUT/points/``, each with the commit and date it was measured at: a later call with other ``--modes`` or ``--rates`` adds to them, a
call with the same ones adds samples (a point's figures are then the mean of its samples,
and the table shows their spread), and the table and plot are rebuilt from every point
there (``--report`` only rebuilds).

    python benchmarks/bench_wan.py                                   # both ladders (~35 min on 2 cores)
    python benchmarks/bench_wan.py --modes dp --rates uncapped 200mbit 50mbit
    python benchmarks/bench_wan.py --report                          # table and plot from the saved points
    python benchmarks/bench_wan.py --quick                           # tiny preset, 3 rates per mode

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from stamp import stamp

from ddiloco.commands.run import run_real
from ddiloco.runtime.launch.run_log import read_timeline
from ddiloco.runtime.launch.topology import format_rate, parse_rate, uniform
from ddiloco.runtime.layout import reference_layout
from ddiloco.scale import bandwidth_model as bw
from ddiloco.settings.config import Config
from ddiloco.settings.config_sources import build_config

MODES = ("decoupled", "dp")
LADDERS = {
    "decoupled": ("uncapped", "20mbit", "5mbit", "2mbit", "1mbit", "500kbit"),
    "dp": ("uncapped", "500mbit", "200mbit", "100mbit", "50mbit", "20mbit", "5mbit"),
}
QUICK = {"decoupled": ("uncapped", "2mbit", "200kbit"), "dp": ("uncapped", "20mbit", "2mbit")}
KEEP = 0.95


def rate_bps(text: str) -> float | None:
    return None if text == "uncapped" else parse_rate(text, "--rates")


def measure(base: Config, mode: str, rate_text: str, warmup_s: float, window_s: float, out: Path) -> dict[str, Any]:
    """One real run of ``mode`` on links of ``rate_text``; its steady-state rates over the window."""
    rate = rate_bps(rate_text)
    learners = [f"learner-{i}" for i in range(base.run.learners)]
    state_bits = 32 * sum(f.numel for f in reference_layout(base, base.protocol).plan.fragments)
    join_s = state_bits / rate if rate else 0.0  # the initial state (or DDP's broadcast) has to arrive first
    config = replace(base, run=replace(base.run, mode=mode, tokens=0, time_s=warmup_s + window_s + join_s + 10),
                     train=replace(base.train, evals=1)).validate()
    stamped = stamp(__file__)
    load = os.getloadavg()[0]
    started = time.monotonic()
    summary, _ = run_real(config, out, topology=uniform(learners, rate), timeout_s=config.run.time_s + 600)
    tokens_per_step = config.train.batch_size * config.model.seq_len
    per_contribution = config.protocol.period / config.protocol.fragments * tokens_per_step
    point = {"mode": mode, "rate": rate_text, "rate_bps": rate, "commit": stamped["commit"], "date": stamped["date"],
             "load_before": round(load, 2),
             "load_after": round(os.getloadavg()[0], 2), "wall_s": round(time.monotonic() - started, 1),
             "eval_loss": summary["eval_loss"], "warmup_s": warmup_s, "window_s": window_s,
             **steady_state(read_timeline(out / "timeline.jsonl"), learners, warmup_s, window_s, rate, tokens_per_step,
                            per_contribution)}
    print(f"  {mode:<9} {rate_text:>9}: {point['merged_tokens_per_s']:8.0f} tokens merged/s, "
          f"{point['steps_per_s']:6.3f} steps/s per learner, "
          f"{point['merges_per_min']:7.1f} merges/min, link up {point['up_bytes_per_s'] / 1e3:8.1f} kB/s "
          f"(util {point['utilization']:.0%}), load {load:.2f} -> {point['load_after']:.2f}", flush=True)
    return point


def steady_state(rows: list[dict[str, Any]], learners: list[str], warmup_s: float, window_s: float,
                 rate: float | None, tokens_per_step: int, per_contribution: float) -> dict[str, Any]:
    """Rates between ``warmup_s`` after every learner's first step and ``window_s`` later (or the last row).
    Tokens merged: ``per_contribution`` for each accepted contribution (rows of a synchronized
    run), else ``tokens_per_step`` for each step (data parallel, whose every step is merged)."""
    stepping = [r for r in rows if all(r["steps"].get(n, 0) > 0 for n in learners)]
    empty = {"merged_tokens_per_s": 0.0, "steps_per_s": 0.0, "steps_per_s_each": [0.0] * len(learners),
             "merges_per_min": 0.0,
             "accepted_per_min": {}, "links": {}, "up_bytes_per_s": 0.0, "down_bytes_per_s": 0.0,
             "utilization": 0.0, "window": None, "starved": "not every learner took a step"}
    if not stepping:
        return empty
    start = stepping[0]["t"] + warmup_s
    inside = [r for r in stepping if start <= r["t"] <= start + window_s]
    if len(inside) < 2:
        return {**empty, "starved": f"the run ended before {warmup_s:.0f}s of warm-up and a window had passed"}
    a, b = inside[0], inside[-1]
    dt = b["t"] - a["t"]
    each = [(b["steps"][n] - a["steps"][n]) / dt for n in learners]
    # A learner's own steps cap what it merged: a contribution may cover fewer steps than H (the
    # first of a fragment, one sent early to stay in phase with its rounds).
    merged = sum(min((b["accepted"].get(n, 0) - a["accepted"].get(n, 0)) / dt * per_contribution,
                     steps * tokens_per_step) for n, steps in zip(learners, each)) \
        if "accepted" in a else sum(each) * tokens_per_step
    links = {n: {d: (b["links"][n][d] - a["links"][n][d]) / dt for d in ("up", "down")} for n in learners}
    versions = (sum(b["versions"]) - sum(a["versions"])) / dt * 60 if "versions" in a else sum(each) / len(each) * 60
    accepted = {n: (b["accepted"].get(n, 0) - a["accepted"].get(n, 0)) / dt * 60 for n in learners} \
        if "accepted" in a else {}
    up = sum(v["up"] for v in links.values()) / len(links)
    down = sum(v["down"] for v in links.values()) / len(links)
    return {"merged_tokens_per_s": merged,
            "steps_per_s": sum(each) / len(each), "steps_per_s_each": each, "merges_per_min": versions,
            "accepted_per_min": accepted, "links": links, "up_bytes_per_s": up, "down_bytes_per_s": down,
            "bytes_per_step": {"up": up / max(1e-9, sum(each) / len(each)),
                               "down": down / max(1e-9, sum(each) / len(each))},
            "utilization": 8 * max(up, down) / rate if rate else 0.0, "window": [a["t"], b["t"]], "starved": ""}


# ---- the report ------------------------------------------------------------------------------


def model_inputs(config: Config, step_s: float) -> bw.BandwidthInputs:
    """This workload in the bandwidth model's terms (K = M sites: each learner on its own link)."""
    protocol = config.protocol
    params = sum(f.numel for f in reference_layout(config, protocol).plan.fragments)
    return bw.BandwidthInputs(params=params, step_s=step_s, sites=config.run.learners, dp_bits=16.0, bits=4.0,
                              block_size=protocol.block_size, inner_steps=protocol.period,
                              fragments=protocol.fragments, overlap_steps=protocol.overlap,
                              target_utilization=KEEP)


def combine(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per (mode, rate): the mean of its samples' rates, with their number and spread."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for sample in samples:
        groups.setdefault((sample["mode"], sample["rate"]), []).append(sample)
    points = []
    for group in groups.values():
        point = dict(group[-1])
        for key in ("merged_tokens_per_s", "steps_per_s", "merges_per_min", "up_bytes_per_s", "down_bytes_per_s",
                    "utilization"):
            point[key] = sum(g.get(key, math.nan) for g in group) / len(group)
        merged = [g.get("merged_tokens_per_s", math.nan) for g in group]
        spread = (max(merged) - min(merged)) / point["merged_tokens_per_s"] if point["merged_tokens_per_s"] else 0.0
        point.update(samples=len(group), spread=spread, commits=sorted({g.get("commit", "unknown") for g in group}),
                     load_before=min(g["load_before"] for g in group), load_after=max(g["load_after"] for g in group))
        points.append(point)
    return points


def relative(points: list[dict[str, Any]]) -> None:
    """Each point against its own mode's uncapped point: tokens merged, steps, merges, merges per learner step."""
    base = {p["mode"]: p for p in points if p["rate_bps"] is None}

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    for p in points:
        ref = base.get(p["mode"], {"merged_tokens_per_s": 0.0, "steps_per_s": 0.0, "merges_per_min": 0.0})
        p["rel_merged"] = ratio(p["merged_tokens_per_s"], ref["merged_tokens_per_s"])
        p["rel_steps"] = ratio(p["steps_per_s"], ref["steps_per_s"])
        p["rel_merges"] = ratio(p["merges_per_min"], ref["merges_per_min"])
        p["rel_merged_share"] = ratio(ratio(p["merges_per_min"], p["steps_per_s"]),
                                      ratio(ref["merges_per_min"], ref["steps_per_s"]))


def keeps(p: dict[str, Any]) -> bool:
    """>= 95% of the tokens its mode merges into the global model per second uncapped: one criterion
    for both modes (a Decoupled DiLoCo learner that trains at full speed while little of its work
    is merged does not keep up)."""
    return p["rel_merged"] >= KEEP


def threshold(points: list[dict[str, Any]], mode: str) -> float | None:
    """The smallest link on which ``mode`` (and every faster link measured) keeps >= 95%; None if none does."""
    capped = sorted((p for p in points if p["mode"] == mode and p["rate_bps"]), key=lambda p: -p["rate_bps"])
    best = None
    for p in capped:
        if not keeps(p):
            break
        best = p["rate_bps"]
    return best


def report(config: Config, points: list[dict[str, Any]], plot: Path) -> dict[str, Any]:
    relative(points)
    step_s = {m: 1 / p["steps_per_s"] for m in MODES for p in points
              if p["mode"] == m and p["rate_bps"] is None and p["steps_per_s"]}
    model = {}
    for mode, fn in (("decoupled", bw.decoupled_step_s), ("dp", bw.dp_step_s)):
        if mode in step_s:
            needed = bw.required_bps(model_inputs(config, step_s[mode]), fn)
            model[mode] = {"step_s": step_s[mode], "required_bps": needed}
    measured = {m: threshold(points, m) for m in MODES}
    summary = {
        "keep": KEEP, "measured_bps": measured, "model": model,
        "measured_ratio": measured["dp"] / measured["decoupled"] if measured["dp"] and measured["decoupled"] else None,
        "model_ratio": model["dp"]["required_bps"] / model["decoupled"]["required_bps"] if len(model) == 2 else None,
    }
    if "decoupled" in step_s:
        x = model_inputs(config, step_s["decoupled"])
        summary["model_learner_bytes_per_step"] = bw.learner_bytes_per_step(x)
    if "dp" in step_s:
        summary["model_dp_bytes_per_step"] = bw.dp_bits_per_step(model_inputs(config, step_s["dp"])) / 8
    print_table(points, summary)
    plot_wan(plot, config, points, summary)
    return summary


def print_table(points: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print(f"\n{'mode':<10}{'link':>11}{'merged tok/s':>13}{'rel':>7}{'steps/s':>9}{'rel':>7}{'merges/min':>12}"
          f"{'rel':>7}{'per step':>9}"
          f"{'accepted/min':>14}"
          f"{'up kB/s':>9}{'down kB/s':>10}{'util':>6}{'n':>3}{'spread':>8}{'load':>11}")
    for p in sorted(points, key=lambda p: (p["mode"], -(p["rate_bps"] or math.inf))):
        accepted = "/".join(f"{v:.0f}" for v in p["accepted_per_min"].values()) or "-"
        print(f"{p['mode']:<10}{format_rate(p['rate_bps']):>11}{p['merged_tokens_per_s']:13.0f}{p['rel_merged']:7.1%}"
              f"{p['steps_per_s']:9.3f}{p['rel_steps']:7.1%}"
              f"{p['merges_per_min']:12.1f}{p['rel_merges']:7.1%}{p['rel_merged_share']:9.1%}{accepted:>14}"
              f"{p['up_bytes_per_s'] / 1e3:9.1f}"
              f"{p['down_bytes_per_s'] / 1e3:10.1f}{p['utilization']:6.0%}{p['samples']:3d}{p['spread']:8.1%}"
              f"{p['load_before']:6.2f}-{p['load_after']:<4.2f}" + (f"  {p['starved']}" if p["starved"] else ""))
    for mode in MODES:
        m, kept = summary["model"].get(mode), summary["measured_bps"][mode]
        print(f"{mode}: keeps >= {KEEP:.0%} " + (f"down to {format_rate(kept)}" if kept else
                                                "on no capped link") + " measured; "
              + (f"model needs {format_rate(m['required_bps'])} (uncapped step {m['step_s']:.3f} s)" if m else ""))
    if summary["measured_ratio"] and summary["model_ratio"]:
        print(f"data parallel needs {summary['measured_ratio']:.0f}x the link Decoupled DiLoCo needs, measured; "
              f"the model says {summary['model_ratio']:.0f}x")


def plot_wan(path: Path, config: Config, points: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capped = [p["rate_bps"] for p in points if p["rate_bps"]]
    if not capped:
        return
    lo, hi = min(capped) / 2, max(capped) * 2
    uncapped_x = hi * 2  # uncapped points sit right of the ladder, labelled
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(9, 6.2))
    colors = {"decoupled": "#1f77b4", "dp": "#d62728"}
    names = {"decoupled": "Decoupled DiLoCo", "dp": "data parallel"}
    for mode, fn in (("decoupled", bw.decoupled_step_s), ("dp", bw.dp_step_s)):
        mine = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["rate_bps"] or uncapped_x)
        if not mine:
            continue
        xs = [p["rate_bps"] or uncapped_x for p in mine]
        ax.plot([x / 1e6 for x in xs], [p["rel_merged"] for p in mine], "o-", color=colors[mode],
                label=f"{names[mode]}: tokens merged/s (measured; the 95% criterion)")
        if mode == "decoupled":
            ax.plot([x / 1e6 for x in xs], [p["rel_steps"] for p in mine], "^--", color=colors[mode], alpha=0.6,
                    label=f"{names[mode]}: learner steps/s (measured)")
        m = summary["model"].get(mode)
        if m:
            x = model_inputs(config, m["step_s"])
            ax.plot([g / 1e6 for g in grid], [x.step_s / fn(x, g) for g in grid], ":", color=colors[mode], lw=2,
                    label=f"{names[mode]}: bandwidth model (needs {format_rate(m['required_bps'])})")
    ax.axhline(KEEP, color="0.5", lw=0.8)
    ax.text(lo / 1e6, KEEP + 0.01, f"{KEEP:.0%} of uncapped", fontsize=8, color="0.4")
    ax.axvline(hi / 1e6 * 1.4, color="0.8", lw=0.8)
    ax.set_xscale("log")
    shown = [p[k] for p in points for k in ("rel_merged", "rel_steps") if math.isfinite(p[k])]
    ax.set_ylim(-0.03, max([1.1] + [v + 0.05 for v in shown]))
    ticks = sorted(set(capped)) + [uncapped_x]
    # One line each, so that close ticks (4M, 5M, 6M) fit side by side.
    labels = [format_rate(t).replace(" kbit/s", "k").replace(" Mbit/s", "M").replace(" Gbit/s", "G")
              for t in ticks[:-1]] + ["uncapped"]
    ax.set_xticks([t / 1e6 for t in ticks], labels, fontsize=7)
    ax.minorticks_off()
    ax.set(xlabel="link capacity per learner and direction (bit/s)", ylabel="throughput / its own uncapped throughput",
           title=f"{config.run.learners} learners, {model_inputs(config, 1.0).params:,.0f} parameters: "
           "real runs on tc-capped links vs the bandwidth model")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="default")
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rates", nargs="+", metavar="RATE", help="links to measure (default: each mode's ladder)")
    parser.add_argument("--warmup", type=float, default=20.0, metavar="SECONDS")
    parser.add_argument("--window", type=float, default=40.0, metavar="SECONDS")
    parser.add_argument("--out", default="runs/bench_wan", help="runs and points (default runs/bench_wan)")
    parser.add_argument("--plot", default=None, help="the plot (default OUT/wan.png)")
    parser.add_argument("--json", default=None, help="the points and summary (default OUT/wan.json)")
    parser.add_argument("--report", action="store_true", help="only rebuild the table and plot from OUT/points")
    parser.add_argument("--quick", action="store_true", help="tiny preset, 3 rates per mode, short windows")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.warmup, args.window = "tiny", 5.0, 10.0
    config = build_config(preset=args.preset, overrides=tuple(args.overrides), run__learners=args.learners)
    out = Path(args.out)
    (out / "points").mkdir(parents=True, exist_ok=True)
    if not args.report:
        print(f"bench_wan: {args.preset} preset, M={args.learners}, warm-up {args.warmup:.0f}s, "
              f"window {args.window:.0f}s, load {os.getloadavg()[0]:.2f}", flush=True)
        for mode in args.modes:
            for rate in args.rates or (QUICK if args.quick else LADDERS)[mode]:
                rate_bps(rate)  # a bad rate fails before anything runs
        for mode in args.modes:
            for rate in args.rates or (QUICK if args.quick else LADDERS)[mode]:
                n = len(list((out / "points").glob(f"{mode}-{rate}-*.json")))
                point = measure(config, mode, rate, args.warmup, args.window, out / "runs" / f"{mode}-{rate}-{n}")
                (out / "points" / f"{mode}-{rate}-{n}.json").write_text(json.dumps(point, indent=1))
    points = combine([json.loads(p.read_text()) for p in sorted((out / "points").glob("*.json"))])
    summary = report(config, points, Path(args.plot or out / "wan.png"))
    Path(args.json or out / "wan.json").write_text(json.dumps({**stamp(__file__, argv), "points": points,
                                                                "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
