"""A learner on a 2 Mbit/s link against the same learner uncapped: its own training steps per second.

Issue 27's target: steps per second of a learner whose link is capped at 2 Mbit/s (``--hosts
netns``) >= 0.98 of uncapped, because a learner never waits for its link. Each sample is a
pair of real runs, ``ddiloco run --runtime processes --hosts netns`` as a fresh child process
(its own launcher, synchronizer and learner processes, from this checkout's ``src``), with
the same seed and configuration:

- **capped**: every learner's veth link capped at ``--rate`` each way (``tc`` ``tbf``);
- **uncapped**: the same namespaces, bridge and veth links with no ``tc`` cap (not loopback:
  the packets take the same path, only the queue that paces them is missing).

The order is swapped every pair (capped first in pairs 0, 2, ...), so a drift of the shared
machine's load hits both alike. The model is the one of ``bench_runtime --only throughput``
(``--model medium``: ~0.83M parameters, ~100 ms CPU steps, one learner: M = 1).

A learner's rate is its own count: every learner writes ``{"steps", "time"}`` to its
progress file (``ddiloco learner --progress-file``) about twice a second, at a step's end,
with its own clock; this script reads those files every 0.1 s while the run goes on. The rate
is (steps at the last write of the training loop - steps at the first write at least
``--warmup`` seconds after the learner's first step) / (the time between those two writes):
start-up, the join (the whole state's download: ~13 s on a 2 Mbit/s link), the final flush
and the evaluations of the global model are outside it. Reported per run and learner: that
rate, its window, the contributions sent and updates applied in it, the link's bytes per
second each way in it (``timeline.jsonl``) and its bytes over the whole run (the bridge's
end of its veth pair: TCP/IP headers included, the join's download too); per pair and
learner the ratio capped / uncapped; over all pairs its median and range, and the load
averages beside each run. Beside the rate, what says whether a slower capped learner waited:
the training thread's milliseconds per step inside ``runtime.step`` (the learner's own
``step_overhead_s``, in its progress file), and from ``/proc`` the cores its training thread
got in the window, its CPU milliseconds per step, its other threads' cores (the link's) and
the whole machine's busy cores (everyone's: the machine is shared).

Both runs have the same time budget (``--time``, counted by the synchronizer from the first
join): by default long enough for the capped learner's join, ``--warmup`` and ``--window``
seconds of training; the uncapped learner, joined in a second, trains ~13 s longer, and its
whole window is used.

    python benchmarks/bench_capped_link.py --pairs 5 --json capped_link.json   # ~1.5 min a pair on 2 cores
    python benchmarks/bench_capped_link.py --pairs 1 --out runs/capped          # keep the runs' logs

Needs root (network namespaces, veth pairs, tc); says so in one line otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench_runtime import MODELS
from stamp import stamp

from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.launch.netns import NS_PREFIX, check_available, tag_of
from ddiloco.runtime.launch.topology import format_rate, parse_rate
from ddiloco.runtime.layout import reference_layout
from ddiloco.settings.config_sources import build_config

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.98
POLL_S = 0.1
START_MARGIN_S = 3.0
"""Added to the default time budget: the learner's first steps after its join, a loaded machine."""


# ---- the learner's own rate ------------------------------------------------------------------


@dataclass(frozen=True)
class Rate:
    """One learner's training rate over its window (times in seconds after its first step)."""

    steps_per_s: float
    steps: int
    window: tuple[float, float]
    contributions_sent: int
    updates_applied: int
    wall: tuple[float, float]
    """The window in wall-clock seconds (``time.time()``), to cut the run's timeline."""
    step_ms: float | None = None
    """Milliseconds per step the training thread spent inside ``runtime.step`` in the window (where it
    would wait for the link); None from a learner whose progress file does not say."""


