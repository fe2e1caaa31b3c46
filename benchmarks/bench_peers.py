"""ddiloco side by side with torchft (its streaming DiLoCo and its fault-tolerant DDP), real processes on this host.

    python benchmarks/bench_peers.py --quick --json docs/results/peers_quick.json   # every scenario, 2 learners
    python benchmarks/bench_peers.py --json docs/results/peers.json                 # longer, 3 seeds fault-free
    python benchmarks/bench_peers.py --only ddiloco                                 # without torchft installed

Both systems train the same workload (ddiloco's reference byte-level transformer, the ``small``
preset: d_model 64, 2 layers, sequence 64, batch 16, 119,104 parameters), from the same initial
weights, on the same per-learner data shards, with the same inner AdamW, H, fragments (the
synchronizer's own fragment plan), τ, α, outer Nesterov step and M, for the same wall seconds
after their learners start. Scenarios, with the same seed and fault schedule for both:

- ``fault_free``;
- ``kills``: kill -9 of learners on one seeded schedule, each restarted after a fixed downtime by
  the same supervisor (``peers_supervisor.py``);
- ``slow_learner``: learner-0 at half speed (SIGSTOP/SIGCONT every 0.1 s, for both);

and torchft's DDP in ``fault_free`` and ``kills``, beside ddiloco's own data parallel on real
processes (``ddiloco run --runtime processes --mode dp``, fault-free). torchft's settings and
why each value are in ``peers_torchft.py``; docs/peers.md has the figures and what they mean.
torchft is the optional extra ``pip install -e '.[peers]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peers_supervisor import Scenario, System, kill_schedule
from stamp import load_now, stamp

if TYPE_CHECKING:  # torch is imported once the arguments are good
    from peers_systems import RunSpec

SCENARIOS_OF: dict[System, tuple[Scenario, ...]] = {
    System.DDILOCO: (Scenario.FAULT_FREE, Scenario.KILLS, Scenario.SLOW_LEARNER),
    System.TORCHFT_DILOCO: (Scenario.FAULT_FREE, Scenario.KILLS, Scenario.SLOW_LEARNER),
    System.TORCHFT_DDP: (Scenario.FAULT_FREE, Scenario.KILLS),
}
PRESET = "small"
DOWNTIME_S = 3.0
"""Each killed learner stays down this long before the supervisor starts it again."""
WARMUP_S = 5.0
"""No kill in the first seconds of the window (time 0 is when every learner has trained a step): a learner
killed before it ever committed anything would test process start-up, not the protocols."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse would print the usage first)
        print(f"bench_peers: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="kill times, data order, initial weights")
    parser.add_argument("--quick", action="store_true", help="every scenario, 2 learners, 60 s runs (~10 min)")
    parser.add_argument("--only", help="comma-separated systems: " + ", ".join(s.value for s in System))
    parser.add_argument("--scenarios", help="comma-separated scenarios (default all): "
                        + ", ".join(s.value for s in Scenario))
    parser.add_argument("--learners", type=int, help="M (default 2 with --quick, else 3)")
    parser.add_argument("--time", type=float, help="wall seconds per run (default 60 with --quick, else 150)")
    parser.add_argument("--kills", type=int, help="kill -9 per kills run, the learners in turn "
                        "(default 2 per learner)")
    parser.add_argument("--seeds", type=int, help="fault-free runs of ddiloco and torchft DiLoCo on this many "
                        "seeds from --seed, for the seed spread (default 1 with --quick, else 3)")
    parser.add_argument("--out", help="keep every run's directory here (default: a temporary directory)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="PATH", help="the plot (default: beside --json, .png)")
    args = parser.parse_args(argv)
    args.learners = args.learners or (2 if args.quick else 3)
    args.time = args.time or (60.0 if args.quick else 150.0)
    args.kills = 2 * args.learners if args.kills is None else args.kills
    args.seeds = args.seeds or (1 if args.quick else 3)
    if args.learners < 2:
        parser.error(f"--learners must be at least 2, got {args.learners}")
    if args.time <= 0 or args.kills < 0 or args.seeds < 1:
        parser.error("--time, --seeds must be positive and --kills not negative")
    try:
        args.systems = [System(s.strip()) for s in (args.only or ",".join(System)).split(",") if s.strip()]
        args.scenario_list = [Scenario(s.strip()) for s in (args.scenarios or ",".join(Scenario)).split(",")
                              if s.strip()]
    except ValueError as err:
        parser.error(f"{err} (systems: {', '.join(System)}; scenarios: {', '.join(Scenario)})")
    try:
        args.schedule = kill_schedule(args.seed, [f"learner-{i}" for i in range(args.learners)], args.kills,
                                      args.time, DOWNTIME_S, WARMUP_S)
    except ValueError as err:
        parser.error(str(err))
    return args


def missing_peer(systems: list[System]) -> str | None:
    """One line naming a peer the chosen systems need and this environment lacks, with how to install it."""
    if all(s is System.DDILOCO for s in systems):
        return None
    try:
        import torchft  # noqa: F401
    except ImportError:
        return ("bench_peers: torchft is not installed: pip install -e '.[peers]' (torchft==0.2.0); "
                "--only ddiloco runs ddiloco's side alone")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    missing = missing_peer(args.systems)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    from peers_report import metrics, plot, ratios, table, targets  # torch: only once the arguments are good
    from peers_systems import RunSpec, run

    started = stamp(__file__, argv)
    began = time.monotonic()
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-peers-"))
    results: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[list[dict[str, Any]]]] = {}
    for scenario in args.scenario_list:
        for system in args.systems:
            if scenario not in SCENARIOS_OF[system]:
                continue
            seeds = range(args.seed, args.seed + (args.seeds if scenario is Scenario.FAULT_FREE
                                                  and system is not System.TORCHFT_DDP else 1))
            for seed in seeds:
                spec = RunSpec(system=system, scenario=scenario, seed=seed, learners=args.learners, time_s=args.time,
                               preset=PRESET, out=work / f"{scenario}-{system}-seed{seed}",
                               kills=tuple(args.schedule) if scenario is Scenario.KILLS else (),
                               downtime_s=DOWNTIME_S, slow="learner-0" if scenario is Scenario.SLOW_LEARNER else None)
                print(f"[{scenario} {system} seed {seed}] {args.time:.0f}s, {args.learners} learners, "
                      f"load {load_now()}", flush=True)
                m = metrics(run(spec))
                m["load_at_end"] = load_now()
                print(f"[{scenario} {system} seed {seed}] " + _line(m), flush=True)
                if seed == args.seed:
                    results.setdefault(scenario.value, {})[system.value] = m
                if scenario is Scenario.FAULT_FREE and not m["failed"]:
                    curves.setdefault(system.value, []).append(m["curve"])
        if scenario is Scenario.FAULT_FREE and System.DDILOCO in args.systems:
            dp = ddiloco_dp(RunSpec(system=System.DDILOCO, scenario=scenario, seed=args.seed, learners=args.learners,
                                    time_s=args.time, preset=PRESET, out=work / f"{scenario}-ddiloco_dp"))
            dp = {"failed": True, "log_tail": dp["failed"]} if "failed" in dp else {"failed": False, **dp}
            print(f"[{scenario} ddiloco_dp] {dp}", flush=True)
            results.setdefault(scenario.value, {})["ddiloco_dp"] = dp
    spread = _spread(curves)
    rows = ratios(results)
    report = table(results, rows)
    goals = targets(results, spread)
    print(report)
    for name, goal in goals.items():
        print(f"target {name}: {'met' if goal['met'] else 'MISSED' if goal['met'] is False else 'not measured'} "
              f"({goal['figures']})")
    plot_path = Path(args.plot) if args.plot else (Path(args.json).with_suffix(".png") if args.json else
                                                   work / "peers.png")
    plot(results, plot_path)
    print(f"plot: {plot_path}; runs kept in {work}; {time.monotonic() - began:.0f}s, load {load_now()}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            **started, "load_at_end": load_now(), "duration_s": round(time.monotonic() - began, 1),
            "settings": _settings(args), "results": results, "ratios": rows, "targets": goals,
            "seed_spread": spread, "table": report}, indent=1) + "\n")
    failed = [f"{s}/{n}" for s, systems in results.items() for n, r in systems.items() if r.get("failed")]
    if failed:
        print(f"failed: {', '.join(failed)} (their log tails are in the JSON)", file=sys.stderr)
    return 1 if failed else 0


