"""Cross-check the goodput and bandwidth models against the virtual cluster (issue 4, point 5).

1. Goodput. ``scale.small_cluster.predict_small_cluster`` predicts the long-run goodput of M learners
   that crash whole (exponential up times, mean ``mtbf_s``), stay down ``downtime_s`` and
   rejoin. The virtual cluster runs the same failure model with real learners on the
   ``tiny`` preset and measures goodput from what was merged (``measures/useful_work.py``). For each
   configuration the table gives the prediction, the mean and spread of the measurement over
   seeds, their difference in points and whether it lies within two standard errors. A
   second table applies the model's rule (a crash loses the step in flight and each
   fragment's progress since its last send) to the failures each seed actually drew, and
   to 1000 other drawn traces: it separates the model's mechanics from the luck of the draw.
2. Bandwidth. ``scale.bandwidth_model.learner_bytes_per_step`` predicts the bytes a learner sends
   (and receives) per inner step; the virtual cluster counts every byte per learner,
   fragment and direction. ``scale.bandwidth_model.check_counted_bytes`` compares the two (control
   traffic on fragment -1 left out) and is the function the gRPC runtime's benchmark can
   call with its own ``ByteLedger.counts``.

    PYTHONPATH=src python benchmarks/bench_crosscheck.py            # about 7 min on 2 cores
    PYTHONPATH=src python benchmarks/bench_crosscheck.py --quick    # about 1 min
    PYTHONPATH=src python benchmarks/bench_crosscheck.py --only bandwidth
    PYTHONPATH=src python benchmarks/bench_crosscheck.py --json docs/results/crosscheck.json   # the docs' tables

The virtual runs train real models, so the cost is in learner steps (about 10 ms each on
the tiny preset): M x time_s per run. Everything runs on one thread, seeded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from stamp import load_now, stamp

from ddiloco.core.shared.codecs import get_codec
from ddiloco.scale.bandwidth_model import BandwidthInputs, ByteCheck, check_counted_bytes
from ddiloco.scale.small_cluster import SmallClusterPrediction, predict_small_cluster
from ddiloco.settings.config import Config
from ddiloco.settings.config_sources import build_config
from ddiloco.sim.faults import FailureTrace
from ddiloco.sim.harness import Recorder
from ddiloco.sim.network import HEADER_BYTES
from ddiloco.sim.virtual_cluster import VirtualCluster
from ddiloco.workload.workload import Workload


@dataclass(frozen=True, slots=True)
class FailureCase:
    """One failure regime, named after the goodput it gives with H = 6."""

    label: str
    mtbf_s: float
    downtime_s: float


CASES = (
    FailureCase("~95%", mtbf_s=120.0, downtime_s=3.0),
    FailureCase("~85%", mtbf_s=40.0, downtime_s=3.0),
    # Downtime 6-18 s straddles the 10 s lease: some outages also expire the learner's lease.
    FailureCase("~70%", mtbf_s=40.0, downtime_s=12.0),
)


def tiny_config(*, learners: int, seed: int, time_s: float, mtbf_s: float = 0.0, downtime_s: float = 60.0) -> Config:
    """The ``tiny`` preset with a time budget, the given failures and a single cheap evaluation."""
    return build_config(
        preset="tiny",
        overrides=("train.evals=1", "train.eval_batches=1", f"run.learners={learners}", f"run.seed={seed}"),
        run__time_s=time_s, faults__mtbf_s=mtbf_s, faults__downtime_s=downtime_s,
    )


@dataclass(slots=True)
class VirtualRun:
    """A finished virtual run with the cluster and recorder kept for inspection."""

    config: Config
    cluster: VirtualCluster
    recorder: Recorder
    result: dict[str, Any]

    @property
    def goodput(self) -> float:
        return self.recorder.accounting.goodput(self.config.run.time_s)

    @property
    def uptime(self) -> float:
        return self.recorder.accounting.uptime(self.config.run.time_s)

    @property
    def trace(self) -> FailureTrace:
        return self.recorder.trace

    def failures(self) -> int:
        return sum(1 for outs in self.trace.outages for o in outs if o.down_s < self.config.run.time_s)


def run_cluster(config: Config, workload: Workload | None = None) -> VirtualRun:
    """What ``experiment.run_virtual`` does, keeping the recorder (trace, accounting, bytes)."""
    if workload is None or workload.config.run.learners != config.run.learners:
        workload = Workload.build(config)
    else:
        workload = replace(workload, config=config)  # same corpus and initial weights, this run's seed
    recorder = Recorder(config, workload)
    cluster = VirtualCluster(workload, recorder)
    return VirtualRun(config, cluster, recorder, cluster.run())


# --- goodput ---------------------------------------------------------------------------------


def mean_step_s(config: Config) -> float:
    """Mean inner-step time: the log-normal jitter has mean exp(sigma^2 / 2)."""
    c = config.cluster
    return c.step_time_s * math.exp(c.jitter**2 / 2.0)


def rejoin_s(config: Config, params: int) -> float:
    """Registration round trip on an idle link: a header up, the fp32 global state down."""
    c = config.cluster
    return 2.0 * c.latency_s + 8.0 * (2 * HEADER_BYTES + 4 * params) / c.bandwidth_bps


def predict(config: Config, params: int) -> SmallClusterPrediction:
    """The model's prediction for the virtual cluster's failure settings."""
    return predict_small_cluster(
        learners=config.run.learners, mtbf_s=config.faults.mtbf_s, downtime_s=config.faults.downtime_s,
        step_s=mean_step_s(config), inner_steps=config.protocol.period, rejoin_s=rejoin_s(config, params),
        quorum=config.protocol.quorum,
    )


def kept_steps(steps: int, inner_steps: int) -> float:
    """Steps a crash leaves merged out of ``steps`` finished since the learner (re)joined,
    averaged over the phase of the fragment schedule: the rule of ``predict_small_cluster``."""
    if steps < inner_steps:
        return steps * (steps + 1) / (2.0 * inner_steps)
    return steps - (inner_steps - 1) / 2.0


def model_on_trace(trace: FailureTrace, *, time_s: float, step_s: float, inner_steps: int, join_s: float) -> float:
    """Goodput the model's crash rule gives on the outages a seed actually drew.

    Each learner trains from ``join_s`` after (re)starting until its next crash, which keeps
    :func:`kept_steps` of its finished steps, or until the end of the run, where the final
    flush sends everything (only the step in flight is lost).
    """
    useful_s = 0.0
    for outages in trace.outages:
        start_s = 0.0
        for outage in outages:
            if outage.down_s >= time_s:
                break
            steps = math.floor(max(0.0, outage.down_s - start_s - join_s) / step_s)
            useful_s += step_s * kept_steps(steps, inner_steps)
            start_s = outage.up_s
        if start_s < time_s:
            useful_s += step_s * math.floor(max(0.0, time_s - start_s - join_s) / step_s)
    return useful_s / (len(trace.outages) * time_s)


@dataclass(frozen=True, slots=True)
class GoodputRow:
    learners: int
    case: FailureCase
    predicted: SmallClusterPrediction
    measured: tuple[float, ...]
    on_trace: tuple[float, ...]
    uptime: tuple[float, ...]
    failures: tuple[int, ...]
    up_checks: tuple[ByteCheck, ...]
    ensemble: float
    """The model's crash rule averaged over many drawn traces: the finite run's expectation."""
    ensemble_failures: float

    @property
    def mean(self) -> float:
        return float(np.mean(self.measured))

    @property
    def std(self) -> float:
        return float(np.std(self.measured, ddof=1)) if len(self.measured) > 1 else 0.0

    @property
    def stderr(self) -> float:
        return self.std / math.sqrt(len(self.measured))

    @property
    def difference(self) -> float:
        """Measured mean minus prediction, in goodput fraction."""
        return self.mean - self.predicted.goodput

    @property
    def trace_difference(self) -> float:
        """Measured minus the model on the same failures, mean over seeds."""
        return float(np.mean(np.subtract(self.measured, self.on_trace)))

    @property
    def trace_difference_std(self) -> float:
        d = np.subtract(self.measured, self.on_trace)
        return float(np.std(d, ddof=1)) if d.size > 1 else 0.0

    def within_spread(self) -> bool:
        return abs(self.difference) <= 2.0 * self.stderr


def ensemble(config: Config, params: int, traces: int) -> tuple[float, float]:
    """(model on trace, failures) averaged over ``traces`` failure traces of this config,
    seeds 10_000 and up: what the finite run should give on average. Cheap: no training."""
    values, failures = [], []
    for seed in range(10_000, 10_000 + traces):
        trace = FailureTrace(learners=config.run.learners, mtbf_s=config.faults.mtbf_s,
                             downtime_s=config.faults.downtime_s, horizon_s=config.run.time_s, seed=seed)
        values.append(model_on_trace(trace, time_s=config.run.time_s, step_s=mean_step_s(config),
                                     inner_steps=config.protocol.period, join_s=rejoin_s(config, params)))
        failures.append(sum(len(outs) for outs in trace.outages))
    return float(np.mean(values)), float(np.mean(failures))


def goodput_row(learners: int, case: FailureCase, seeds: Sequence[int], time_s: float,
                workload: Workload | None = None, traces: int = 1000) -> GoodputRow:
    runs = [run_cluster(tiny_config(learners=learners, seed=s, time_s=time_s, mtbf_s=case.mtbf_s,
                                    downtime_s=case.downtime_s), workload) for s in seeds]
    config = runs[0].config
    params = sum(f.numel for f in runs[0].cluster.plan.fragments)
    on_trace = [model_on_trace(r.trace, time_s=time_s, step_s=mean_step_s(config), inner_steps=config.protocol.period,
                               join_s=rejoin_s(config, params)) for r in runs]
    mean_on_traces, mean_failures = ensemble(config, params, traces)
    return GoodputRow(
        learners=learners, case=case, predicted=predict(config, params),
        measured=tuple(r.goodput for r in runs), on_trace=tuple(on_trace), uptime=tuple(r.uptime for r in runs),
        failures=tuple(r.failures() for r in runs), up_checks=tuple(byte_checks(r)["up"] for r in runs),
        ensemble=mean_on_traces, ensemble_failures=mean_failures,
    )


# --- bandwidth -------------------------------------------------------------------------------


def bandwidth_inputs(run: VirtualRun) -> BandwidthInputs:
    """The model's inputs for this run: its parameter count, codec, period and fragments."""
    p = run.config.protocol
    if p.codec != "int4" or p.downlink_codec != "int4":
        raise ValueError(f"the cross-check assumes int4 both ways, got {p.codec}/{p.downlink_codec}")
    return BandwidthInputs(params=sum(f.numel for f in run.cluster.plan.fragments), bits=4.0,
                           block_size=p.block_size, inner_steps=p.period, fragments=p.fragments)