def training_rate(samples: list[dict[str, Any]], warmup_s: float, min_window_s: float = 2.0) -> Rate:
    """The rate of a learner's training loop from its progress file's successive contents.

    Writes of the training loop carry ``contributions_sent``; the write after the loop (steps
    after the runtime's flush) does not, and is not used. Raises ValueError, saying why, when
    the samples leave no window of at least ``min_window_s`` seconds after ``warmup_s``.
    """
    first = next((s["first_step_time"] for s in samples if s.get("first_step_time")), None)
    if first is None:
        raise ValueError("it never took a step")
    in_loop = sorted((s for s in samples if "contributions_sent" in s), key=lambda s: s["time"])
    start = next((s for s in in_loop if s["time"] >= first + warmup_s), None)
    end = in_loop[-1] if in_loop else None
    if start is None or end is None or end["time"] - start["time"] < min_window_s:
        trained = (in_loop[-1]["time"] - first) if in_loop else 0.0
        raise ValueError(f"it trained {trained:.1f}s, not {warmup_s:g}s of warm-up and {min_window_s:g}s of window "
                         "(a longer --time)")
    dt, steps = end["time"] - start["time"], end["steps"] - start["steps"]
    inside = (1e3 * (end["step_overhead_s"] - start["step_overhead_s"]) / steps
              if steps and "step_overhead_s" in start and "step_overhead_s" in end else None)
    return Rate(steps_per_s=(end["steps"] - start["steps"]) / dt, steps=end["steps"] - start["steps"],
                window=(start["time"] - first, end["time"] - first),
                contributions_sent=end["contributions_sent"] - start["contributions_sent"],
                updates_applied=end.get("updates_applied", 0) - start.get("updates_applied", 0),
                wall=(start["time"], end["time"]), step_ms=inside)


def link_rates(timeline: list[dict[str, Any]], learner: str, wall: tuple[float, float]) -> dict[str, float]:
    """Bytes per second up and down on ``learner``'s link between the timeline's rows inside ``wall``."""
    rows = [r for r in timeline if wall[0] <= r["time"] <= wall[1] and learner in r.get("links", {})]
    if len(rows) < 2 or rows[-1]["time"] <= rows[0]["time"]:
        return {"up": float("nan"), "down": float("nan")}
    a, b = rows[0], rows[-1]
    return {d: (b["links"][learner][d] - a["links"][learner][d]) / (b["time"] - a["time"]) for d in ("up", "down")}


def ratios(pairs: list[dict[str, dict[str, float]]]) -> list[float]:
    """Capped / uncapped steps per second, for every pair and every learner present in both runs."""
    return [p["capped"][name] / p["uncapped"][name] for p in pairs for name in p["capped"]
            if name in p["uncapped"] and p["uncapped"][name] > 0]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ---- where the CPU went ----------------------------------------------------------------------

