"""Time the full default goodput table: 6 configurations x 5 cluster sizes x 5 seeds.

The issue's budget is 10 s of wall time on 2 cores and 2 GB of memory. The process pins
itself to two cores (where the OS allows it), runs the table ``--repeat`` times, and prints
wall time, CPU time, the Python-level peak allocation (tracemalloc, numpy arrays included)
and the process's peak resident set, each with its ratio to the budget.

    PYTHONPATH=src python benchmarks/bench_goodput.py
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import tracemalloc

from ddiloco.scale.goodput_model import DEFAULT_CHIPS, DEFAULT_CONFIGS, ClusterModel, simulate_table

BUDGET_S = 10.0
BUDGET_BYTES = 2 * 1024**3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))[:2]
        os.sched_setaffinity(0, cores)
    print(f"cores: {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else 'unknown'}, "
          f"cells: {len(DEFAULT_CONFIGS)} configs x {len(DEFAULT_CHIPS)} sizes x {args.seeds} seeds")

    model = ClusterModel()
    simulate_table(DEFAULT_CONFIGS, DEFAULT_CHIPS[:1], model, seeds=1)  # warm caches (quadrature, imports)
    walls, cpus = [], []
    for _ in range(args.repeat):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        rows = simulate_table(DEFAULT_CONFIGS, DEFAULT_CHIPS, model, seeds=args.seeds)
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
    tracemalloc.start()  # a separate run: tracing slows allocation down
    simulate_table(DEFAULT_CONFIGS, DEFAULT_CHIPS, model, seeds=args.seeds)
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

    best, worst = min(walls), max(walls)
    print(f"rows: {len(rows)}")
    print(f"wall: best {best:.3f} s, worst {worst:.3f} s  ({worst / BUDGET_S:.1%} of the 10 s budget)")
    print(f"cpu:  best {min(cpus):.3f} s")
    print(f"peak traced allocation: {peak_bytes / 1e6:.1f} MB  ({peak_bytes / BUDGET_BYTES:.2%} of 2 GB)")
    print(f"peak resident set (whole process, incl. interpreter and numpy): {rss_bytes / 1e6:.0f} MB  "
          f"({rss_bytes / BUDGET_BYTES:.1%} of 2 GB)")
    return 0 if worst < BUDGET_S and rss_bytes < BUDGET_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