def ddiloco_dp(spec: RunSpec) -> dict[str, Any]:
    """ddiloco's own data-parallel baseline on real processes (``ddiloco run --runtime processes --mode dp``),
    fault-free, on the same configuration and wall budget: the reference beside torchft's DDP."""
    cmd = [sys.executable, "-m", "ddiloco.cli", "run", "--runtime", "processes", "--mode", "dp", "--preset",
           spec.preset, "--learners", str(spec.learners), "--seed", str(spec.seed), "--time", f"{spec.time_s:.0f}",
           "--out", str(spec.out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.time_s + 300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as err:
        return {"failed": f"ddiloco run --mode dp did not finish within {spec.time_s + 300:.0f}s: {err}"}
    summary = spec.out / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        return {"failed": f"ddiloco run --mode dp exited {proc.returncode}:\n" + "\n".join(
            (proc.stdout + proc.stderr).splitlines()[-15:])}
    s = json.loads(summary.read_text())
    return {"eval_loss": s["eval_loss"], "tokens": s["tokens"], "wall_s": s["virtual_time_s"],
            "tokens_per_s": s["tokens"] / max(1e-9, s["virtual_time_s"]), "command": " ".join(cmd[2:])}


def _spread(curves: dict[str, list[list[dict[str, Any]]]]) -> dict[str, list[float]]:
    """Per system, the eval loss of each fault-free seed at the tokens every run of both systems reached."""
    from peers_report import loss_at_tokens

    ends = [c[-1]["tokens"] for runs in curves.values() for c in runs if c]
    if not ends:
        return {}
    tokens = min(ends)
    return {system: [round(x, 4) for c in runs if (x := loss_at_tokens(c, tokens)) is not None]
            for system, runs in curves.items()} | {"tokens": [tokens]}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    import peers_torchft as tf
    from peers_systems import RunSpec

    config = RunSpec(system=System.DDILOCO, scenario=Scenario.FAULT_FREE, seed=args.seed, learners=args.learners,
                time_s=args.time, preset=PRESET, out=Path(".")).config()
    return {"preset": PRESET, "model": {"d_model": config.model.d_model, "n_layers": config.model.n_layers,
                                        "seq_len": config.model.seq_len, "batch_size": config.train.batch_size},
            "learners": args.learners, "time_s": args.time, "seeds": args.seeds, "downtime_s": DOWNTIME_S,
            "kill_schedule": [[k.at_s, k.learner] for k in args.schedule],
            "protocol": {"H": config.protocol.period, "fragments": config.protocol.fragments,
                         "tau": config.protocol.overlap, "alpha": config.protocol.alpha,
                         "outer_lr": config.protocol.outer_lr, "outer_momentum": config.protocol.outer_momentum},
            "torchft": {"version": _version("torchft"), "min_replicas": tf.MIN_REPLICAS,
                        "join_timeout_ms": tf.JOIN_TIMEOUT_MS, "quorum_tick_ms": tf.QUORUM_TICK_MS,
                        "timeout_s": tf.TIMEOUT_S, "quorum_timeout_s": tf.QUORUM_TIMEOUT_S,
                        "should_quantize": False, "healing": "from a live peer (HTTP checkpoint transport)"},
            "cores": os.cpu_count()}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _line(m: dict[str, Any]) -> str:
    if m["failed"]:
        return "FAILED:\n" + m["log_tail"]
    return (f"goodput {m['goodput']}, {m['tokens_per_s']} tok/s (others {m['others_tokens_per_s']}), eval loss "
            f"{m['eval_loss']}, longest stall {m['longest_stall_s']}s, {m['bytes_per_outer_step']} B/outer step, "
            f"VmHWM {m['vmhwm_mib_max']} MiB, {len(m['kills'])} kills, wall {m['wall_s']}s")


if __name__ == "__main__":
    sys.exit(main())