HZ = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat: Path) -> float:
    """User + system seconds of a process or thread (``/proc/PID/stat`` or ``/proc/PID/task/TID/stat``)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def _machine_busy_s() -> float:
    """Seconds of all cores not idle since boot (``/proc/stat``: everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / HZ


def find_learner(progress_file: Path) -> int | None:
    """The pid of the Python process that writes ``progress_file`` (a ``ddiloco learner``)."""
    needle = b"--progress-file\0" + str(progress_file).encode() + b"\0"
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmdline and b"python" in cmdline.split(b"\0", 1)[0]:
                return int(proc.name)
    return None


def cpu_sample(pid: int) -> tuple[float, float, float, float] | None:
    """(wall time, the process's main thread's CPU s, the whole process's, the machine's busy s)."""
    try:
        return (time.time(), _cpu_s(Path(f"/proc/{pid}/task/{pid}/stat")), _cpu_s(Path(f"/proc/{pid}/stat")),
                _machine_busy_s())
    except OSError:
        return None


def cpu_in_window(samples: list[tuple[float, float, float, float]], wall: tuple[float, float]) -> dict[str, float]:
    """Cores used in ``wall`` by a learner's training thread (the main thread: torch runs one intra-op
    thread), by its other threads (the link's: gRPC, codecs) and by the whole machine (everyone's)."""
    inside = [s for s in samples if wall[0] <= s[0] <= wall[1]]
    if len(inside) < 2:
        return {}
    a, b = inside[0], inside[-1]
    dt = b[0] - a[0]
    return {"training_thread": (b[1] - a[1]) / dt, "other_threads": (b[2] - b[1] - a[2] + a[1]) / dt,
            "machine": (b[3] - a[3]) / dt}


# ---- one real run ----------------------------------------------------------------------------


@dataclass
class Run:
    kind: str
    """``capped`` or ``uncapped``."""
    rates: dict[str, Rate] = field(default_factory=dict)
    links_window: dict[str, dict[str, float]] = field(default_factory=dict)
    links_run: dict[str, dict[str, int]] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per learner, cores used in its window (:func:`cpu_in_window`)."""
    wall_s: float = 0.0
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)


def run_command(args: argparse.Namespace, capped: bool, out: Path) -> list[str]:
    sets = [x for o in (*MODELS[args.model], "train.evals=1", *args.set) for x in ("--set", o)]
    return [sys.executable, "-m", "ddiloco.cli", "run", "--runtime", "processes", "--hosts", "netns",
            *(["--link-rate", args.rate] if capped else []), "--preset", "tiny", *sets,
            "--learners", str(args.learners), "--seed", str(args.seed), "--time", f"{args.time:g}",
            "--device", "cpu", "--out", str(out)]


def measure(args: argparse.Namespace, capped: bool, out: Path) -> Run:
    """One ``ddiloco run`` in a child process, its learners' progress files read while it runs."""
    learners = [f"learner-{i}" for i in range(args.learners)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT / "src"), os.environ.get("PYTHONPATH"))))}
    run = Run("capped" if capped else "uncapped", load_before=os.getloadavg())
    log = out.with_suffix(".log")
    samples: dict[str, dict[float, dict[str, Any]]] = {name: {} for name in learners}
    pids: dict[str, int | None] = {name: None for name in learners}
    cpu: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in learners}
    started, launched_at = time.monotonic(), time.time()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(run_command(args, capped, out), stdout=sink, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT)
        try:
            while True:
                done = proc.poll() is not None
                for name in learners:
                    progress = out / "progress" / f"{name}.json"
                    try:
                        s = json.loads(progress.read_text())
                        if s["time"] < launched_at:
                            continue  # an earlier run's, in a reused --out, before the launcher removes it
                        samples[name][s["time"]] = s
                    except (OSError, ValueError, KeyError):
                        continue  # not written yet
                    pid = pids[name] = pids[name] or find_learner(progress)
                    sample = cpu_sample(pid) if pid else None
                    if sample:
                        cpu[name].append(sample)
                if done:
                    break
                if time.monotonic() - started > args.time + 300:
                    raise RuntimeError(f"the {run.kind} run did not finish in {args.time + 300:.0f}s (log: {log})")
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    run.wall_s = time.monotonic() - started
    run.load_after = os.getloadavg()
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"the {run.kind} run exited with code {proc.returncode} (log: {log}):\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines() if line.strip()]
    for name in learners:
        try:
            rate = training_rate(list(samples[name].values()), args.warmup)
        except ValueError as err:
            raise RuntimeError(f"{run.kind} run, {name}: {err} (logs: {out / 'logs'})") from None
        run.rates[name] = rate
        run.links_window[name] = link_rates(timeline, name, rate.wall)
        run.links_run[name] = summary.get("links", {}).get(name, {})
        run.cpu[name] = cpu_in_window(cpu[name], rate.wall)
    return run


# ---- the report ------------------------------------------------------------------------------


