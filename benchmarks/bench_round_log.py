"""What the round log costs the synchronizer's merge (issue 26: at most 5% of merge throughput).

Merges rounds of a model split into fragments, each round M int4 contributions added and the
fused close (the synchronizer's own code: ``RoundAccumulator.add``, ``GlobalFragment.close``),
in pairs, alternating: once alone, once with every round's update appended to a real
``RoundLog`` in a temporary state directory (its thread, CRC and group-committed fsync), the
pair's order swapped each time. Throughput is merged parameters per CPU-second of the whole
process (the log's thread included) and per wall-second. Also reports the bytes the log
writes per round and per parameter.

    python benchmarks/bench_round_log.py --params 1e8 --pairs 5 --json docs/results/round_log_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from stamp import stamp

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.kernels import compile_kernels
from ddiloco.core.sync_side.accumulate import BufferPool, RoundAccumulator
from ddiloco.core.sync_side.merge import merge_rule
from ddiloco.core.sync_side.outer import NesterovSGD
from ddiloco.core.sync_side.rounds import GlobalFragment
from ddiloco.runtime.sync.round_log import RoundLog

INT4 = get_codec("int4")
OUTER = NesterovSGD(lr=0.4, momentum=0.9)


def build(params: int, fragments: int, learners: int) -> tuple[list[GlobalFragment], list[list[bytes]]]:
    numel = params // fragments
    pool = BufferPool()
    g = torch.Generator().manual_seed(0)
    frags, payloads = [], []
    for _ in range(fragments):
        frags.append(GlobalFragment(value=torch.randn(numel, generator=g) * 0.02, is_embedding=False,
                                    accumulator=RoundAccumulator(numel, INT4, merge_rule("rda"), pool)))
        payloads.append([INT4.encode(torch.randn(numel, generator=g) * 0.01) for _ in range(learners)])
    return frags, payloads


def sweep(frags: list[GlobalFragment], payloads: list[list[bytes]], log: RoundLog | None) -> tuple[float, float, int]:
    """Every fragment merges one round; (cpu s, wall s, bytes logged)."""
    cpu, wall = time.process_time(), time.perf_counter()
    logged, pending = 0, []
    for p, frag in enumerate(frags):
        for m, payload in enumerate(payloads[p]):
            frag.accumulator.add(m, payload, 1000.0, frag.accumulator.measure(payload))
        update, _ = frag.close(OUTER, INT4, plain=False)
        if log is not None:
            pending.append(log.append(p, frag.version, False, update))
            logged += len(update)
    for f in pending:
        f.result()  # durable, as the update stream waits for it
    return time.process_time() - cpu, time.perf_counter() - wall, logged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e8)
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--learners", type=int, default=8, help="contributions per round (M)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--sweeps", type=int, default=3, help="rounds of every fragment per sample")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    stamped = stamp(__file__)  # the commit and load when the measurement starts
    compile_kernels()
    params = int(args.params)
    frags, payloads = build(params, args.fragments, args.learners)
    sweep(frags, payloads, None)  # warm: pool buffers, page faults
    rates: dict[str, list[float]] = {"alone": [], "logged": []}
    walls: dict[str, list[float]] = {"alone": [], "logged": []}
    logged_bytes = 0
    with tempfile.TemporaryDirectory(prefix="bench_round_log-", dir=os.environ.get("BENCH_DIR")) as tmp:
        log = RoundLog(Path(tmp), {"layout_sha256": "bench", "shard": 0})
        for pair in range(args.pairs):
            for kind in (("alone", "logged") if pair % 2 == 0 else ("logged", "alone")):
                cpu = wall = 0.0
                for _ in range(args.sweeps):
                    c, w, b = sweep(frags, payloads, log if kind == "logged" else None)
                    cpu, wall = cpu + c, wall + w
                    logged_bytes = b or logged_bytes
                merged = params * args.sweeps
                rates[kind].append(merged / cpu)
                walls[kind].append(merged / wall)
                print(f"pair {pair} {kind:6s}: {merged / cpu / 1e6:6.1f}M params per CPU-s, "
                      f"{merged / wall / 1e6:6.1f}M per wall-s (load {os.getloadavg()[0]:.2f})", flush=True)
        log.close()
    ratios = [lg / al for al, lg in zip(rates["alone"], rates["logged"])]
    wall_ratios = [lg / al for al, lg in zip(walls["alone"], walls["logged"])]
    result = {
        **stamped,
        "params": params, "fragments": args.fragments, "learners": args.learners, "pairs": args.pairs,
        "params_per_cpu_s": {k: round(statistics.median(v)) for k, v in rates.items()},
        "logged_vs_alone_cpu": round(statistics.median(ratios), 4),
        "logged_vs_alone_cpu_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "logged_vs_alone_wall": round(statistics.median(wall_ratios), 4),
        "log_bytes_per_round_of_every_fragment": logged_bytes,
        "log_bytes_per_param_per_round": round(logged_bytes / params, 4),
        "load_after": os.getloadavg(),
    }
    print(f"logged / alone: {result['logged_vs_alone_cpu']} per CPU-s (range {result['logged_vs_alone_cpu_range']}), "
          f"{result['logged_vs_alone_wall']} per wall-s; the log writes "
          f"{result['log_bytes_per_param_per_round']} bytes per parameter per round")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