def rounds_per_period(run: VirtualRun) -> float:
    """Merged versions per fragment per H inner steps of an average learner."""
    steps = np.mean(run.result["steps_per_learner"])
    return float(np.mean(run.result["fragment_versions"])) * run.config.protocol.period / steps if steps else 0.0


def byte_checks(run: VirtualRun) -> dict[str, ByteCheck]:
    steps = {lr.name: run.recorder.accounting.steps(lr.index) for lr in run.cluster.learners}
    return check_counted_bytes(run.recorder.bytes.counts, steps, bandwidth_inputs(run), header_bytes=HEADER_BYTES,
                               rounds_per_period=rounds_per_period(run))


def exact_message_bytes(run: VirtualRun) -> dict[int, int]:
    """Bytes of one message per fragment: the codec's exact size plus the header."""
    codec = get_codec(run.config.protocol.codec, block_size=run.config.protocol.block_size)
    return {f.index: codec.encoded_size(f.numel) + HEADER_BYTES for f in run.cluster.plan.fragments}


def every_message_whole(run: VirtualRun) -> bool:
    """Each fragment counter is a whole number of that fragment's messages."""
    size = exact_message_bytes(run)
    return all(n % size[f] == 0 for (_, f, _), n in run.recorder.bytes.counts.items() if f >= 0)


