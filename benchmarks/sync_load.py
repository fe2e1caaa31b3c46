"""The load that bench_sync_scale.py puts on real synchronizer processes, and what it reads meanwhile.

M synthetic learners (threads in load-generator processes, each its own gRPC client) join a
``ddiloco sync --init`` of P fragments and send int4 contributions of every fragment in turn,
as fast as the synchronizer takes them (:func:`merging_window`); a :class:`Timeline` samples
the synchronizer processes' resident memory with what happened when; the status page and the
gRPC Status call are polled from a process of their own. ``python benchmarks/bench_sync_scale.py``
runs it; this module is the harness, not a benchmark.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.messages import Join, Session
from ddiloco.runtime.client import CallRefused, SyncClient, Unreachable
from ddiloco.testing import SyncProcess, free_port

M = 8
P = 24
INT4 = get_codec("int4")


def write_init(path: Path, params: int, fragments: int) -> list[int]:
    """A model of ``fragments`` equal vectors (one per fragment) with ``params`` parameters."""
    sizes = [params // fragments + (1 if i < params % fragments else 0) for i in range(fragments)]
    tensors = {f"w{i:02d}": torch.randn(n) * 0.02 for i, n in enumerate(sizes)}
    save_file(tensors, str(path), metadata={"embedding_names": "[]", "param_order": json.dumps(list(tensors))})
    return sizes


def start_sync(init: Path, tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """A synchronizer with its status page; returns it, its gRPC address and its page's JSON URL."""
    http_port = free_port()
    overrides = [f"protocol.fragments={P}", f"protocol.period={P}", f"protocol.quorum={M}",
                 "protocol.staleness_max=1000", "protocol.lease_s=600"]
    sync = SyncProcess(tmp / f"port-{name}", tmp / f"sync-{name}.log", *extra, init=init, learners=M, tokens=10**15,
                       http_port=http_port, sets=overrides, log_level="warning", timeout_s=900)
    return sync.proc, sync.address, f"http://127.0.0.1:{http_port}/api/status"


def proc_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} for {pid}")


def page_process(sync_pid: int) -> int:
    """The status page's process: the synchronizer's one child."""
    return int(Path(f"/proc/{sync_pid}/task/{sync_pid}/children").read_text().split()[0])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def join_discarding(address: str, name: str) -> Session:
    """Join as ``name``, reading the whole state transfer and keeping none of it."""
    from ddiloco.runtime import wire

    session = None
    with SyncClient(address) as client:
        for reply in client.stub.Join(wire.join_to_pb(Join(name, f"bench-{name}")), timeout=3600,
                                      metadata=client.metadata):
            if reply.HasField("header"):
                session = wire.session_from_pb(reply.header.session)
    assert session is not None
    return session


@dataclass
class Timeline:
    """Resident memory of the synchronizer processes over time, with what happened when."""

    started: float = field(default_factory=time.monotonic)
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds, summed VmRSS, summed VmHWM)"""
    events: list[tuple[float, str]] = field(default_factory=list)
    peaks: dict[int, int] = field(default_factory=dict)
    """Each process's VmHWM as last read."""
    pids: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def now(self) -> float:
        return time.monotonic() - self.started

    def mark(self, what: str) -> None:
        self.events.append((self.now(), what))
        print(f"  {self.now():7.1f}s  {what}", flush=True)

    def sample(self) -> None:
        rss = hwm = 0
        for pid in list(self.pids):
            try:
                rss += proc_field(pid, "VmRSS")
                self.peaks[pid] = proc_field(pid, "VmHWM")
                hwm += self.peaks[pid]
            except (OSError, RuntimeError):
                self.pids.remove(pid)  # exited (or killed): its last peak stays
        self.samples.append((self.now(), rss, hwm))

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.sample()


