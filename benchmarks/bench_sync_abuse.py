"""A burst of registrations against a live synchronizer with two honest learners.

    python benchmarks/bench_sync_abuse.py --json docs/results/sync_abuse.json   # about 3 minutes on 2 cores

A real ``ddiloco sync`` (tiny preset, M = 2: it admits at most 8 leases) and two real
``ddiloco learner`` processes train on loopback. Then ``--joins`` Join calls with distinct
learner ids arrive from ``--threads`` threads at once, while one thread keeps asking for the
status. Measured side by side, before / during / after the burst:

- fragment versions merged per minute (what reached the global model), as a ratio to before;
- Status latency (median and worst), and whether every status call was answered;
- the synchronizer's resident memory (from /proc), and how the burst's calls ended.

The run stands on what an honest learner needs: status still answers, memory stays bounded,
the honest learners keep merging, and no call ends with an unhandled server error.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from stamp import stamp

from ddiloco.core.shared.messages import Join
from ddiloco.runtime.client import CallRefused, SyncClient, Unreachable
from ddiloco.testing import ddiloco_argv, learner_args, port_from_file, sync_argv

PACE = ("--min-step-s", "0.05")
"""Honest learners pace their steps, so the measurement is the synchronizer's, not the cores' contention."""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def merged(client: SyncClient) -> int:
    return sum(f["version"] for f in client.status_dict(timeout_s=30)["fragments"])


def merge_rate(client: SyncClient, seconds: float) -> float:
    """Fragment versions merged per minute over ``seconds``."""
    start, t0 = merged(client), time.monotonic()
    time.sleep(seconds)
    return (merged(client) - start) * 60.0 / (time.monotonic() - t0)


def outcome(call) -> str:
    try:
        call()
        return "ok"
    except CallRefused as err:
        return err.reason
    except Unreachable:
        return "unreachable"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--joins", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--window", type=float, default=30.0, help="seconds to measure merges before and after")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    stamped = stamp(__file__)

    work = Path(tempfile.mkdtemp(prefix="bench-abuse-"))
    port_file = work / "port"
    logs = [open(work / f"{name}.log", "wb") for name in ("sync", "learner-0", "learner-1")]
    argv = ddiloco_argv(*sync_argv(learners=2, tokens=10**12, port_file=port_file, log_level="warning"))
    sync = subprocess.Popen(argv, stdout=logs[0], stderr=subprocess.STDOUT)
    learners: list[subprocess.Popen] = []
    try:
        port = port_from_file(port_file, sync, work / "sync.log", timeout_s=600)
        address = f"127.0.0.1:{port}"
        learners = [subprocess.Popen(ddiloco_argv(*learner_args(port, f"learner-{m}", *PACE)), stdout=logs[m + 1],
                                     stderr=subprocess.STDOUT) for m in range(2)]
        client = SyncClient(address)
        while merged_or_zero(client) < 6:
            time.sleep(1.0)
        rss_before = rss_mb(sync.pid)
        before = merge_rate(client, args.window)

        latencies: list[float] = []
        status_errors: collections.Counter[str] = collections.Counter()
        rss_seen = [rss_before]
        done = threading.Event()

        def poll_status() -> None:
            with SyncClient(address) as poller:
                while not done.is_set():
                    rss_seen.append(rss_mb(sync.pid))
                    t0 = time.perf_counter()
                    result = outcome(lambda: poller.status_dict(timeout_s=30, learner_limit=10))
                    if result == "ok":
                        latencies.append(time.perf_counter() - t0)
                    else:
                        status_errors[result] += 1
                    time.sleep(0.2)

        def register(i: int) -> str:
            with SyncClient(address) as burst:
                return outcome(lambda: burst.join(Join(f"burst-{i:05d}", f"boot-{i}")))

        poller = threading.Thread(target=poll_status, daemon=True)
        poller.start()
        during_start, t0 = merged(client), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.threads) as pool:
            futures = [pool.submit(register, i) for i in range(args.joins)]
        burst_s = time.monotonic() - t0
        during = (merged(client) - during_start) * 60.0 / burst_s
        done.set()
        poller.join(60)
        outcomes = collections.Counter(f.result() for f in futures)
        after = merge_rate(client, args.window)
        rss_after = rss_mb(sync.pid)
        rss_peak = max(rss_seen)
        status = client.status_dict()
        client.close()
        result = {
            "joins": args.joins, "threads": args.threads, "burst_s": round(burst_s, 1),
            "join_outcomes": dict(outcomes),
            "status_calls": len(latencies), "status_errors": dict(status_errors),
            "status_latency_median_s": round(statistics.median(latencies), 4) if latencies else None,
            "status_latency_max_s": round(max(latencies), 4) if latencies else None,
            "versions_per_min": {"before": round(before, 1), "during": round(during, 1), "after": round(after, 1)},
            "merge_rate_during_over_before": round(during / before, 3) if before else None,
            "merge_rate_after_over_before": round(after / before, 3) if before else None,
            "sync_rss_mb": {"before": round(rss_before, 1), "peak": round(rss_peak, 1), "after": round(rss_after, 1)},
            "learners_listed": status["learners_total"], "rejections": status["rejections"],
        }
    finally:
        for proc in [*learners, sync]:
            proc.terminate()
        for proc in [*learners, sync]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()
    print(json.dumps(result, indent=2))
    print(f"merges during the burst / before: {result['merge_rate_during_over_before']}; "
          f"after / before: {result['merge_rate_after_over_before']}; status answered {len(latencies)} times "
          f"(worst {result['status_latency_max_s']} s); synchronizer RSS {rss_before:.0f} -> peak {rss_peak:.0f} MB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**stamped, **result}, indent=2) + "\n")
    return 0


def merged_or_zero(client: SyncClient) -> int:
    try:
        return merged(client)
    except (Unreachable, grpc.RpcError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
