"""The quality gap across model sizes: Decoupled DiLoCo and synchronous DiLoCo against data parallel.

For each model size of a plan, at equal tokens on the virtual cluster (no failures, uniform
hardware): data parallel over M = 4 replicas, Decoupled DiLoCo (M = 4, K = 1, the
protocol's defaults) and synchronous DiLoCo (K = M, blocking, α = 0, mean). Every mode's
inner learning rate is the best of the same small grid; every run decays it with the same
cosine schedule (to 0.1 of the peak, indexed by the run's tokens: a learner that joins late
takes the rate the run has reached). The gap is a mode's best final eval loss over data
parallel's, minus one, plotted against parameters beside the published M = 4 points of the
DiLoCo scaling study (Charles et al. 2025, Table 4; docs/results.md section 7), with the table behind it as JSON.

    PYTHONPATH=src python benchmarks/bench_scale.py --preset smoke --out build/scale-smoke   # CPU, a few minutes
    PYTHONPATH=src python benchmarks/bench_scale.py --preset gpu --device cuda --estimate     # projected minutes
    PYTHONPATH=src python benchmarks/bench_scale.py --preset gpu --device cuda --sizes 1m,3m --out build/scale
    PYTHONPATH=src python benchmarks/bench_scale.py --preset smoke --sizes 119k --variants all  # closing the gap

Runs already in ``OUT/table.json`` (same size, mode, variant, lr, tokens, seed, precision,
codec and device kind) are not run again, so a plan can be spread over several commands.
``--variants`` runs candidate changes to Decoupled DiLoCo at the given sizes, each against
the same data-parallel baseline. A size (``NAME`` of the preset, or ``WIDTHxLAYERS``) that
would not fit the device's memory is one line and exit 2, before anything is trained.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from stamp import load_now, stamp

from ddiloco.commands.options import add_device_option
from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.config import Config
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.experiment import run_virtual, run_warm_started
from ddiloco.workload.corpus import load_corpus
from ddiloco.workload.device import resolve_device
from ddiloco.workload.model import VOCAB_SIZE
from ddiloco.workload.trainer import Precision
from ddiloco.workload.workload import Workload

LEARNERS = 4
MODES = ("dp", "decoupled", "diloco")
PUBLISHED_M4 = ((35e6, 2.0), (90e6, 1.5), (180e6, 1.1), (335e6, 0.9), (550e6, 0.7), (1.3e9, 0.5), (2.4e9, 0.3))
"""Scaling Laws for DiLoCo (Charles et al. 2025): eval-loss gap of DiLoCo M = 4 to data parallel, %."""


@dataclass(frozen=True)
class Size:
    """A byte transformer of the ladder (heads of width 64, at least one) and its batch per learner."""

    name: str
    d_model: int
    n_layers: int
    seq_len: int
    batch_size: int

    @property
    def n_heads(self) -> int:
        return max(1, self.d_model // 64) if self.d_model % 64 == 0 else 1

    @property
    def params(self) -> int:
        """Exactly ``ByteTransformer``'s count (tied head): embeddings, blocks, final norm."""
        d = self.d_model
        return VOCAB_SIZE * d + self.seq_len * d + self.n_layers * (12 * d * d + 2 * d) + d

    def overrides(self) -> tuple[str, ...]:
        return (f"model.d_model={self.d_model}", f"model.n_layers={self.n_layers}", f"model.n_heads={self.n_heads}",
                f"model.seq_len={self.seq_len}", f"train.batch_size={self.batch_size}")


@dataclass(frozen=True)
class Plan:
    sizes: tuple[Size, ...]
    tokens_per_param: dict[str, int]
    lrs: tuple[float, ...]
    grid_sizes: tuple[str, ...]
    """Sizes where every mode tries every lr; the others reuse each mode's best at the largest of these."""
    eval_batches: int
    codec: str
    corpus_max_bytes: int


def _ladder(seq_len: int, batch: int, *specs: tuple[str, int, int]) -> tuple[Size, ...]:
    return tuple(Size(name, d, layers, seq_len, batch) for name, d, layers in specs)


