"""Soak tests of the real runtime, as benchmarks: many faults in one run of ``ddiloco chaos``.

    python benchmarks/bench_chaos.py                         # all three (about 35 min on 2 CPU cores)
    python benchmarks/bench_chaos.py --quick --baseline ""   # 20 kills, 3 synchronizer kills, 10 mixed
    python benchmarks/bench_chaos.py --only sync_kills --json out.json

1. kills: N learner kills (kill -9, restart 1 s later with the same id) in one run, on the
   learners in turn, so at most one is down at a time. Every learner must rejoin, the
   global model must never stand still longer than one grace window plus one lease, and no
   batch may be skipped; the batches trained again across the restarts are counted, and
   those beyond one period H per restart (issue 26's allowance), from the learners' batch logs.
2. sync_kills: N kill -9 of the synchronizer in one run, each restarted with --resume on the
   same state directory and port. Every restart must resume from its checkpoint, the
   learners must reconnect by themselves, and a crash may lose only what docs/runtime.md
   says it loses: the rounds merged since the last checkpoint.
3. mixed: freezes (SIGSTOP longer than the lease) and blackhole partitions on rotating
   learners, two at a time now and then.

Each scenario writes its schedule as a TOML file and runs the real command (``ddiloco chaos
--schedule``), then reads its chaos.json; the eval loss is compared with the same run
without faults (the command's baseline) for the scenarios named by --baseline. Leases are 3 s (heartbeats
every 0.5 s) so that a freeze outlasts its lease in a few seconds, and learners are paced to
5 steps/s (--min-step-s 0.2) so that restarts get a share of a 2-core machine.
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
from typing import Any, Callable

from stamp import stamp

LEASE_S = 3.0
MIN_STEP_S = 0.2
"""Learners paced to 5 steps/s (~0.15 core each): restarts (python, torch, the corpus: ~20 s on this shared
2-core machine) get the rest."""
COMMON = ["--preset", "tiny", "--set", f"protocol.lease_s={LEASE_S}", "--set", "protocol.heartbeat_s=0.5",
          "--min-step-s", str(MIN_STEP_S)]
FIRST_S = 5.0


def entry(time_s: float, fault: str, target: str, duration_s: float) -> str:
    return f'[[fault]]\ntime = {time_s:.2f}\nfault = "{fault}"\ntarget = "{target}"\nduration = {duration_s:.2f}\n'


def kills_schedule(n: int, learners: int) -> tuple[str, float]:
    """n kills 9 s apart on the learners in turn, 1 s down each: each learner is killed every 9·M s.

    A restarted learner takes 20-40 s to train again on this shared 2-core machine (python, torch, the
    corpus, under a load of 7-8); with kills 6 s apart (every 30 s per learner) the restarts outran the
    rotation once the load rose and all five were down or starting at once for 30 s, a pause the
    schedule made, not the protocol.
    """
    gap_s = 9.0
    text = "\n".join(entry(FIRST_S + k * gap_s, "learner_crash", f"learner-{k % learners}", 1.0) for k in range(n))
    return text, FIRST_S + n * gap_s


def sync_kills_schedule(n: int, target: str = "sync") -> tuple[str, float]:
    """n synchronizer kills 15 s apart on the schedule's clock (which stops while it is down), 1 s down each;
    ``target``: the synchronizer, or one shard of a sharded one (``sync-1``)."""
    gap_s = 15.0
    text = "\n".join(entry(FIRST_S + k * gap_s, "sync_crash", target, 1.0) for k in range(n))
    return text, FIRST_S + n * gap_s


def mixed_schedule(n: int, learners: int) -> tuple[str, float]:
    """n faults 4 s apart, freezes (5 s, past the 3 s lease) and partitions (2-6 s) alternating on rotating
    learners; a freeze and the next partition overlap, so two learners are out at once now and then."""
    gap_s = 4.0
    lines = []
    for k in range(n):
        target = f"learner-{(k + k // learners) % learners}"  # the rotation shifts each lap: both kinds hit all
        if k % 2 == 0:
            lines.append(entry(FIRST_S + k * gap_s, "freeze", target, 5.0))
        else:
            lines.append(entry(FIRST_S + k * gap_s, "partition", target, 2.0 + 4.0 * ((k // 2) % 2)))
    return "\n".join(lines), FIRST_S + n * gap_s + 6.0


def run_chaos(name: str, schedule: str, window_s: float, learners: int, work: Path, baseline: bool,
              seed: int, extra: tuple[str, ...]) -> tuple[dict[str, Any], float, int]:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    path = out / "schedule.toml"
    path.write_text(schedule)
    cmd = [sys.executable, "-m", "ddiloco.cli", "chaos", *COMMON, "--learners", str(learners), "--time",
           f"{window_s:.0f}", "--seed", str(seed), "--schedule", str(path), "--out", str(out), *extra]
    if not baseline:
        cmd.append("--no-baseline")
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    started = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.monotonic() - started
    (out / "chaos.out").write_text(proc.stdout)
    report_file = out / "chaos.json"
    if not report_file.exists():
        raise SystemExit(f"[{name}] ddiloco chaos exited {proc.returncode} without chaos.json:\n{proc.stdout[-3000:]}")
    return json.loads(report_file.read_text()), wall, proc.returncode


def common_figures(report: dict[str, Any]) -> dict[str, Any]:
    loss, base = report["eval_loss"], report["baseline_eval_loss"]
    return {
        "exit_ok": not report["violations"], "violations": report["violations"],
        "longest_pause_s": report["longest_pause_s"], "pause_bound_s": report["pause_bound_s"],
        "learners_alive_at_end": report["learners_alive_at_end"], "learners": report["learners"],
        "rejoins": report["rejoins"], "rejected": report["rejected"], "goodput": report["goodput"],
        "refused_steps": report["refused_steps"], "honest_refused_steps": report["honest_refused_steps"],
        "uptime": report["uptime"], "tokens": report["tokens"], "baseline_tokens": report["baseline_tokens"],
        "eval_loss": loss, "baseline_eval_loss": base,
        "eval_loss_vs_baseline": round(loss / base, 4) if loss and base else None,
    }


def kills(n: int, work: Path, baseline: bool, seed: int, extra: tuple[str, ...]) -> dict[str, Any]:
    learners = 5
    schedule, window = kills_schedule(n, learners)
    report, wall, code = run_chaos("kills", schedule, window, learners, work, baseline, seed, extra)
    skipped = sum(1 for e in report["schedule"] if "skipped" in e)
    figures = {"kills": report["faults"]["learner_crash"], "skipped": skipped, "wall_s": round(wall, 1), "exit_code": code,
               **common_figures(report)}
    figures["rejoins_per_kill"] = round(report["rejoins"] / max(1, figures["kills"]), 3)
    figures.update({key: report[key] for key in ("batch_period", "batches_trained", "batches_retrained",
                                                 "batches_retrained_beyond_period", "batches_skipped")})
    restarts = sum(len(c["processes"]) - 1 for c in report["batches_by_learner"].values())
    figures["batches_retrained_per_restart"] = round(report["batches_retrained"] / max(1, restarts), 2)
    print(f"[kills] {figures['kills']} kills ({skipped} skipped), {report['rejoins']} rejoins "
          f"-> {figures['rejoins_per_kill']} per kill; batches trained again {report['batches_retrained']} over "
          f"{restarts} restarts ({figures['batches_retrained_per_restart']} per restart, "
          f"{report['batches_retrained_beyond_period']} beyond one period H={report['batch_period']}), "
          f"skipped {report['batches_skipped']}; alive at the end {report['learners_alive_at_end']}/{learners}; "
          f"longest pause {report['longest_pause_s']:.2f}s vs bound {report['pause_bound_s']:.2f}s; "
          f"{_loss_line(figures)}; wall {wall:.0f}s, exit {code}", flush=True)
    return figures


def sync_kills(n: int, work: Path, baseline: bool, seed: int, extra: tuple[str, ...]) -> dict[str, Any]:
    learners = 3
    sharded = any(a.startswith("protocol.shards=") and a.split("=", 1)[1].strip() not in ("0", "1") for a in extra)
    schedule, window = sync_kills_schedule(n, "sync-1" if sharded else "sync")
    report, wall, code = run_chaos("sync_kills", schedule, window, learners, work, baseline, seed, extra)
    restarts = report["sync_restarts"]
    resumed = [r for r in restarts if r["answering_at_s"] is not None and r["versions_resumed"]]
    lost = [r["rounds_lost"] for r in restarts]
    downs = [r["answering_at_s"] - r["killed_at_s"] for r in resumed]
    firsts = [r["first_merge_after_s"] for r in restarts if r["first_merge_after_s"] is not None]
    figures = {
        "sync_kills": report["faults"]["sync_crash"], "resumed": len(resumed),
        "restarts_with_a_merge_after": len(firsts),
        "rounds_lost_per_crash_max": max(lost, default=0), "rounds_lost_per_crash_mean": _mean(lost),
        "checkpoint_every_rounds": 20,
        "tokens_rolled_back_max": max((r["tokens_at_kill"] - r["tokens_resumed"] for r in resumed), default=0),
        "downtime_s_mean": _mean(downs), "downtime_s_max": round(max(downs, default=0.0), 2),
        "first_merge_after_restart_s_max": round(max(firsts, default=0.0), 2),
        "wall_s": round(wall, 1), "exit_code": code, **common_figures(report),
    }
    print(f"[sync_kills] {figures['sync_kills']} kills, {len(resumed)} resumed, {len(firsts)} merging again; "
          f"rounds lost per crash max {figures['rounds_lost_per_crash_max']} mean "
          f"{figures['rounds_lost_per_crash_mean']} (checkpoint every 20 rounds or 30 s); downtime mean "
          f"{figures['downtime_s_mean']}s max {figures['downtime_s_max']}s; first merge after a restart <= "
          f"{figures['first_merge_after_restart_s_max']}s; {report['rejoins']} rejoins; "
          f"longest pause {report['longest_pause_s']:.2f}s vs bound {report['pause_bound_s']:.2f}s; "
          f"{_loss_line(figures)}; wall {wall:.0f}s, exit {code}", flush=True)
    return figures


def mixed(n: int, work: Path, baseline: bool, seed: int, extra: tuple[str, ...]) -> dict[str, Any]:
    learners = 4
    schedule, window = mixed_schedule(n, learners)
    report, wall, code = run_chaos("mixed", schedule, window, learners, work, baseline, seed, extra)
    figures = {"freezes": report["faults"]["freeze"], "partitions": report["faults"]["partition"],
               "wall_s": round(wall, 1), "exit_code": code, **common_figures(report)}
    print(f"[mixed] {figures['freezes']} freezes + {figures['partitions']} partitions, {report['rejoins']} rejoins, "
          f"rejected {report['rejected']}; alive at the end {report['learners_alive_at_end']}/{learners}; longest "
          f"pause {report['longest_pause_s']:.2f}s vs bound {report['pause_bound_s']:.2f}s; {_loss_line(figures)}; "
          f"wall {wall:.0f}s, exit {code}", flush=True)
    return figures


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 2) if values else 0.0


def _loss_line(f: dict[str, Any]) -> str:
    """Goodput with the honest learners' refused steps beside it (issue 42), and the eval loss."""
    return f"goodput {f['goodput']:.1%}, honest steps refused {f['honest_refused_steps']:,}; {_eval_line(f)}"