# --- tables ----------------------------------------------------------------------------------


def goodput_record(r: GoodputRow) -> dict[str, Any]:
    """One row of both goodput tables, as the results file keeps it (fractions, not percent)."""
    return {"learners": r.learners, "regime": r.case.label, "mtbf_s": r.case.mtbf_s, "downtime_s": r.case.downtime_s,
            "predicted": r.predicted.goodput, "predicted_uptime": r.predicted.uptime,
            "measured": list(r.measured), "mean": r.mean, "std": r.std, "difference": r.difference,
            "two_stderr": 2.0 * r.stderr, "within_spread": bool(r.within_spread()), "uptime": list(r.uptime),
            "failures": list(r.failures), "expected_failures": r.ensemble_failures,
            "model_on_drawn": list(r.on_trace), "measured_minus_model_on_drawn": r.trace_difference,
            "measured_minus_model_on_drawn_std": r.trace_difference_std,
            "model_on_1000_traces": r.ensemble, "uplink_agrees": [bool(c.agrees()) for c in r.up_checks]}


def bytes_record(label: str, run: VirtualRun) -> list[dict[str, Any]]:
    """The bandwidth table's rows of one run, a row per direction."""
    whole = every_message_whole(run)
    return [{"run": label, "direction": c.direction, "steps_per_learner": c.steps // c.learners,
             "counted_per_step": c.counted_per_step, "model_per_step": c.predicted_per_step, "ratio": c.ratio,
             "rounds_per_period": c.rounds_per_period, "agrees": bool(c.agrees()), "whole_messages": bool(whole)}
            for c in byte_checks(run).values()]