PLANS = {
    # Seconds: what the test runs.
    "test": Plan(_ladder(16, 4, ("7k", 16, 1), ("14k", 24, 1)), {"7k": 1, "14k": 1}, (3e-3,), ("7k", "14k"), 4,
                 "fp32", 2**20),
    # A few minutes on one CPU thread: CI and users without a GPU.
    "smoke": Plan(_ladder(64, 8, ("35k", 32, 2), ("119k", 64, 2)), {"35k": 10, "119k": 10}, (1.5e-3, 3e-3),
                  ("35k", "119k"), 8, "fp32", 16 * 2**20),
    # The GPU ladder, ~0.85M to ~32M parameters; see docs/results.md for the commands and their timing.
    # Larger models take larger batches: fewer steps, so the virtual cluster's per-step cost on
    # the host (events, Δ, merges) weighs less against the GPU's.
    "gpu": Plan(_ladder(256, 16, ("1m", 128, 4), ("3m", 192, 6)) + _ladder(256, 32, ("8m", 256, 10))
                + _ladder(256, 64, ("15m", 384, 8), ("30m", 512, 10)),
                {"1m": 20, "3m": 10, "8m": 10, "15m": 10, "30m": 10}, (1e-3, 2e-3, 4e-3), ("1m", "3m"), 32,
                "fp32", 16 * 2**20),
}


@dataclass(frozen=True)
class Variant:
    """A candidate change to Decoupled DiLoCo, measured against data parallel's base recipe,
    or against data parallel with the same change where it is one to the recipe of every mode."""

    overrides: tuple[str, ...] = ()
    baseline_too: bool = False
    warm_fraction: float = 0.0
    """Share of the tokens trained as data parallel before the learners start from its weights."""
    batch_factor: int = 1
    """Each learner's batch × this (fewer, less noisy inner steps; the same tokens)."""


VARIANTS = {
    "base": Variant(),
    "constant-lr": Variant(("train.schedule=constant",), baseline_too=True),
    "dp-warm-start": Variant(warm_fraction=0.1),
    "mean-merge": Variant(("protocol.merge=mean",)),
    "batch-x-M": Variant(batch_factor=LEARNERS),
    "period-6": Variant(("protocol.period=6",)),
    # Diagnostics for a run that does not train (section 7's 3m): each removes one of the ways
    # Decoupled DiLoCo's learners and outer step differ from synchronous DiLoCo's.
    "alpha-0": Variant(("protocol.alpha=0",)),
    "no-momentum": Variant(("protocol.outer_momentum=0",)),
    "no-align": Variant(("protocol.align_sends=false",)),
}


def parse_size(spec: str, plan: Plan) -> Size:
    """A size of the plan by name, or ``WIDTHxLAYERS`` with the plan's sequence length and batch."""
    by_name = {s.name: s for s in plan.sizes}
    if spec in by_name:
        return by_name[spec]
    width, sep, layers = spec.partition("x")
    if not (sep and width.isdigit() and layers.isdigit() and int(width) >= 8 and int(layers) >= 1):
        raise ConfigError(f"--sizes: unknown size {spec!r} (choose from {', '.join(by_name)} or WIDTHxLAYERS)")
    ref = plan.sizes[-1]
    return Size(spec, int(width), int(layers), ref.seq_len, ref.batch_size)


def memory_needed(size: Size, precision: str) -> int:
    """Bytes a run of ``size`` needs at its peak, roughly: M learners' fp32 weights, gradients, AdamW
    moments, anchors and Δ, the evaluation model, and one step's activations (data parallel's
    M-fold batch). Rough on purpose: it is there to refuse a size that cannot fit before hours go in."""
    state = (LEARNERS + 1) * size.params * 4 * 6
    per_token = size.n_layers * 34 * size.d_model + 3 * VOCAB_SIZE
    # Korthikanti et al.'s 34·d bytes per token and layer are for 16-bit activations (fp32: twice).
    activations = LEARNERS * size.batch_size * size.seq_len * per_token * (1 if precision == "bf16" else 2)
    return state + activations


