"""The synchronizer at the scale of real models: its memory over a whole run, its merge rate, its status.

Real synchronizer processes (``ddiloco sync --init``, real gRPC on loopback) serve a model of
``--params`` parameters in P = 24 fragments; M = 8 synthetic learners (threads in two load
generator processes, each its own gRPC client) send int4 contributions of every fragment in
turn, as fast as the synchronizer takes them. One run, measured side by side:

- **the run** (one synchronizer with a state directory): the learners join, a merging window
  opens, checkpoints are written every P rounds or ``--checkpoint-every`` seconds, two more
  learners join at once a third into the window (their state transfers go out side by side
  while rounds merge), then
  the synchronizer is killed with ``kill -9`` and restarted with ``--resume``, and one more
  learner joins it. Reported: ``steady_bytes_per_param`` (median resident memory in the
  window), ``peak_bytes_per_param`` (VmHWM of each synchronizer process over the whole run,
  the restored one included), ``status_p99_ms`` (the status page's ``/api/status``, served by
  a process of its own, polled every 100 ms while merging, with ``status_age_p99_ms``: how old
  the status it gave was) beside ``loop_status_p99_ms`` (the gRPC Status call, answered by the
  synchronizer's event loop, polled alongside),
  merged parameters per second and per synchronizer core, and a plot of resident memory over
  time with the checkpoints, joins, kill and restore marked;
- **two shards** (``--shard 0/2``, ``1/2``): merge rate and each shard's peak memory;
- ``merge_vs_memcpy``: a round of M contributions merged in process (check, accumulate,
  close) against a memcpy of the bytes that merge must read and write (``merge_bytes``);
- ``downlink_vs_model``: downlink bytes of a virtual-cluster run over the bandwidth model.

The learners run on the same 2 cores as the synchronizer, so rates are a floor.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from stamp import stamp
from sync_load import (
    INT4,
    M,
    P,
    Timeline,
    Window,
    join_discarding,
    merging_window,
    page_process,
    proc_field,
    start_sync,
    watch_checkpoints,
    write_init,
)

from ddiloco.core.shared.messages import Contribution, Join
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.runtime.client import SyncClient


def the_run(init: Path, sizes: list[int], seconds: float, checkpoint_s: float, tmp: Path) -> dict:
    """One synchronizer with checkpoints, joins while it merges, a kill -9 and a --resume."""
    timeline = Timeline()
    sampler = threading.Thread(target=timeline.run, daemon=True)
    sampler.start()
    state = ["--state-dir", str(tmp / "state"), "--checkpoint-every-rounds", str(P),
             "--checkpoint-every", str(checkpoint_s)]
    timeline.mark("synchronizer starts")
    proc, address, page_url = start_sync(init, tmp, "run", *state)
    timeline.pids.append(proc.pid)
    timeline.mark("synchronizer serves")
    stop_watch = threading.Event()
    watcher = threading.Thread(target=watch_checkpoints, args=(address, timeline, stop_watch), daemon=True)
    watcher.start()
    window = merging_window([address], [proc.pid], sizes, seconds, timeline, extra_joins=2, page_url=page_url)
    page_peak = proc_field(page_process(proc.pid), "VmHWM")
    stop_watch.set()
    watcher.join(60)
    timeline.sample()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    timeline.mark("kill -9")
    resumed, address, _ = start_sync(init, tmp, "run", *state, "--resume")
    timeline.pids.append(resumed.pid)
    with SyncClient(address) as client:
        status = client.status_dict(timeout_s=120)
    restored = {"checkpoint": status["checkpoints"], "versions": sum(f["version"] for f in status["fragments"])}
    timeline.mark(f"restored from checkpoint {restored['checkpoint']} (--resume, {restored['versions']} "
                  "versions merged), serving")
    join_discarding(address, "after-restore")
    timeline.mark("a learner joined the restored synchronizer")
    time.sleep(2.0)
    timeline.sample()
    timeline.stop.set()
    sampler.join(10)
    peaks = dict(timeline.peaks)
    resumed.kill()
    resumed.wait()
    return {"window": window, "timeline": timeline, "peaks": peaks, "restored": restored, "page_peak": page_peak}


def two_shards(init: Path, sizes: list[int], seconds: float, tmp: Path) -> dict:
    timeline = Timeline()
    sampler = threading.Thread(target=timeline.run, daemon=True)
    sampler.start()
    procs, addresses, pages = [], [], []
    try:
        for i in range(2):
            proc, address, page_url = start_sync(init, tmp, f"shard-{i}", "--shard", f"{i}/2")
            procs.append(proc)
            addresses.append(address)
            pages.append(page_url)
            timeline.pids.append(proc.pid)
        window = merging_window(addresses, [p.pid for p in procs], sizes, seconds, timeline, extra_joins=0,
                                page_url=pages[0])
        timeline.sample()
        return {"window": window, "peaks": [timeline.peaks[p.pid] for p in procs]}
    finally:
        timeline.stop.set()
        for proc in procs:
            proc.kill()
            proc.wait()


def idle_rss(init_small: Path, tmp: Path) -> int:
    proc, _, _ = start_sync(init_small, tmp, "idle")
    try:
        time.sleep(1.0)
        return proc_field(proc.pid, "VmRSS")
    finally:
        proc.kill()
        proc.wait()


def merge_bytes(numel: int, learners: int) -> int:
    """Bytes a round of ``learners`` int4 contributions must read and write, per the fused path:
    each contribution's payload read twice (checked on arrival, added at the close) and the fp32
    sum read and written; the close then reads and zeroes the sum, reads and writes Θ (fp32), the
    bf16 momentum and the int8 residual, and writes the int4 update."""
    payload = INT4.encoded_size(numel)
    per_contribution = 2 * payload + 8 * numel
    close = (4 + 4) + (4 + 4) + (2 + 2) + (1 + 1)
    return learners * per_contribution + close * numel + payload


def merge_vs_memcpy(numel: int, repeats: int) -> tuple[float, float, float]:
    """(ratio, merge seconds, memcpy seconds): a round of M int4 contributions against a memcpy
    that moves as many bytes as the round must read and write (a copy of B/2 bytes reads B/2
    and writes B/2). Best of ``repeats`` after one, rounds following each other on one
    synchronizer, the copy into a buffer already touched."""
    protocol = ProtocolConfig(fragments=1, period=P, quorum=M, lease_s=1e9, space_rounds=False)
    payloads = [INT4.encode(torch.randn(numel) * 1e-3) for _ in range(M)]
    sync = Synchronizer(protocol, [torch.randn(numel) * 0.02])
    sessions = [sync.handle(Join(f"l{m}", "b"), 0.0)[0].state.session for m in range(M)]
    rounds = []
    for r in range(repeats + 1):
        contributions = [Contribution(learner_id=f"l{m}", session=sessions[m], fragment=0, base_version=r, seq=r,
                                      tokens=1024, steps=1, compute_s=1e-3, step_time_s=1e-3, codec="int4",
                                      payload=payloads[m]) for m in range(M)]
        started = time.perf_counter()
        for c in contributions:
            sync.handle(c, 1.0 + r)
        rounds.append(time.perf_counter() - started)
        assert sync.versions() == (r + 1,), "the round closes with the last contribution"
    src = np.random.default_rng(0).standard_normal(merge_bytes(numel, M) // 8, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touched: the pages exist before the timing
    copies = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - started)
    return min(copies) / min(rounds[1:]), min(rounds[1:]), min(copies)


def downlink_vs_model(quick: bool) -> float:
    import bench_crosscheck as xc

    from ddiloco.scale.bandwidth_model import check_counted_bytes
    from ddiloco.settings.config_sources import build_config
    from ddiloco.sim.network import HEADER_BYTES

    config = (xc.tiny_config(learners=4, seed=0, time_s=240.0) if quick
              else build_config(preset="default", overrides=("train.evals=1", "train.eval_batches=1")))
    run = xc.run_cluster(config)
    steps = {lr.name: run.recorder.accounting.steps(lr.index) for lr in run.cluster.learners}
    down = check_counted_bytes(run.recorder.bytes.counts, steps, xc.bandwidth_inputs(run), header_bytes=HEADER_BYTES,
                               rounds_per_period=1.0)["down"]
    return down.counted_bytes / down.predicted_bytes


def plot(timeline: Timeline, params: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s for s, _, _ in timeline.samples]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.plot(t, [r / params for _, r, _ in timeline.samples], label="resident (VmRSS)", color="tab:blue")
    ax.plot(t, [h / params for _, _, h in timeline.samples], label="peak so far (VmHWM)", color="tab:red", lw=0.8)
    colors = {"checkpoint": "tab:green", "join": "tab:purple", "kill": "black", "restor": "tab:orange"}
    marks: list[tuple[float, str, str]] = []  # events within a second of each other share one label
    for when, what in timeline.events:
        color = next((c for k, c in colors.items() if k in what), None)
        if color is not None and marks and when - marks[-1][0] < 1.0 and marks[-1][2] == color:
            marks[-1] = (marks[-1][0], f"{marks[-1][1]} + {what}", color)
        elif color is not None:
            marks.append((when, what, color))
    previous, y = -1e9, 0.3
    for when, what, color in marks:
        y = y + 3.0 if when - previous < 4.0 else 0.3  # labels of nearby events stacked, not overprinted
        previous = when
        ax.axvline(when, color=color, lw=0.8, ls="--")
        ax.text(when, y, what, rotation=90, fontsize=7, va="bottom", ha="right", color=color)
    opened = [when for when, what in timeline.events if what == "merging window opens"]
    closed = [when for when, what in timeline.events if what == "merging window closes"]
    for i, (start, end) in enumerate(zip(opened, closed)):
        ax.axvspan(start, end, color="tab:gray", alpha=0.12, label="merging window" if i == 0 else None)
    ax.set_xlabel("seconds")
    ax.set_ylabel("bytes per parameter")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Synchronizer memory over a run: {params / 1e9:.2g}B parameters, M={M}, P={P} "
                 "(checkpoints, joins, kill -9, --resume)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20M parameters, short windows (CI-sized)")
    parser.add_argument("--params", type=float, help="model parameters (default 100M; quick 20M)")
    parser.add_argument("--seconds", type=float, help="merging window per configuration (default 90; quick 10)")
    parser.add_argument("--checkpoint-every", type=float, help="seconds between checkpoints (default 20; quick 3)")
    parser.add_argument("--no-shards", action="store_true", help="skip the two-shard measurement")
    parser.add_argument("--no-downlink", action="store_true", help="skip the virtual run that counts downlink bytes")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="PNG", help="plot resident memory over the run")
    args = parser.parse_args()
    params = int(args.params or (20e6 if args.quick else 100e6))
    seconds = args.seconds or (10.0 if args.quick else 90.0)
    checkpoint_s = args.checkpoint_every or (3.0 if args.quick else 20.0)
    if params < P or seconds <= 0 or checkpoint_s <= 0:
        raise SystemExit("bench_sync_scale: error: --params must be at least 24, --seconds and --checkpoint-every "
                         "positive")
    stamped = stamp(__file__)  # the commit and load when the synchronizer under test starts
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        init, small = tmp / "init.safetensors", tmp / "small.safetensors"
        sizes = write_init(init, params, P)
        write_init(small, P * 1000, P)
        ratio, merge_s, copy_s = merge_vs_memcpy(sizes[0], repeats=3 if params > 2e8 else 5)
        baseline = idle_rss(small, tmp)
        print(f"the run: {params / 1e6:.0f}M parameters, {M} learners, {seconds:.0f}s merging window", flush=True)
        run = the_run(init, sizes, seconds, checkpoint_s, tmp)
        shards = None if args.no_shards else two_shards(init, sizes, seconds, tmp)
    downlink = float("nan") if args.no_downlink else downlink_vs_model(args.quick)
    window: Window = run["window"]
    status = sorted(ms for _, ms, _ in window.status_ms)
    loop_status = sorted(ms for _, ms in window.loop_status_ms)
    started = run["timeline"].started
    slowest = [(round(t - started, 1), round(ms, 1)) for t, ms, _ in sorted(window.status_ms, key=lambda c: c[1])[-10:]]
    loop_slowest = [(round(t - started, 1), round(ms, 1))
                    for t, ms in sorted(window.loop_status_ms, key=lambda c: c[1])[-10:]]
    one = window.clean_params_per_s
    result = {
        "params": params, "learners": M, "fragments": P,
        "steady_bytes_per_param": round(window.rss_median / params, 2),
        "steady_bytes_per_param_above_idle": round((window.rss_median - baseline) / params, 2),
        "peak_bytes_per_param": round(max(run["peaks"].values()) / params, 2),
        "peak_bytes_per_process": sorted(run["peaks"].values()),
        "status_source": "the status page's /api/status (ddiloco sync --http-port: a process of its own)",
        "status_p99_ms": p99(status), "status_median_ms": round(statistics.median(status), 1) if status else None,
        "status_calls": len(status), "status_slowest": slowest,
        "status_age_p99_ms": p99(sorted(age for _, _, age in window.status_ms)),
        "status_age_max_ms": round(max((age for _, _, age in window.status_ms), default=float("nan")), 1),
        "page_process_peak_bytes": run["page_peak"],
        "loop_status_p99_ms": p99(loop_status),
        "loop_status_median_ms": round(statistics.median(loop_status), 1) if loop_status else None,
        "loop_status_calls": len(loop_status), "loop_status_slowest": loop_slowest,
        "sustained_params_per_s": round(one),
        "sync_params_per_core_s": round(one / window.clean_sync_cores) if window.clean_sync_cores else None,
        "cores_used": {"sync": round(window.clean_sync_cores, 2), "generators": round(window.generator_cores, 2)},
        "params_per_s_whole_window_with_joins": round(window.params_per_s),
        "merge_vs_memcpy": round(ratio, 3), "merge_round_s": round(merge_s, 4), "memcpy_s": round(copy_s, 4),
        "merge_bytes_per_param": round(merge_bytes(sizes[0], M) / sizes[0], 2),
        "merged_params_per_s_in_process": round(M * sizes[0] / merge_s),
        "idle_rss_bytes": baseline,
        "restored": run["restored"],
        "events": [(round(t, 1), what) for t, what in run["timeline"].events],
        "downlink_vs_model": round(downlink, 3),
    }
    if shards is not None:
        two: Window = shards["window"]
        result["two_shards"] = {
            "sustained_params_per_s": round(two.params_per_s), "speedup": round(two.params_per_s / one, 3),
            "sync_params_per_core_s": round(two.params_per_s / two.sync_cores) if two.sync_cores else None,
            "peak_bytes_per_shard": shards["peaks"],
            "peak_bytes_per_param_of_its_fragments": [round(peak / (params / 2), 2) for peak in shards["peaks"]],
            "cores_used": {"sync": round(two.sync_cores, 2), "generators": round(two.generator_cores, 2)}}
    result.update(stamped, load_after=os.getloadavg())
    print(f"model {params / 1e6:.0f}M params in {P} fragments, M={M} synthetic learners")
    print(f"memory: steady {result['steady_bytes_per_param']} B/param (median resident while merging), peak "
          f"{result['peak_bytes_per_param']} B/param (VmHWM over the run: checkpoints, 2 joins, kill -9, --resume)")
    print(f"status page while merging: p99 {result['status_p99_ms']} ms, median {result['status_median_ms']} ms "
          f"({len(status)} calls; the status it gave: p99 {result['status_age_p99_ms']} ms old, at most "
          f"{result['status_age_max_ms']} ms)")
    print(f"gRPC Status (the event loop) while merging: p99 {result['loop_status_p99_ms']} ms, median "
          f"{result['loop_status_median_ms']} ms ({len(loop_status)} calls)")
    print(f"merge: {one / 1e6:.1f}M params/s sustained before the late joins ({window.params_per_s / 1e6:.1f}M over "
          f"the whole window), {window.clean_sync_cores:.2f} synchronizer cores "
          f"({result['sync_params_per_core_s'] / 1e6:.0f}M params per core-second), generators "
          f"{window.generator_cores:.2f} cores")
    print(f"merge vs memcpy of the {result['merge_bytes_per_param']} B/param a round reads and writes: "
          f"{merge_s * 1e3:.0f} ms vs {copy_s * 1e3:.0f} ms -> {ratio:.3f}")
    if shards is not None:
        print(f"two shards: {result['two_shards']['sustained_params_per_s'] / 1e6:.1f}M params/s (x"
              f"{result['two_shards']['speedup']}), peaks {[round(p / 1e9, 2) for p in shards['peaks']]} GB")
    print(f"downlink bytes vs the bandwidth model: {downlink:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(run["timeline"], params, Path(args.plot))


def p99(sorted_ms: list[float]) -> float:
    return round(sorted_ms[min(len(sorted_ms) - 1, int(0.99 * len(sorted_ms)))], 1) if sorted_ms else float("nan")


if __name__ == "__main__":
    main()