def print_run(pair: int, run: Run) -> None:
    for name, r in run.rates.items():
        w, total, cpu = run.links_window[name], run.links_run[name], run.cpu[name]
        inside = "   -  " if r.step_ms is None else f"{r.step_ms:6.2f}"
        cores = " ".join(f"{cpu[k]:4.2f}" if k in cpu else "  - " for k in ("training_thread", "other_threads", "machine"))
        cpu_ms = f"{1e3 * cpu['training_thread'] / r.steps_per_s:5.1f}" if cpu and r.steps_per_s else "   - "
        print(f"{pair:4d}  {run.kind:<8}  {name:<10} {r.steps_per_s:7.3f}  {inside}  {cores}  {cpu_ms}  "
              f"{r.window[0]:4.1f}-{r.window[1]:4.1f}s {r.steps:5d}  {r.contributions_sent:4d}/{r.updates_applied:<4d} "
              f"{w['up'] / 1e3:7.1f} {w['down'] / 1e3:7.1f}   "
              f"{total.get('up', 0) / 1e6:6.2f}/{total.get('down', 0) / 1e6:<6.2f} "
              f"{run.wall_s:5.0f}s  {run.load_before[0]:.2f}->{run.load_after[0]:.2f}", flush=True)


HEADER = ("pair  run       learner    steps/s  in-step  train othr mach  cpu/st  window      steps  sent/appl  "
          "up kB/s  dn kB/s  MB up/down    wall  load(1m)")
"""in-step: ms per step inside ``runtime.step``; train/othr/mach: cores used in the window by the learner's
training thread, by its other threads, by the whole machine (2.00: every core busy, this run's processes and
everyone else's); cpu/st: the training thread's CPU ms per step; window: seconds after the learner's first
step; sent/appl: contributions sent and updates applied in the window; kB/s: the link's bytes in the
window; MB: the link's bytes over the whole run (the join's download included); load: 1-minute load
average before and after the run."""


def where_the_time_went(runs: list[dict[str, Run]]) -> dict[str, tuple[float | None, float | None]]:
    """Medians over learners and pairs, capped and uncapped: the training thread's ms per step inside
    ``runtime.step`` (where it would wait for its link), its CPU ms per step and the cores it got."""
    def median(kind: str, of: Any) -> float | None:
        values = [v for pair in runs for name, r in pair[kind].rates.items()
                  if (v := of(r, pair[kind].cpu[name])) is not None]
        return round(statistics.median(values), 3) if values else None

    figures = {
        "ms/step inside runtime.step": lambda r, cpu: r.step_ms,
        "training thread CPU ms/step": lambda r, cpu: 1e3 * cpu["training_thread"] / r.steps_per_s if cpu else None,
        "cores it got": lambda r, cpu: cpu.get("training_thread"),
        "cores busy on the machine": lambda r, cpu: cpu.get("machine"),
    }
    return {what: (median("capped", of), median("uncapped", of)) for what, of in figures.items()}


