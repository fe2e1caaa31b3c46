"""Benchmarks of the real runtime, each printed as a ratio against its reference.

    python benchmarks/bench_runtime.py            # everything (a few minutes on 2 CPU cores)
    python benchmarks/bench_runtime.py --only upload,wire
    python benchmarks/bench_runtime.py --only throughput --device cuda [--precision bf16]
    python benchmarks/bench_runtime.py --only profile [--model large]   # the training thread's profile
    python benchmarks/bench_runtime.py --only throughput --model dispatch --repeats 5 --json docs/results/learner_tax_dispatch.json

1. learner throughput: the same training loop with a synchronizer attached (LearnerRuntime,
   synchronizer in its own CPU process on 127.0.0.1) and alone, each measurement in a fresh
   process, in pairs whose order alternates; target per-pair median >= 0.98 (``--device cuda``:
   the learner's model and AdamW on the GPU, a ~32M-parameter model; the loop reads no loss, so
   a runtime that synchronized the device would cost the queue the GPU runs ahead on). Also
   printed: how long the training thread was blocked per step (waiting for the interpreter
   lock, which the learner's threads take from it: ``thread_schedstat``), its wait for a CPU
   (the machine's load), and its time inside ``runtime.step``. ``--model dispatch`` is the CPU
   model whose steps are Python dispatch, as a GPU step is.
2. upload: fragment upload throughput over loopback (chunked client stream), for a payload
   rejected after assembly (transport only) and for an accepted one (plus validation, merge
   and broadcast).
3. merge: one synchronizer round of M contributions (decode, validate, RDA merge, outer
   step, downlink encode) against a plain memory copy of the same fp32 bytes.
4. wire: bytes on the wire per parameter per synchronization, measured by the service on a
   real run, against the codec's exact payload size.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from stamp import load_now, stamp

from ddiloco.commands.options import add_device_option
from ddiloco.core.shared.actions import RoundClosed
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.messages import Contribution, Join, Session
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.runtime.client import CallRefused, SyncClient, Unreachable
from ddiloco.runtime.layout import reference_layout
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import SyncProcess
from ddiloco.workload.device import resolve_device
from ddiloco.workload.trainer import Precision
from ddiloco.workload.workload import Workload

SMALL = ("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "train.batch_size=8",
         "run.learners=1", "protocol.fragments=4", "protocol.period=8")
"""A model of ~0.22M parameters: steps of ~20 ms on one CPU thread (the worst case for overhead)."""
MEDIUM = ("model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "train.batch_size=16",
          "run.learners=1", "protocol.fragments=4", "protocol.period=8")
"""~0.8M parameters: steps of ~100 ms on one CPU thread."""
LARGE = ("model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "train.batch_size=16",
         "run.learners=1", "protocol.fragments=4", "protocol.period=8")
"""~3.2M parameters, 4x ``MEDIUM``: steps of ~400 ms on one CPU thread (fragments 4x larger, same step count)."""
BIG = ("model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.seq_len=64", "run.learners=1",
       "protocol.fragments=4", "protocol.period=8")
"""~13M parameters: fragments of ~3M parameters (12 MB in fp32) for the transport benchmarks."""
GPU = ("model.d_model=512", "model.n_layers=10", "model.n_heads=8", "model.seq_len=256", "train.batch_size=32",
       "run.learners=1", "protocol.fragments=4", "protocol.period=12")
"""~32M parameters, 8192 tokens a step: the throughput benchmark on a GPU (the protocol's default P and H)."""
DISPATCH = ("model.d_model=32", "model.n_layers=16", "model.n_heads=4", "model.seq_len=16", "train.batch_size=4",
            "run.learners=1", "protocol.fragments=4", "protocol.period=8")
"""~0.21M parameters in 16 layers of tiny matrices: steps of ~30 ms on one CPU thread made of thousands of small
ops, dominated by Python dispatch as a GPU step is (its host thread only launches kernels): here a learner that
takes the interpreter lock from the training thread shows, on any machine."""
GPU100M = ("model.d_model=768", "model.n_layers=16", "model.n_heads=12", "model.seq_len=256", "train.batch_size=16",
           "run.learners=1", "protocol.fragments=4", "protocol.period=12", "protocol.codec=int4",
           "protocol.downlink_codec=int4")
"""~113M parameters, int4 both ways: the issue's >= 100M-parameter check on a GPU (``scripts/gpu_check.sh``)."""
MODELS = {"dispatch": DISPATCH, "small": SMALL, "medium": MEDIUM, "large": LARGE, "gpu": GPU, "gpu100m": GPU100M}


def start_sync(overrides: tuple[str, ...]) -> SyncProcess:
    """``ddiloco sync`` of the tiny preset with ``overrides`` on a free loopback port, for a ``with`` block."""
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    return SyncProcess(work / "port", work / "sync.log", tokens=10**12, log_level="warning", sets=overrides,
                       timeout_s=120)


def _wait_for_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop(workload: Workload, steps: int, runtime_address: str | None, learner_id: str,
          profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """Steps per second of the reference training loop (after 20 warm-up steps), and how long the
    training thread was blocked per step (``thread_blocked_s``); ``profile`` records the timed steps
    (on this thread only: the training thread)."""
    model = workload.new_model()
    trainer = workload.new_trainer(model)
    sampler = workload.sampler(0)
    runtime = LearnerRuntime(model, runtime_address, learner_id) if runtime_address else None
    for _ in range(20):
        x, y = sampler.next_batch()
        trainer.step(x, y)
        if runtime:
            runtime.step(x.numel())
    _wait_for_device(workload.device)
    overhead_before = runtime.stats.step_overhead_s if runtime else 0.0
    if profile:
        profile.enable()
    started, sched = time.perf_counter(), thread_schedstat()
    for _ in range(steps):
        x, y = sampler.next_batch()
        trainer.step(x, y)
        if runtime:
            runtime.step(x.numel())
    _wait_for_device(workload.device)
    if profile:
        profile.disable()
    elapsed, sched_end = time.perf_counter() - started, thread_schedstat()
    figures: dict[str, Any] = {"steps_per_s": steps / elapsed}
    if sched is not None and sched_end is not None:
        cpu_s, queued_s = sched_end[0] - sched[0], sched_end[1] - sched[1]
        figures |= {"blocked_ms_per_step": 1e3 * max(0.0, elapsed - cpu_s - queued_s) / steps,
                    "queued_ms_per_step": 1e3 * queued_s / steps}
    if runtime:
        runtime.close()
        s = runtime.stats
        figures |= {"sent": s.contributions_sent, "applied": s.updates_applied,
                    "overhead_ms_per_step": 1e3 * (s.step_overhead_s - overhead_before) / steps}
    return figures


def thread_schedstat() -> tuple[float, float] | None:
    """This thread's seconds on a CPU and waiting for one (runnable), from Linux's schedstat; None elsewhere.

    The rest of the wall time the thread was *blocked*: asleep, not runnable. A training loop with
    one torch thread does no I/O and never sleeps, so its blocked time is the time it waited for
    the interpreter lock (CPython parks a thread that waits for it on a condition variable) or for
    the runtime's lock: what the learner's other threads take from it. Waiting for a CPU is not
    counted there (that is the machine's load, reported beside it)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu_ns, queued_ns, _ = f.read().split()
    except OSError:
        return None
    return int(on_cpu_ns) / 1e9, int(queued_ns) / 1e9


def _one(args: argparse.Namespace, overrides: tuple[str, ...], device: torch.device) -> None:
    """One measurement in this fresh process (``--one``): a JSON line for :func:`bench_throughput`."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    workload = Workload.build(build_config(preset="tiny", overrides=overrides), device)
    attached = args.one == "attached"
    figures = _loop(workload, args.steps, args.address if attached else None, args.id)
    print(json.dumps(figures))


def _fresh(args: argparse.Namespace, which: str, address: str, learner_id: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", which, "--model", args.model, "--steps", str(args.steps),
               "--device", args.device, "--precision", args.precision, "--address", address, "--id", learner_id]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{which} measurement failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_throughput(args: argparse.Namespace, overrides: tuple[str, ...], device: torch.device) -> dict[str, Any]:
    """The loop alone and attached, each in a fresh process, in pairs whose order alternates (so that
    a drift of the machine's load hits both alike); prints the per-pair ratios and returns every figure."""
    config = build_config(preset="tiny", overrides=overrides)
    alone: list[dict[str, Any]] = []
    attached: list[dict[str, Any]] = []
    with start_sync(overrides) as sync:
        for r in range(args.repeats):
            for which in (("alone", "attached") if r % 2 == 0 else ("attached", "alone")):
                figures = _fresh(args, which, sync.address, f"bench-{r}")
                (alone if which == "alone" else attached).append(figures)
                print(f"  pair {r} {which}: {json.dumps(figures)}", flush=True)  # kept if a timeout cuts the run
    pairs = [t["steps_per_s"] / s["steps_per_s"] for s, t in zip(alone, attached)]
    med = statistics.median
    rate = med(s["steps_per_s"] for s in alone)
    blocked = {k: med(f.get("blocked_ms_per_step", float("nan")) for f in runs)
               for k, runs in (("alone", alone), ("attached", attached))}
    queued = {k: med(f.get("queued_ms_per_step", float("nan")) for f in runs)
              for k, runs in (("alone", alone), ("attached", attached))}
    params = sum(p.numel() for p in Workload.build(config, device).new_model().parameters())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, 1 thread"
    target = 0.98
    last = attached[-1]
    print(f"[throughput] {args.model}, {where}, {config.train.precision}: {params / 1e6:.2f}M params, "
          f"{args.steps} steps, {args.repeats} pairs of fresh processes: alone {rate:.2f} steps/s "
          f"({1e3 / rate:.1f} ms), attached/alone per pair median {med(pairs):.3f} (target >= {target}), "
          f"pairs {' '.join(f'{p:.3f}' for p in pairs)}; training thread blocked (GIL or lock waits) "
          f"{blocked['attached']:.2f} ms/step attached ({blocked['attached'] * rate / 1e3:.1%} of a step), "
          f"{blocked['alone']:.2f} alone; waiting for a CPU {queued['attached']:.2f} / {queued['alone']:.2f} ms; "
          f"inside runtime.step {last['overhead_ms_per_step']:.2f} ms/step; {last['sent']} contributions sent, "
          f"{last['applied']} updates applied (last run); load {load_now()}")
    return {"model": args.model, "device": where, "precision": config.train.precision, "params": params,
            "steps": args.steps, "pairs": args.repeats, "alone": alone, "attached": attached,
            "per_pair_ratios": pairs, "per_pair_median": med(pairs), "per_pair_range": [min(pairs), max(pairs)],
            "blocked_ms_per_step": blocked, "queued_ms_per_step": queued, "target": target}


def profile_training_thread(steps: int, overrides: tuple[str, ...], device: torch.device) -> None:
    """Where the training thread's time goes with a synchronizer attached (cProfile of that thread):
    the inner step, ``runtime.step`` and the protocol's functions under it, in ms per step."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    workload = Workload.build(build_config(preset="tiny", overrides=overrides), device)
    profile = cProfile.Profile()
    with start_sync(overrides) as sync:
        _loop(workload, steps, sync.address, "bench-profile", profile)
    rows = []
    for (path, line, name), (_, calls, own_s, total_s, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        where = path.replace(os.sep, "/")
        if "/ddiloco/" in where and ("/core/" in where or "/runtime/learner/" in where or name == "step"):
            rows.append((total_s, own_s, calls, f"{where.split('/ddiloco/')[-1]}:{line}({name})"))
    print(f"[profile] training thread, {steps} steps with a synchronizer attached (ms per step: cumulative, own; calls):")
    for total_s, own_s, calls, what in sorted(rows, reverse=True)[:16]:
        print(f"  {1e3 * total_s / steps:8.3f} {1e3 * own_s / steps:8.3f} {calls:6d}  {what}")


def _contribution(learner: str, session: Session, fragment: int, numel: int, codec: str, seq: int,
                  base_version: int) -> Contribution:
    payload = get_codec(codec).encode(torch.randn(numel) * 1e-3)
    return Contribution(learner_id=learner, session=session, fragment=fragment, base_version=base_version, seq=seq,
                        tokens=512, steps=1, compute_s=0.1, step_time_s=0.1, codec=codec, payload=payload)


def bench_upload(repeats: int) -> None:
    overrides = BIG + ("protocol.codec=fp32",)
    config = build_config(preset="tiny", overrides=overrides)
    frag = max(reference_layout(config, config.protocol).plan.fragments, key=lambda f: f.numel)
    with start_sync(overrides) as sync, SyncClient(sync.address) as client:
        session = client.join(Join("bench", "bench")).state.session
        version = 0
        transport, accepted = [], []
        for i in range(repeats):
            # A base version from the future is refused after the whole upload is assembled,
            # before decoding: this times the transport alone.
            c = _contribution("bench", session, frag.index, frag.numel, "fp32", 10_000 + i, version + 1)
            started = time.perf_counter()
            try:
                client.contribute(c)
            except CallRefused as err:
                assert err.reason == "future_version", err
            transport.append(time.perf_counter() - started)
            c = _contribution("bench", session, frag.index, frag.numel, "fp32", i, version)
            started = time.perf_counter()
            client.contribute(c)
            accepted.append(time.perf_counter() - started)
            version += 1  # the only live learner contributed: its round closed
        size = len(c.payload)
    t, a = min(transport), min(accepted)  # best of: interference only slows a run down
    print(f"[upload] fragment {frag.index}: {frag.numel / 1e6:.2f}M params, {size / 1e6:.1f} MB fp32 payload: "
          f"transport {size / t / 1e6:.0f} MB/s ({t * 1e3:.0f} ms); accepted with merge + broadcast "
          f"{size / a / 1e6:.0f} MB/s ({a * 1e3:.0f} ms) -> merge share {1 - t / a:.0%}")


def bench_merge(learners: int, repeats: int) -> None:
    torch.set_num_threads(1)
    config = build_config(preset="tiny", overrides=BIG)
    layout = reference_layout(config, config.protocol)
    frag = max(layout.plan.fragments, key=lambda f: f.numel)
    protocol = config.protocol
    codec = protocol.codec
    payloads = [get_codec(codec).encode(torch.randn(frag.numel) * 1e-3) for _ in range(learners)]
    rounds, copies = [], []
    for r in range(repeats):
        sync = Synchronizer(protocol, layout.initial_values, embedding_fragments=[])
        names = [f"l{m}" for m in range(learners)]
        sessions = [sync.handle(Join(name, name), 0.0)[0].state.session for name in names]
        started = time.perf_counter()
        for m, name in enumerate(names):
            actions = sync.handle(Contribution(learner_id=name, session=sessions[m], fragment=frag.index,
                                               base_version=0, seq=0, tokens=512, steps=1, compute_s=0.1,
                                               step_time_s=0.1, codec=codec, payload=payloads[m]), 1.0)
        rounds.append(time.perf_counter() - started)
        assert any(isinstance(a, RoundClosed) for a in actions), "the round closes when every live learner came"
        src = torch.randn(learners * frag.numel)
        dst = torch.empty_like(src)
        started = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - started)
    fp32_bytes = learners * frag.numel * 4
    t, c = min(rounds), min(copies)
    print(f"[merge] M={learners}, {frag.numel / 1e6:.2f}M params ({codec} uplink/downlink): round {t * 1e3:.0f} ms = "
          f"{fp32_bytes / t / 1e9:.2f} GB/s of fp32 outer gradients; memcpy of the same {fp32_bytes / 1e6:.0f} MB "
          f"{c * 1e3:.1f} ms = {fp32_bytes / c / 1e9:.2f} GB/s -> ratio {c / t:.3f} of memcpy speed")


def bench_wire(steps: int) -> None:
    torch.set_num_threads(1)
    config = build_config(preset="tiny", overrides=SMALL)
    workload = Workload.build(config)
    protocol = config.protocol
    with start_sync(SMALL) as sync, SyncClient(sync.address) as client:
        model = workload.new_model()
        runtime = LearnerRuntime(model, sync.address, "learner-0")
        joined = client.status_dict()
        trainer, sampler = workload.new_trainer(model), workload.sampler(0)
        for _ in range(steps):
            x, y = sampler.next_batch()
            trainer.step(x, y)
            runtime.step(x.numel())
        runtime.close()
        final = client.status_dict()
    up_codec = get_codec(protocol.codec, block_size=protocol.block_size)
    down_codec = get_codec(protocol.downlink_codec, block_size=protocol.block_size)
    lines = []
    for before, after in zip(joined["fragments"], final["fragments"]):
        n, syncs = after["numel"], after["version"]
        up = (after["bytes_up"] - before["bytes_up"]) / syncs / n
        down = (after["bytes_down"] - before["bytes_down"]) / syncs / n
        exact_up, exact_down = up_codec.encoded_size(n) / n, down_codec.encoded_size(n) / n
        lines.append(f"  fragment {after['id']}: {n:>7} params, {syncs} syncs: up {up:.4f} B/param "
                     f"({protocol.codec} exact {exact_up:.4f}, ratio {up / exact_up:.3f}); down {down:.4f} B/param "
                     f"({protocol.downlink_codec} exact {exact_down:.4f}, ratio {down / exact_down:.3f})")
    print(f"[wire] bytes on the wire per parameter per synchronization, one learner, {steps} steps "
          "(protobuf headers and gRPC framing included, HTTP/2 frames not):")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="throughput,upload,merge,wire")
    parser.add_argument("--steps", type=int, default=100, help="training steps per throughput measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=tuple(MODELS), default=None,
                        help="model of the throughput benchmark (dispatch: ~30 ms CPU steps of tiny ops, small: ~20 ms CPU steps, medium: ~100 ms, large: ~400 ms; "
                             "gpu: ~32M parameters); default medium on the CPU, gpu on a GPU")
    add_device_option(parser)
    parser.add_argument("--precision", choices=[p.value for p in Precision], default="fp32", help="train.precision of the learner")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the throughput figures, stamped, to PATH")
    parser.add_argument("--one", choices=("alone", "attached"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--id", default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()
    chosen = set(args.only.split(","))
    if args.json and "throughput" not in chosen:
        parser.error("--json records the throughput benchmark: add throughput to --only")
    stamped = stamp(__file__)
    try:
        device = resolve_device(args.device)
        model = args.model = args.model or ("medium" if device.type == "cpu" else "gpu")
        overrides = MODELS[model] + (f"train.precision={args.precision}",)
        if args.one:
            _one(args, overrides, device)
            return
        if "profile" in chosen:
            profile_training_thread(args.steps, overrides, device)
        if "throughput" in chosen:
            figures = bench_throughput(args, overrides, device)
            if args.json:
                Path(args.json).write_text(json.dumps({**stamped, "model": model, "throughput": figures,
                                                       "load_at_end": load_now()}, indent=2) + "\n")
        if "upload" in chosen:
            bench_upload(args.repeats)
        if "merge" in chosen:
            bench_merge(4, args.repeats)
        if "wire" in chosen:
            bench_wire(200)
    except (Unreachable, CallRefused) as err:
        sys.exit(f"benchmark failed talking to the synchronizer: {err}")
    except ConfigError as err:
        print(f"bench_runtime: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