def pct(x: float) -> str:
    return f"{100.0 * x:5.1f}%"


def print_goodput(rows: Sequence[GoodputRow]) -> None:
    seeds = len(rows[0].measured)
    print(f"Goodput: predict_small_cluster vs virtual cluster (tiny preset, H = 6, P = 3, K = 1, {seeds} seeds)")
    head = (f"{'M':>2} {'regime':>6} {'MTBF s':>6} {'down s':>6} {'predicted':>9} {'measured':>14} "
            f"{'diff':>7} {'2 SE':>6} {'within':>6} {'uptime pred/meas':>16}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.learners:>2} {r.case.label:>6} {r.case.mtbf_s:6.0f} {r.case.downtime_s:6.0f} "
              f"{pct(r.predicted.goodput):>9} {pct(r.mean) + f' ± {100 * r.std:4.1f}':>14} "
              f"{100 * r.difference:+6.1f}p {200 * r.stderr:5.1f}p {'yes' if r.within_spread() else 'NO':>6} "
              f"{pct(r.predicted.uptime) + ' / ' + pct(float(np.mean(r.uptime))):>16}")
    print("measured: mean ± std over seeds; diff: measured - predicted (points); 2 SE: two standard errors "
          "of the mean.\n")
    print("Where the difference comes from: the cluster against the model's crash rule on the same failures,")
    print("and the failures drawn against the failures expected (model on 1000 other traces, no training).")
    head = (f"{'M':>2} {'regime':>6} {'fails drawn/exp':>15} {'model on drawn':>14} {'measured - it':>14} "
            f"{'model on 1000':>13} {'- predicted':>11} {'uplink ok':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ok = sum(c.agrees() for c in r.up_checks)
        print(f"{r.learners:>2} {r.case.label:>6} {f'{np.mean(r.failures):.1f} / {r.ensemble_failures:.1f}':>15} "
              f"{pct(float(np.mean(r.on_trace))):>14} "
              f"{f'{100 * r.trace_difference:+.2f} ± {100 * r.trace_difference_std:.2f}p':>14} "
              f"{pct(r.ensemble):>13} {100 * (r.ensemble - r.predicted.goodput):+10.2f}p "
              f"{f'{ok}/{len(r.up_checks)}':>9}")
    print("measured - it: mean ± std over seeds; uplink ok: runs whose counted uplink bytes agree with the model.")


def print_bytes(runs: Sequence[tuple[str, VirtualRun]]) -> None:
    print("Bandwidth: learner_bytes_per_step vs counted bytes (int4, block 128, 64-byte header, "
          "fragment -1 excluded)")
    head = (f"{'run':<28} {'dir':>4} {'steps':>6} {'counted B/step':>14} {'model B/step':>12} "
            f"{'ratio':>7} {'rounds/H':>8} {'in range':>8} {'whole msgs':>10}")
    print(head)
    print("-" * len(head))
    for label, run in runs:
        checks = byte_checks(run)
        whole = every_message_whole(run)
        for c in checks.values():
            # With failures, a down learner still receives broadcasts until its lease expires
            # and none after, while it takes no steps: per step, the downlink is not comparable.
            comparable = c.direction == "up" or not run.config.faults.mtbf_s
            in_range = ("yes" if c.agrees() else "NO") if comparable else "n/a"
            print(f"{label:<28} {c.direction:>4} {c.steps // c.learners:>6} {c.counted_per_step:14.1f} "
                  f"{c.predicted_per_step:12.1f} {c.ratio:7.4f} {c.rounds_per_period:8.2f} "
                  f"{in_range:>8} {'yes' if whole else 'NO':>10}")
    print("model B/step: learner_bytes_per_step(header_bytes=64) x rounds per period (downlink); "
          "steps: per learner;\nin range: counted in [model, model + one final message per fragment "
          "and learner] (0.1% slack for byte rounding).")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M = 4 only, 2 seeds, 240 s runs (about a minute)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default 4, quick 2)")
    parser.add_argument("--time-s", type=float, default=None, help="virtual seconds per run (default 600, quick 240)")
    parser.add_argument("--only", choices=("goodput", "bandwidth"), default=None, help="run one cross-check")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the tables, stamped, to PATH")
    args = parser.parse_args(argv)
    stamped = stamp(__file__, argv)
    record: dict[str, Any] = {}
    torch.set_num_threads(1)
    seeds = range(args.seeds or (2 if args.quick else 4))
    time_s = args.time_s or (240.0 if args.quick else 600.0)
    learner_counts = (4,) if args.quick else (4, 8)
    started = time.perf_counter()

    if args.only != "bandwidth":
        rows = []
        for m in learner_counts:
            workload = Workload.build(tiny_config(learners=m, seed=0, time_s=time_s))
            for case in CASES:
                rows.append(goodput_row(m, case, seeds, time_s, workload))
                print(f"  ... M={m} {case.label} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        print_goodput(rows)
        print()
        record["goodput"] = [goodput_record(r) for r in rows]
    if args.only == "goodput":
        return finish(args.json, stamped, record, started)

    byte_runs = [("M=4, no failures, 120 s", run_cluster(tiny_config(learners=4, seed=0, time_s=120.0)))]
    if not args.quick:
        byte_runs.append((f"M=8, no failures, {time_s:.0f} s", run_cluster(tiny_config(learners=8, seed=0,
                                                                                       time_s=time_s))))
    case = CASES[1]
    byte_runs.append((f"M=4, {case.label}, {time_s:.0f} s",
                      run_cluster(tiny_config(learners=4, seed=0, time_s=time_s, mtbf_s=case.mtbf_s,
                                              downtime_s=case.downtime_s))))
    print_bytes(byte_runs)
    print()
    record["bandwidth"] = [row for label, run in byte_runs for row in bytes_record(label, run)]
    return finish(args.json, stamped, record, started)


def finish(path: str | None, stamped: dict[str, Any], record: dict[str, Any], started: float) -> int:
    """Print the wall time and, with ``--json``, write the tables beside the stamp taken at the start."""
    wall_s = time.perf_counter() - started
    print(f"wall time {wall_s:.0f} s")
    if path:
        Path(path).write_text(json.dumps({**stamped, **record, "wall_s": round(wall_s, 1), "load_at_end": load_now()},
                                         indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