def check_hosts(rate: str) -> None:
    """ConfigError (one line) when this process cannot make capped namespaces: not root, no
    ``ip``/``tc``, no ``ip netns add``, or no ``tbf`` queue discipline."""
    check_available()
    ns = f"{NS_PREFIX}{tag_of(os.getpid())}-probe"  # removed by the next run's remove_stale if we die here
    subprocess.run(["ip", "netns", "add", ns], capture_output=True, check=True)
    try:
        made = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "3000",
                               "latency", "100ms"], capture_output=True, text=True)
        if made.returncode != 0:
            raise ConfigError(f"tc cannot cap a link here (tbf at {rate}): {(made.stderr or made.stdout).strip()}")
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def default_time(args: argparse.Namespace) -> float:
    """A budget that leaves the capped learner ``--warmup`` + ``--window`` seconds after its join's download."""
    config = build_config(preset="tiny", overrides=MODELS[args.model])
    state_bits = 32 * sum(f.numel for f in reference_layout(config, config.protocol).plan.fragments)
    return round(state_bits / parse_rate(args.rate, "--rate") + args.warmup + args.window + START_MARGIN_S)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="capped/uncapped pairs (default 5)")
    parser.add_argument("--rate", default="2mbit", help="the capped link, each way (default 2mbit)")
    parser.add_argument("--model", choices=("small", "medium", "large"), default="medium",
                        help="bench_runtime's throughput models (default medium, its default on the CPU)")
    parser.add_argument("--learners", type=int, default=1, help="learners per run, each on its own link (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds after a learner's first step not counted")
    parser.add_argument("--window", type=float, default=10.0,
                        help="seconds of the capped learner's training counted (sets the default --time)")
    parser.add_argument("--time", type=float, help="the runs' time budget (default: the capped join + warmup + window)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="another override of both runs' configuration")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory, removed)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stamped = stamp(__file__, argv)  # the commit and load when the measurement starts
    try:
        if args.pairs < 1 or args.learners < 1 or args.warmup < 0 or args.window <= 0:
            raise ConfigError("--pairs and --learners must be at least 1, --warmup >= 0 and --window > 0")
        rate_bps = parse_rate(args.rate, "--rate")
        check_hosts(args.rate)
        args.time = args.time or default_time(args)
    except (ConfigError, subprocess.CalledProcessError) as err:
        print(f"bench_capped_link: {err}", file=sys.stderr)
        return 2
    where = args.out.resolve() if args.out else Path(tempfile.mkdtemp(prefix="bench_capped_link-"))
    where.mkdir(parents=True, exist_ok=True)
    print(f"capped ({format_rate(rate_bps)} each way) vs uncapped (same netns links, no tc cap): model {args.model}, "
          f"M={args.learners}, seed {args.seed}, --time {args.time:g}s, warm-up {args.warmup:g}s; "
          f"{args.pairs} pairs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(HEADER)
    runs: list[dict[str, Run]] = []
    try:
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            done: dict[str, Run] = {}
            for capped in order:
                run = measure(args, capped, where / f"pair{pair}-{'capped' if capped else 'uncapped'}")
                print_run(pair, run)
                done[run.kind] = run
            runs.append(done)
    except RuntimeError as err:
        print(f"bench_capped_link: {err}", file=sys.stderr)
        return 1
    finally:
        if args.out is None:
            shutil.rmtree(where, ignore_errors=True)
    rates = [{kind: {n: r.steps_per_s for n, r in run.rates.items()} for kind, run in pair.items()} for pair in runs]
    found = ratios(rates)
    s = spread(found)
    over = f"{args.pairs} pair{'s' if args.pairs != 1 else ''}" + (f" x {args.learners} learners" if args.learners > 1 else "")
    print(f"capped / uncapped steps per second: median {s['median']:.3f}, range {s['min']:.3f}-{s['max']:.3f} over "
          f"{over} (target >= {TARGET}: {'met' if s['median'] >= TARGET else 'not met'}); "
          f"load now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    waits = where_the_time_went(runs)
    print("medians, capped vs uncapped: " + "; ".join(f"{what} {'-' if c is None else f'{c:.2f}'} vs "
                                                     f"{'-' if u is None else f'{u:.2f}'}" for what, (c, u) in waits.items()))
    if args.json:
        result = {**stamped,
                  "rate": args.rate, "rate_bps": rate_bps, "uncapped": "the same netns links without a tc cap",
                  "model": args.model, "overrides": list(MODELS[args.model]) + ["train.evals=1", *args.set],
                  "learners": args.learners, "seed": args.seed, "time_s": args.time, "warmup_s": args.warmup,
                  "ratio": s, "ratios": found, "target": TARGET, "medians_capped_vs_uncapped": waits,
                  "pairs": [{kind: {**asdict(run), "rates": {n: asdict(r) for n, r in run.rates.items()}}
                             for kind, run in pair.items()} for pair in runs],
                  "load_after": os.getloadavg()}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