def memory_available(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def check_fits(sizes: list[Size], device: torch.device, precision: str) -> None:
    free = memory_available(device)
    for size in sizes:
        need = memory_needed(size, precision)
        if need > 0.9 * free:
            raise ConfigError(f"size {size.name!r} ({size.params / 1e6:.1f}M parameters) needs about "
                              f"{need / 2**30:.1f} GiB on {device}, which has {free / 2**30:.1f} GiB free")


def make_config(size: Size, mode: str, lr: float, tokens: int, variant: Variant, args: argparse.Namespace,
                plan: Plan) -> Config:
    batch = size.batch_size * (variant.batch_factor if mode != "dp" else 1)
    steps = tokens // (LEARNERS * batch * size.seq_len)
    eval_batches = plan.eval_batches * size.batch_size // batch  # the same held-out windows for every run
    overrides = (*size.overrides(), f"run.mode={mode}", f"run.learners={LEARNERS}", f"run.tokens={tokens}",
                 f"run.seed={args.seed}", f"train.lr={lr}", f"train.batch_size={batch}",
                 f"train.warmup_steps={max(5, steps // 50)}", "train.schedule=cosine", "train.lr_min_ratio=0.1",
                 f"train.precision={args.precision}", f"train.eval_batches={eval_batches}", "train.evals=8",
                 f"train.corpus_max_bytes={args.corpus_max_bytes or plan.corpus_max_bytes}",
                 f"protocol.codec={args.codec or plan.codec}", f"protocol.downlink_codec={args.codec or plan.codec}",
                 "cluster.jitter=0.05",
                 *(variant.overrides if mode != "dp" or variant.baseline_too else ()))
    if args.corpus:
        overrides += (f"train.corpus={json.dumps(args.corpus)}",)
    return build_config(preset="default", overrides=overrides)  # the protocol's defaults (P = 4, H = 12)


class Table:
    """``OUT/table.json``: one row per run, written after each, read back to skip what is done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = json.loads(path.read_text())["runs"] if path.exists() else []

    @staticmethod
    def key(row: dict[str, Any]) -> tuple:
        return tuple(row[k] for k in ("size", "mode", "variant", "lr", "tokens", "seed", "precision", "codec",
                                      "device_type"))

    def find(self, key: tuple) -> dict[str, Any] | None:
        return next((r for r in self.rows if self.key(r) == key), None)

    def add(self, row: dict[str, Any]) -> None:
        """Append a run and rewrite the file atomically (a command stopped mid-write keeps the old one)."""
        self.rows.append(row)
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps({"runs": self.rows, "gaps": gaps(self.rows)}, indent=1) + "\n")
        os.replace(partial, self.path)


def gaps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size, tokens, variant and seed: each mode's best lr and loss, and its gap to data parallel's best."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        k = (r["size"], r["tokens"], r["mode"], r["variant"], r["seed"], r["precision"], r["codec"], r["device_type"])
        if k not in best or r["eval_loss"] < best[k]["eval_loss"]:
            best[k] = r
    out = []
    for (size, tokens, mode, variant, seed, precision, codec, kind), r in sorted(best.items(),
                                                                                 key=lambda kv: kv[1]["params"]):
        baseline = variant if variant in VARIANTS and VARIANTS[variant].baseline_too else "base"
        dp = best.get((size, tokens, "dp", baseline, seed, precision, codec, kind))
        if mode == "dp" or dp is None:
            continue
        out.append({"size": size, "params": r["params"], "tokens": tokens, "tokens_per_param": r["tokens_per_param"],
                    "mode": mode, "variant": variant, "lr": r["lr"], "eval_loss": r["eval_loss"],
                    "dp_variant": baseline, "dp_lr": dp["lr"],
                    "dp_eval_loss": dp["eval_loss"], "gap_pct": round(100 * (r["eval_loss"] / dp["eval_loss"] - 1), 3),
                    "seed": seed, "device": r["device"], "precision": precision, "codec": codec})
    return out


DID_NOT_TRAIN_PCT = 100.0
"""A gap above this is a run that did not train (docs/results.md section 7), not a point on a curve."""


def published_fit() -> tuple[float, float]:
    """(a, b) of gap% = a · N^b fit by least squares in log-log space to the published M = 4 points."""
    logs = np.log([n for n, _ in PUBLISHED_M4]), np.log([g for _, g in PUBLISHED_M4])
    b, log_a = np.polyfit(*logs, 1)
    return float(np.exp(log_a)), float(b)


def plot(path: Path, table: list[dict[str, Any]], title: str) -> None:
    """Our base recipe's gaps (mean over seeds, each with its tokens per parameter) beside the published M = 4
    points and their power-law fit, extended down to the sizes we train."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    by_point: dict[tuple, list[float]] = {}
    for g in table:  # seeds: their mean; budgets: points of their own
        by_point.setdefault((g["mode"], g["variant"], g["params"], g["tokens_per_param"]), []).append(g["gap_pct"])
    mean = {k: sum(v) / len(v) for k, v in by_point.items()}
    trained = {k: v for k, v in mean.items() if v <= DID_NOT_TRAIN_PCT}
    for mode, style, label in (("decoupled", "o-", "ours: Decoupled DiLoCo M=4, K=1"),
                               ("diloco", "s--", "ours: synchronous DiLoCo M=4")):
        pts = sorted((params, gap) for (m, v, params, _), gap in trained.items() if m == mode and v == "base")
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for (mode, variant, params, tpp), gap in trained.items():  # candidate changes: in the table, not here
        if mode == "decoupled" and variant == "base":
            ax.annotate(f"{tpp:g} tok/param", (params, gap), fontsize=7, xytext=(4, -10), textcoords="offset points")
    for (mode, variant, params, tpp), gap in mean.items():
        if gap > DID_NOT_TRAIN_PCT and variant == "base":
            ax.annotate(f"{mode} at {params / 1e6:.1f}M, {tpp:g} tok/param: did not train (+{gap:.0f}%)", (params, 0),
                        fontsize=7, color="red", xytext=(0, 12), textcoords="offset points", ha="center",
                        arrowprops={"arrowstyle": "-", "color": "red", "lw": 0.6})
    ax.plot(*zip(*PUBLISHED_M4), "k^", label="published: DiLoCo M=4 (Charles et al. 2025, C4, Chinchilla-optimal tokens)")
    a, b = published_fit()
    low = min([params for (_, _, params, _) in mean] + [PUBLISHED_M4[0][0]]) / 2
    xs = np.geomspace(low, PUBLISHED_M4[-1][0], 50)
    ax.plot(xs, a * xs ** b, ":", color="black", lw=0.9, label=f"its power-law fit, extended: {a:.3g}·N^{b:.3f} %")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="parameters", ylabel="eval-loss gap to data parallel (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(files: list[str], size: str, path: Path) -> int:
    """The eval-loss curves of every run of ``size`` the tables hold a curve for: where a run
    that ends badly went wrong, beside the runs that did not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for f in files for r in json.loads(Path(f).read_text())["runs"] if r["size"] == size and r.get("curve")]
    if not runs:
        raise ConfigError(f"no run of size {size!r} with a curve in {', '.join(files)}")
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    for r in sorted(runs, key=lambda r: (r["tokens"], r["mode"], r["variant"], r["lr"])):
        tokens, loss = zip(*r["curve"])
        variant = "" if r["variant"] == "base" else f" {r['variant']}"
        ax.plot(tokens, loss, "-" if r["mode"] == "dp" else "--" if r["mode"] == "diloco" else "-.", marker=".",
                label=f"{r['mode']}{variant}, lr {r['lr']:g}, {r['tokens_per_param']:g} tok/param")
    ax.set(xlabel="tokens (all learners)", ylabel="eval loss (global model)")
    ax.set_title(f"Eval loss during each {size} run ({runs[0]['device']}, {runs[0]['precision']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path} from {len(runs)} runs of {size}")
    return 0


def plot_tables(files: list[str], path: Path) -> int:
    """One plot from the gaps of several results tables (CPU and GPU runs on one curve)."""
    table = [g for f in files for g in json.loads(Path(f).read_text())["gaps"]]
    where = "; ".join(sorted({f"{g['device']}, {g['precision']}" for g in table}))
    plot(path, table, f"Gap to data parallel at equal tokens, beside the published curve\n({where}; mean over seeds)")
    print(f"wrote {path} from {len(table)} gaps of {', '.join(files)}")
    return 0


PROTOCOL_COUNTS = ("rounds_closed", "rejections", "honest_refused_steps", "norms_clipped", "merge_width",
                   "merge_coherence")
"""What a run's synchronizer did (``run_virtual``'s summary), kept beside its curve: a run that
does not train says whether its rounds merged few learners, or its contributions were refused."""


def run_one(config: Config, variant: Variant, workload: Workload) -> tuple[float, float, dict[str, Any]]:
    """(final eval loss, wall seconds, extras) of one run; extras hold the curve, [tokens, eval
    loss] at each evaluation (where a run that ends badly went wrong), and ``PROTOCOL_COUNTS``."""
    started = time.perf_counter()
    if variant.warm_fraction and config.run.mode != "dp":
        summary, rows = run_warm_started(config, variant.warm_fraction, workload=workload)
    else:
        summary, rows = run_virtual(config, workload=workload, check_invariants=False)
    extras: dict[str, Any] = {
        "curve": [[r["tokens"], round(r["eval_loss"], 4)] for r in rows if r.get("eval_loss") is not None]}
    extras.update((k, summary[k]) for k in PROTOCOL_COUNTS if k in summary and config.run.mode != "dp")
    return summary["eval_loss"], time.perf_counter() - started, extras


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=tuple(PLANS), default="smoke")
    parser.add_argument("--sizes", help="comma-separated sizes (default: the preset's)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--variants", default="base",
                        help=f"comma-separated candidate changes to Decoupled DiLoCo, or all: {', '.join(VARIANTS)}")
    parser.add_argument("--tokens-per-param", type=float, help="override the preset's tokens per parameter")
    parser.add_argument("--lrs", help="comma-separated inner lr grid (default: the preset's)")
    parser.add_argument("--precision", choices=[p.value for p in Precision], default="fp32")
    parser.add_argument("--codec", help="uplink and downlink codec (default: the preset's)")
    parser.add_argument("--corpus", help="directory of text files (default: the Python standard library)")
    parser.add_argument("--corpus-max-bytes", type=int, help="cap on the corpus (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--estimate", action="store_true",
                        help="time 2%% of each run of the plan and print the projected minutes; train nothing else")
    parser.add_argument("--out", default="build/scale", help="directory of table.json and gap.png")
    parser.add_argument("--plot-from", nargs="+", metavar="TABLE",
                        help="train nothing: draw the gaps of these results tables on one plot (--plot)")
    parser.add_argument("--plot", default="gap.png", help="with --plot-from: the PNG to write")
    parser.add_argument("--curves", metavar="SIZE",
                        help="with --plot-from: draw the eval curves of that size's runs instead of the gaps")
    add_device_option(parser)
    args = parser.parse_args(argv)
    try:
        if args.plot_from:
            if args.curves:
                return plot_curves(args.plot_from, args.curves, Path(args.plot))
            return plot_tables(args.plot_from, Path(args.plot))
        return _main(args)
    except ConfigError as err:
        print(f"bench_scale: {err}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    plan = PLANS[args.preset]
    device = resolve_device(args.device)
    names = args.sizes.split(",") if args.sizes else [s.name for s in plan.sizes]
    sizes = [parse_size(name.strip(), plan) for name in names]
    modes = [m.strip() for m in args.modes.split(",")]
    variants = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",")]
    for name, valid, what in ((modes, MODES, "--modes"), (variants, VARIANTS, "--variants")):
        for bad in (n for n in name if n not in valid):
            raise ConfigError(f"{what}: unknown {bad!r} (choose from {', '.join(valid)})")
    lrs = tuple(float(x) for x in args.lrs.split(",")) if args.lrs else plan.lrs
    check_fits(sizes, device, args.precision)
    if device.type == "cpu":
        torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = Table(out / "table.json")
    stamped = stamp(__file__)  # each run's row names the commit, command, date, machine and load it ran at
    data = load_corpus(args.corpus, max_bytes=args.corpus_max_bytes or plan.corpus_max_bytes)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, 1 thread"
    projected = 0.0
    for size in sizes:
        tpp = args.tokens_per_param or plan.tokens_per_param.get(size.name, 10)
        tokens = int(tpp * size.params)
        workload = None
        for mode in modes:
            names = variants if mode != "dp" else ["base", *(v for v in variants if VARIANTS[v].baseline_too)]
            for variant_name in names:
                variant = VARIANTS[variant_name]
                for lr in _lrs_for(size, mode, variant_name, lrs, plan, table, args.estimate):
                    config = make_config(size, mode, lr, tokens, variant, args, plan)
                    if args.estimate:
                        short = make_config(size, mode, lr, max(tokens // 50, 1), variant, args, plan)
                        workload = workload or Workload.build(short, device, data=data)
                        _, wall, _ = run_one(short, variant, workload)
                        projected += 50 * wall
                        print(f"{size.name:>6} {mode:<9} {variant_name:<13} lr {lr:g}: ~{50 * wall / 60:5.1f} min",
                              flush=True)
                        continue
                    row = {"size": size.name, "params": size.params, "tokens": config.run.tokens,
                           "tokens_per_param": tpp, "mode": mode, "variant": variant_name, "lr": lr,
                           "seed": args.seed, "precision": args.precision, "codec": config.protocol.codec,
                           "device_type": device.type, "device": where}
                    if table.find(Table.key(row)):
                        continue
                    workload = workload or Workload.build(config, device, data=data)
                    try:
                        loss, wall, extras = run_one(config, variant, workload)
                    except torch.cuda.OutOfMemoryError:
                        raise ConfigError(f"size {size.name!r} ({size.params / 1e6:.1f}M parameters) ran out of "
                                          f"memory on {device} ({mode}, batch {config.train.batch_size})") from None
                    table.add({**row, "eval_loss": round(loss, 5), "wall_s": round(wall, 1), **extras, **stamped,
                               "load_after": load_now()})
                    print(f"{size.name:>6} {size.params / 1e6:7.3f}M {tpp:g} tok/param {mode:<9} {variant_name:<13} "
                          f"lr {lr:g}: eval loss {loss:.4f} ({wall:.0f} s, {where})", flush=True)
    if args.estimate:
        print(f"projected: {projected / 60:.1f} min on {where} (each run timed on 2% of its tokens)")
        return 0
    summary = gaps(table.rows)
    for g in summary:
        print(f"gap {g['size']:>6} {g['params'] / 1e6:7.3f}M {g['mode']:<9} {g['variant']:<13} "
              f"{g['eval_loss']:.4f} vs dp {g['dp_eval_loss']:.4f}: {g['gap_pct']:+.2f}%")
    tpp = "/".join(sorted({f"{g['tokens_per_param']:g}" for g in summary}, key=float))
    plot(out / "gap.png", summary, f"Gap to data parallel at equal tokens\n({tpp} tokens/param; {where}, "
                                   f"{args.precision}; mean over seeds)")
    print(f"wrote {out / 'table.json'} and {out / 'gap.png'}")
    return 0


def _lrs_for(size: Size, mode: str, variant: str, lrs: tuple[float, ...], plan: Plan, table: Table,
             estimate: bool) -> tuple[float, ...]:
    """The grid where the plan grids this size; else the mode's best lr at the largest gridded size run
    (one lr of the grid when only estimating: the time does not depend on it)."""
    if size.name in plan.grid_sizes or size.name not in {s.name for s in plan.sizes}:
        return lrs
    if estimate:
        return lrs[:1]
    done = [g for g in gaps(table.rows) if g["size"] in plan.grid_sizes and g["variant"] == variant
            and (mode == "dp" or g["mode"] == mode)]
    if not done:
        raise ConfigError(f"size {size.name!r} reuses the best lr of a gridded size ({', '.join(plan.grid_sizes)}) "
                          f"for {mode}: run one of those first")
    largest = max(done, key=lambda g: g["params"])
    return (largest["dp_lr"],) if mode == "dp" else (largest["lr"],)


if __name__ == "__main__":
    sys.exit(main())