def _load(addresses: list[str], sizes: list[int], learners: range, warmup_s: float, seconds: float,
          joined: multiprocessing.Barrier, out: multiprocessing.Queue, counted: multiprocessing.Value) -> None:
    """One load-generator process: learners as threads, each its own gRPC channel per shard.

    Each learner sends its fragments in turn, as fast as the synchronizer takes them, under
    the learners' own send rule (``core/learner_side/learner_core.py``): a fragment is not sent again until the
    round of its last send has closed (its version moved on); it goes on with the next one.
    Uploads are pre-serialized (the header chunk is built per call, the payload chunks once)
    so that the generator spends as little CPU as it can: it shares the cores with the
    synchronizers it measures. Base versions are kept current by polling status. The window
    opens once every learner of every generator has joined and a warm-up has passed; merged
    parameters are added to ``counted`` as they are accepted, so the parent can take rates
    over any part of the window.
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
    del payloads
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
        sessions = [join_discarding(a, f"learner-{m}") for a in addresses]
        ready.wait()
        seq = [0] * P
        sent = [-1] * P  # the base version of this learner's last send of each fragment
        p, waiting = m % P, 0
        while not stop.is_set():
            if versions[p] <= sent[p]:  # its round has not closed: the next fragment
                p, waiting = (p + 1) % P, waiting + 1
                if waiting >= P:
                    stop.wait(0.02)
                    waiting = 0
                continue
            waiting = 0
            sent[p] = versions[p]
            shard = p % shards
            header = pb.ContributionHeader(
                learner_id=f"learner-{m}", fragment=p, base_version=sent[p], seq=seq[p], tokens=1024, steps=1,
                compute_s=1e-3, step_time_s=1e-3, codec="int4", payload_bytes=INT4.encoded_size(sizes[p]),
                session=wire.session_to_pb(sessions[shard]))
            seq[p] += 1
            first = pb.ContributionChunk(header=header, offset=0).SerializeToString()
            try:
                upload[shard](iter([first, *bodies[p]]), metadata=client_metadata(None), timeout=600)
                if counting.is_set():
                    with lock:
                        merged[0] += sizes[p]
                    with counted.get_lock():
                        counted.value += sizes[p]
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


@dataclass
class Window:
    params_per_s: float
    """Over the whole window."""
    sync_cores: float
    generator_cores: float
    rss_median: int
    status_ms: list[tuple[float, float, float]]
    """(monotonic time, latency in ms, age of the status in ms) of each call of the status page."""
    loop_status_ms: list[tuple[float, float]]
    """(monotonic time, latency in ms) of each gRPC Status call (answered by the event loop)."""
    clean_params_per_s: float
    """Before the first late join (the whole window without them)."""
    clean_sync_cores: float


def _poll_page(url: str, stop: threading.Event, out: list[tuple[float, float, float]]) -> None:
    """GET ``url`` (the status page's JSON) every 100 ms until ``stop``."""
    while not stop.wait(0.1):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as reply:
            age_s = json.loads(reply.read()).get("age_s", 0.0)
        out.append((time.monotonic(), 1e3 * (time.perf_counter() - started), 1e3 * age_s))


def _poll_loop(address: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """Call the gRPC Status every 100 ms until ``stop``."""
    with SyncClient(address) as client:
        while not stop.wait(0.1):
            started = time.perf_counter()
            client.status_dict(timeout_s=60)
            out.append((time.monotonic(), 1e3 * (time.perf_counter() - started)))


def _poll_status(address: str, page_url: str, stop: multiprocessing.Event, out: multiprocessing.Queue) -> None:
    """Poll the status page and the gRPC Status, each every 100 ms, until ``stop``; put both lists
    of calls in ``out``. A process of its own, so that what the parent does meanwhile (a late
    join's state transfer) takes no GIL from the measurement."""
    halt = threading.Event()
    page: list[tuple[float, float, float]] = []
    loop: list[tuple[float, float]] = []
    pollers = [threading.Thread(target=_poll_page, args=(page_url, halt, page)),
               threading.Thread(target=_poll_loop, args=(address, halt, loop))]
    for th in pollers:
        th.start()
    stop.wait()
    halt.set()
    for th in pollers:
        th.join()
    out.put((page, loop))


def merging_window(addresses: list[str], pids: list[int], sizes: list[int], seconds: float, timeline: Timeline,
                   extra_joins: int, page_url: str) -> Window:
    """Load generators merge for ``seconds`` while status is polled and ``extra_joins`` learners join."""
    ctx = multiprocessing.get_context("spawn")  # a fork of this process (torch, numba threads) can hang
    out, joined, counted = ctx.Queue(), ctx.Barrier(2), ctx.Value("q", 0)
    loaders = [ctx.Process(target=_load, args=(addresses, sizes, range(i, M, 2), max(2.0, seconds / 5), seconds,
                                               joined, out, counted)) for i in range(2)]
    timeline.mark(f"{M} learners join")
    for loader in loaders:
        loader.start()
    for _ in loaders:
        out.get(timeout=3600)
    timeline.mark("merging window opens")
    opened, cpu = time.perf_counter(), sum(cpu_seconds(pid) for pid in pids)
    first_sample = len(timeline.samples)
    stop = threading.Event()
    clean: list[tuple[float, float]] = []  # (params/s, synchronizer cores) before the first late join

    def mark_clean() -> None:
        elapsed = time.perf_counter() - opened
        clean.append((counted.value / elapsed, (sum(cpu_seconds(pid) for pid in pids) - cpu) / elapsed))

    polling = ctx.Event()
    poller = ctx.Process(target=_poll_status, args=(addresses[0], page_url, polling, out), daemon=True)
    poller.start()

    def late_joins() -> None:
        """``extra_joins`` learners join at once, at a third of the window (the window before is
        clean): their state transfers go out side by side while rounds merge."""
        if extra_joins == 0 or stop.wait(seconds / 3):
            return
        mark_clean()

        def join(j: int) -> None:
            timeline.mark(f"join of late-{j} (state transfer) begins")
            for address in addresses:
                join_discarding(address, f"late-{j}")
            timeline.mark(f"join of late-{j} done")

        joins = [threading.Thread(target=join, args=(j,)) for j in range(extra_joins)]
        for th in joins:
            th.start()
        for th in joins:
            th.join()

    helpers = [threading.Thread(target=late_joins, daemon=True)]
    for th in helpers:
        th.start()
    results = [out.get(timeout=3600) for _ in loaders]
    sync_cores = (sum(cpu_seconds(pid) for pid in pids) - cpu) / (time.perf_counter() - opened)
    stop.set()
    polling.set()
    status_ms, loop_status_ms = out.get(timeout=600)
    poller.join(60)
    whole = sum(r for r, _ in results)
    clean_rate, clean_cores = clean[0] if clean else (whole, sync_cores)
    timeline.mark("merging window closes")
    for loader in loaders:
        loader.kill()
        loader.join()
    for th in helpers:
        th.join(600)
    window = [rss for _, rss, _ in timeline.samples[first_sample:]]
    return Window(whole, sync_cores, sum(c for _, c in results), int(statistics.median(window)) if window else 0,
                  status_ms, loop_status_ms, clean_rate, clean_cores)


def watch_checkpoints(address: str, timeline: Timeline, stop: threading.Event) -> None:
    """Mark each checkpoint written (status counts them) on the timeline."""
    seen = 0
    with SyncClient(address) as client:
        while not stop.wait(0.5):
            try:
                written = client.status_dict(timeout_s=60)["checkpoints"]
            except (Unreachable, CallRefused):
                return
            if written > seen:
                timeline.mark(f"checkpoint {written} written")
                seen = written
