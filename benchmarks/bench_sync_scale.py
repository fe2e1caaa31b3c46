"""The synchronizer at the scale of real models: what one shard and two shards sustain.

Real synchronizer processes (``ddiloco sync --init``, real gRPC on loopback) serve a model of
``--params`` parameters in P fragments; M synthetic learners (threads, each its own gRPC
client) send int4 contributions of every fragment in turn, as fast as the synchronizer takes
them, and keep their base versions current by polling its status. Measured side by side in
one run and printed as ratios:

- ``sustained_params_per_s``: outer-gradient parameters merged per second, 1 shard and 2
  shards (each shard a process; its kernels run on one core), and ``shard_speedup_2``;
- ``merge_vs_memcpy``: a round of M contributions merged in process (check, accumulate, close:
  outer step, error feedback, int4 encode) against a copy of the same contributions' fp32
  bytes into a preallocated, already-touched buffer — best of several, same run;
- ``sync_rss_bytes_per_param``: the synchronizer's resident memory while it merges, above an idle one;
- ``downlink_vs_model``: downlink bytes of a virtual-cluster run over the bandwidth model's
  one update per fragment per period.

It then prints the largest model one shard keeps up with at M = 8, H = P = 24, one step per
second (each learner sends N/24 parameters per second), and the shards the paper's 12B run
would need. The learners run on the same 2 cores as the synchronizer, so the figures are a
floor: on a dedicated synchronizer host they would be higher.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ddiloco.core.codecs import get_codec
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.messages import Contribution, Join
from ddiloco.core.synchronizer import Synchronizer
from ddiloco.runtime.client import CallRefused, SyncClient, Unreachable

M = 8
P = 24
INT4 = get_codec("int4")


def write_init(path: Path, params: int, fragments: int) -> list[int]:
    """A model of ``fragments`` equal vectors (one per fragment) with ``params`` parameters."""
    sizes = [params // fragments + (1 if i < params % fragments else 0) for i in range(fragments)]
    tensors = {f"w{i:02d}": torch.randn(n) * 0.02 for i, n in enumerate(sizes)}
    save_file(tensors, str(path), metadata={"embedding_names": "[]", "param_order": json.dumps(list(tensors))})
    return sizes


def sync_args(init: Path, port_file: Path, shard: str | None) -> list[str]:
    args = [sys.executable, "-m", "ddiloco.cli", "sync", "--preset", "tiny", "--init", str(init),
            "--learners", str(M), "--tokens", str(10**15), "--listen", "127.0.0.1:0", "--port-file", str(port_file),
            "--set", f"protocol.fragments={P}", "--set", f"protocol.period={P}", "--set", f"protocol.quorum={M}",
            "--set", "protocol.staleness_max=1000", "--set", "protocol.lease_s=600", "--log-level", "warning"]
    return args + (["--shard", shard] if shard else [])


def start_shards(init: Path, shards: int, tmp: Path) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(shards):
        port_file = tmp / f"port-{shards}-{i}"
        port_file.unlink(missing_ok=True)  # a port file of an earlier start must not be read
        shard = None if shards == 1 else f"{i}/{shards}"
        procs.append(subprocess.Popen(sync_args(init, port_file, shard), env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(tmp / f"sync-{shards}-{i}.log", "wb")))
        deadline = time.monotonic() + 300
        while not (port_file.exists() and port_file.read_text().strip()):
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / f"sync-{shards}-{i}.log").read_text())
            time.sleep(0.1)
        addresses.append(f"127.0.0.1:{int(port_file.read_text())}")
    return procs, addresses


def rss_bytes(pid: int, field: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for {pid}")


def _load(addresses: list[str], sizes: list[int], learners: range, warmup_s: float, seconds: float,
          joined: multiprocessing.Barrier, out: multiprocessing.Queue) -> None:
    """One load-generator process: learners as threads, each its own gRPC channel per shard.

    Uploads are pre-serialized (the header chunk is built per call, the payload chunks once)
    so that the generator spends as little CPU as it can: it shares the cores with the
    synchronizers it measures. The window opens once every learner of every generator has
    joined (a join sends the whole model) and a warm-up has passed.
    """
    import grpc

    from ddiloco.runtime import wire
    from ddiloco.runtime.auth import client_metadata
    from ddiloco.runtime.proto import ddiloco_pb2 as pb

    shards = len(addresses)
    payloads = [INT4.encode(torch.randn(n, generator=torch.Generator().manual_seed(p)) * 1e-3)
                for p, n in enumerate(sizes)]
    bodies = [[pb.ContributionChunk(offset=o, data=payload[o:o + wire.CHUNK_BYTES]).SerializeToString()
               for o in range(0, len(payload), wire.CHUNK_BYTES)] for payload in payloads]
    versions = [0] * P
    merged = [0]
    lock = threading.Lock()
    stop, counting = threading.Event(), threading.Event()
    ready = threading.Barrier(len(learners) + 1)

    def poll_versions() -> None:
        clients = [SyncClient(a) for a in addresses]
        while not stop.is_set():
            for c in clients:
                try:
                    for f in c.status_dict()["fragments"]:
                        versions[f["id"]] = f["version"]
                except (Unreachable, CallRefused):
                    pass
            stop.wait(0.1)

    def learner(m: int) -> None:
        channels = [grpc.insecure_channel(a, options=wire.KEEPALIVE_OPTIONS) for a in addresses]
        upload = [ch.stream_unary("/ddiloco.v2.Synchronizer/Contribute", request_serializer=None,
                                  response_deserializer=None) for ch in channels]
        sessions = [SyncClient(a).join(Join(f"learner-{m}", f"bench-{m}")).state.session for a in addresses]
        ready.wait()
        seq = [0] * P
        p = m % P
        while not stop.is_set():
            shard = p % shards
            header = pb.ContributionHeader(
                learner_id=f"learner-{m}", fragment=p, base_version=versions[p], seq=seq[p], tokens=1024, steps=1,
                compute_s=1.0, step_time_s=1e-3, codec="int4", payload_bytes=len(payloads[p]),
                session=wire.session_to_pb(sessions[shard]))
            seq[p] += 1
            first = pb.ContributionChunk(header=header, offset=0).SerializeToString()
            try:
                upload[shard](iter([first, *bodies[p]]), metadata=client_metadata(None), timeout=60)
                if counting.is_set():
                    with lock:
                        merged[0] += sizes[p]
            except grpc.RpcError:
                pass
            p = (p + 1) % P

    threads = [threading.Thread(target=poll_versions, daemon=True)]
    threads += [threading.Thread(target=learner, args=(m,), daemon=True) for m in learners]
    for th in threads:
        th.start()
    ready.wait()
    joined.wait()
    time.sleep(warmup_s)
    out.put(None)  # the window opens: the parent reads the synchronizers' CPU time
    counting.set()
    started, cpu = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    counting.clear()
    elapsed = time.perf_counter() - started
    out.put((merged[0] / elapsed, (time.process_time() - cpu) / elapsed))
    stop.set()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Load:
    params_per_s: float
    rss: int
    sync_cores: float
    """CPU cores the synchronizer processes used during the window (summed)."""
    generator_cores: float
    """CPU cores the load generators used."""


def sustained(init: Path, sizes: list[int], shards: int, seconds: float, tmp: Path) -> Load:
    """What ``shards`` shards sustain, with their resident memory and the CPU the run used."""

    procs, addresses = start_shards(init, shards, tmp)
    try:
        # Spawned, not forked: a child forked after torch's and numba's thread pools started
        # (the in-process merge measurement) hangs in its first torch call.
        ctx = multiprocessing.get_context("spawn")
        out, joined = ctx.Queue(), ctx.Barrier(2)
        loaders = [ctx.Process(target=_load, args=(addresses, sizes, range(i, M, 2), max(2.0, seconds / 5), seconds,
                                                   joined, out)) for i in range(2)]
        for loader in loaders:
            loader.start()
        for _ in loaders:
            out.get(timeout=600)
        sync_cpu, opened = sum(cpu_seconds(proc.pid) for proc in procs), time.perf_counter()
        results = [out.get(timeout=600) for _ in loaders]
        sync_cores = (sum(cpu_seconds(proc.pid) for proc in procs) - sync_cpu) / (time.perf_counter() - opened)
        rss = sum(rss_bytes(proc.pid, "VmRSS") for proc in procs)  # steady state, after the joins
        for loader in loaders:
            loader.kill()
            loader.join()
        return Load(sum(r for r, _ in results), rss, sync_cores, sum(c for _, c in results))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def idle_rss(init_small: Path, tmp: Path) -> int:
    procs, _ = start_shards(init_small, 1, tmp)
    try:
        time.sleep(1.0)
        return rss_bytes(procs[0].pid, "VmRSS")
    finally:
        procs[0].kill()
        procs[0].wait()


def merge_vs_memcpy(numel: int, repeats: int) -> tuple[float, float, float]:
    """(ratio, merge seconds, memcpy seconds): a round of M int4 contributions vs copying their fp32 bytes.

    Rounds follow each other on one synchronizer (its buffers exist, as in a long run); each
    round is timed from its first contribution to its close, best of ``repeats`` after one.
    """
    protocol = ProtocolConfig(fragments=1, period=P, quorum=M, lease_s=1e9, space_rounds=False)
    payloads = [INT4.encode(torch.randn(numel) * 1e-3) for _ in range(M)]
    sync = Synchronizer(protocol, [torch.randn(numel) * 0.02])
    sessions = [sync.handle(Join(f"l{m}", "b"), 0.0)[0].state.session for m in range(M)]
    rounds = []
    for r in range(repeats + 1):
        contributions = [Contribution(learner_id=f"l{m}", session=sessions[m], fragment=0, base_version=r, seq=r,
                                      tokens=1024, steps=1, compute_s=1.0, step_time_s=1.0, codec="int4",
                                      payload=payloads[m]) for m in range(M)]
        started = time.perf_counter()
        for c in contributions:
            sync.handle(c, 1.0 + r)
        rounds.append(time.perf_counter() - started)
        assert sync.versions() == (r + 1,), "the round closes with the last contribution"
    src = np.random.default_rng(0).standard_normal(M * numel, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touched: the pages exist before the timing
    copies = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - started)
    return min(copies) / min(rounds[1:]), min(rounds[1:]), min(copies)


def downlink_vs_model(quick: bool) -> float:
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_crosscheck as xc

    from ddiloco.config import build_config
    from ddiloco.sim.bandwidth import check_counted_bytes
    from ddiloco.sim.network import HEADER_BYTES

    config = (xc.tiny_config(learners=4, seed=0, time_s=240.0) if quick
              else build_config(preset="default", overrides=("train.evals=1", "train.eval_batches=1")))
    run = xc.run_cluster(config)
    steps = {lr.name: run.recorder.accounting.steps(lr.index) for lr in run.cluster.learners}
    down = check_counted_bytes(run.recorder.bytes.counts, steps, xc.bandwidth_inputs(run), header_bytes=HEADER_BYTES,
                               rounds_per_period=1.0)["down"]
    return down.counted_bytes / down.predicted_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~20M parameters, shorter windows (CI-sized)")
    parser.add_argument("--params", type=float, help="model parameters (default 100M; quick 20M)")
    parser.add_argument("--seconds", type=float, help="measuring window per configuration (default 30; quick 10)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()
    params = int(args.params or (20e6 if args.quick else 100e6))
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    if params < P or seconds <= 0:
        raise SystemExit("bench_sync_scale: error: --params must be at least 24 and --seconds positive")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        init, small = tmp / "init.safetensors", tmp / "small.safetensors"
        sizes = write_init(init, params, P)
        write_init(small, P * 1000, P)
        ratio, merge_s, copy_s = merge_vs_memcpy(sizes[0], repeats=5)
        baseline = idle_rss(small, tmp)
        single = sustained(init, sizes, 1, seconds, tmp)
        double = sustained(init, sizes, 2, seconds, tmp)
    one, two = single.params_per_s, double.params_per_s
    downlink = downlink_vs_model(args.quick)
    rss_per_param = (single.rss - baseline) / params
    # The generators share the machine's cores: at the CPU cost per parameter measured with one
    # shard (synchronizer + generators), this is about what the machine's cores allow.
    cores = os.cpu_count() or 1
    ceiling = cores * one / (single.sync_cores + single.generator_cores)
    result = {
        "params": params, "learners": M, "fragments": P,
        "merge_vs_memcpy": round(ratio, 3), "merge_round_s": round(merge_s, 4), "memcpy_s": round(copy_s, 4),
        "sustained_params_per_s": {"1": round(one), "2": round(two)},
        "shard_speedup_2": round(two / one, 3),
        "shard_speedup_ceiling": round(ceiling / one, 3),
        "sync_params_per_core_s": {"1": round(one / single.sync_cores), "2": round(two / double.sync_cores)},
        "cores_used": {str(n): {"sync": round(r.sync_cores, 2), "generators": round(r.generator_cores, 2)}
                       for n, r in ((1, single), (2, double))},
        "sync_rss_bytes_per_param": round(rss_per_param, 2),
        "downlink_vs_model": round(downlink, 3),
        "load": os.getloadavg(),
    }
    keeps_up = one * P / M  # each learner sends N / P parameters per step
    print(f"model {params / 1e6:.0f}M params in {P} fragments, M={M} synthetic learners")
    print(f"merge vs memcpy: a round of {M} x {sizes[0] / 1e6:.1f}M int4 contributions {merge_s * 1e3:.0f} ms, copying "
          f"their fp32 bytes {copy_s * 1e3:.0f} ms -> {ratio:.3f}")
    print(f"sustained: 1 shard {one / 1e6:.1f}M params/s, 2 shards {two / 1e6:.1f}M params/s -> speedup {two / one:.2f}")
    for n, r in ((1, single), (2, double)):
        print(f"  {n} shard(s): synchronizers used {r.sync_cores:.2f} cores ({r.params_per_s / r.sync_cores / 1e6:.0f}M "
              f"params per core-second), the load generators {r.generator_cores:.2f}")
    print(f"  at one shard's CPU cost per parameter, {cores} cores shared with the generators allow a speedup of "
          f"about {ceiling / one:.2f}")
    print(f"synchronizer memory: {rss_per_param:.1f} bytes per parameter above an idle one")
    print(f"downlink bytes vs the bandwidth model (one update per fragment per period): {downlink:.3f}")
    print(f"one shard keeps up with a model of {keeps_up / 1e9:.2f}B parameters at M=8, H=P=24, 1 step/s; "
          f"the paper's 12B model needs {12e9 * M / P / one:.0f} such shards (and hosts with cores to spare)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