def _eval_line(f: dict[str, Any]) -> str:
    if f["baseline_eval_loss"] is None:
        return f"eval loss {f['eval_loss']:.4f} (no baseline)"
    return (f"eval loss {f['eval_loss']:.4f} vs {f['baseline_eval_loss']:.4f} without faults "
            f"(ratio {f['eval_loss_vs_baseline']}; tokens {f['tokens']:,} vs {f['baseline_tokens']:,})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="kills,sync_kills,mixed", help="comma-separated scenarios")
    parser.add_argument("--quick", action="store_true", help="20 kills, 3 synchronizer kills, 10 mixed faults")
    parser.add_argument("--kills", type=int, help="learner kills (default 100, --quick 20)")
    parser.add_argument("--sync-kills", type=int, help="synchronizer kills (default 10, --quick 3)")
    parser.add_argument("--mixed", type=int, help="freezes + partitions (default 30, --quick 10)")
    parser.add_argument("--baseline", default="sync_kills,mixed", metavar="SCENARIOS",
                        help="scenarios also run without faults, for the eval loss (default sync_kills,mixed; "
                        "the 100 kills take 16 minutes, their baseline as long again)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a workload option for every run (repeatable), e.g. protocol.shards=2: sync_crash "
                        "then kills one shard of two")
    parser.add_argument("--out", help="keep every run's directory here (default: a temporary directory)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()
    started = stamp(__file__)  # the commit and load when the measurement starts
    counts = {"kills": args.kills or (20 if args.quick else 100),
              "sync_kills": args.sync_kills or (3 if args.quick else 10),
              "mixed": args.mixed or (10 if args.quick else 30)}
    scenarios: dict[str, Callable[[int, Path, bool, int, tuple[str, ...]], dict[str, Any]]] = {
        "kills": kills, "sync_kills": sync_kills, "mixed": mixed}
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in scenarios]
    if unknown:
        print(f"bench_chaos: error: unknown scenario {unknown[0]!r} (scenarios: {', '.join(scenarios)})",
              file=sys.stderr)
        return 2
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    with_baseline = {s.strip() for s in args.baseline.split(",")}
    extra = tuple(arg for kv in args.set for arg in ("--set", kv))
    results = {name: scenarios[name](counts[name], work, name in with_baseline, args.seed, extra) for name in chosen}
    if args.json:
        stamped = {**started,
                   "load_at_end": os.getloadavg(), **results}
        Path(args.json).write_text(json.dumps(stamped, indent=2) + "\n")
    print(f"runs kept in {work}")
    return 0 if all(r["exit_ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
