"""A learner sharded over 2 FSDP2 ranks against the same learner unsharded, and against its own loop alone.

    python benchmarks/bench_fsdp.py                       # ~21M-parameter MLP, 5 pairs (minutes on 2 CPU cores)
    python benchmarks/bench_fsdp.py --steps 20 --pairs 5 --json docs/results/fsdp_learner.json
    python benchmarks/bench_fsdp.py --width 3072 --depth 11 --steps 5 --pairs 0 --json docs/results/fsdp_learner_104m.json  # memory, bytes

One ``ddiloco sync --init`` (its own process, 127.0.0.1) serves the model; each learner is a fresh
process (a 2-rank ``torchrun`` job with gloo for the sharded ones). Printed:

1. memory: VmHWM of each training process (the peak resident set, read from /proc at the end; glibc's
   mmap threshold fixed for every process, see ``ENV``), and the same above its resident set once
   the interpreter, torch, gRPC and ddiloco are imported (~340 MiB in every mode: what the model, its
   optimizer, FSDP and ddiloco hold); the target is a sharded rank at <= 0.6 x the unsharded learner.
2. bytes: payload bytes each process uploaded over the same number of steps; target ~1/2 per rank.
3. throughput: the sharded learner's steps/s with ddiloco attached over the same FSDP2 loop alone,
   in pairs whose order alternates; target: per-pair median >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from stamp import load_now, stamp
from torch import nn

HERE = Path(__file__).resolve()
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
"""Every process alike. The fixed mmap threshold: glibc otherwise raises it after each large free (up to
32 MiB), so FSDP's per-layer gathers and frees are kept in a heap it cannot return, and the peak measures
the allocator (FSDP2 alone, 2 ranks of this MLP: 710 MiB above the interpreter with the dynamic threshold,
233 MiB with this one)."""
BATCH = 16
WARMUP_STEPS = 5
"""Steps not timed: the first ones allocate (and the attached learner's first contributions go out)."""


def build(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def memory_kb(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


# ---- one learner process (one rank of a job) -------------------------------------------------


def learner(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard

    from ddiloco.runtime.learner.ranks import init_group, leave_group
    from ddiloco.runtime.learner.runtime import LearnerRuntime

    torch.set_num_threads(1)
    sharded = args.mode in ("sharded", "alone")
    if sharded:
        init_group("gloo")
    baseline_kb = memory_kb("VmRSS")  # the interpreter, torch, gRPC and ddiloco imported: the same in every mode
    if sharded:  # FSDP2's recipe for a model larger than a device: built on no device, sharded, then allocated
        with torch.device("meta"):
            model = build(args.width, args.depth)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)  # one layer's full weights at a time during forward and backward
        fully_shard(model)
        model.to_empty(device="cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()  # each rank its shard (a learner's join then replaces them)
    else:
        model = build(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    runtime = None
    if args.mode != "alone":
        runtime = LearnerRuntime(model, f"127.0.0.1:{args.port}", "bench", tokens_per_step=BATCH)
    joined_kb = memory_kb("VmHWM")
    g = torch.Generator().manual_seed(dist.get_rank() if sharded else 0)
    started = None
    for step in range(args.steps + WARMUP_STEPS):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        x = torch.randn(BATCH, args.width, generator=g)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if runtime is not None:
            runtime.step(tokens=BATCH)
    assert started is not None
    steps_per_s = args.steps / (time.perf_counter() - started)
    helper = runtime.link.calls.helper if runtime is not None else None
    helper_kb = memory_kb("VmHWM", helper.pid) if helper is not None else 0  # the link's process, before it exits
    if runtime is not None:
        runtime.close()  # its flush counts: both kinds of learner send every step they trained
    stats = runtime.stats if runtime is not None else None
    bytes_up, sent = (stats.bytes_up, stats.contributions_sent) if stats is not None else (0, 0)
    # Seconds inside runtime.step per step (its exchange waits for the slowest rank): the runtime's cost
    # to the loop, less sensitive to the machine's load than two runs' steps/s.
    overhead_s = stats.step_overhead_s / stats.steps if stats is not None and stats.steps else 0.0
    result = {"mode": args.mode, "rank": dist.get_rank() if sharded else 0, "steps_per_s": steps_per_s,
              "vmhwm_kb": memory_kb("VmHWM"), "baseline_kb": baseline_kb, "helper_vmhwm_kb": helper_kb,
              "vmhwm_after_join_kb": joined_kb, "bytes_up": bytes_up,
              "contributions_sent": sent, "step_overhead_s": overhead_s, "step_s": 1.0 / steps_per_s}
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    if sharded:
        leave_group()


# ---- the driver ------------------------------------------------------------------------------


def run(args: argparse.Namespace, mode: str, port: int, out: Path) -> list[dict[str, Any]]:
    from ddiloco.testing import free_port

    out.unlink(missing_ok=True)
    learner_args = [str(HERE), "--role", "learner", "--mode", mode, "--port", str(port), "--steps", str(args.steps),
                    "--width", str(args.width), "--depth", str(args.depth), "--out", str(out)]
    if mode == "unsharded":
        cmd = [sys.executable, *learner_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world), "--master-port",
               str(free_port()), *learner_args]
    with open(out.with_suffix(".log"), "ab") as log:
        subprocess.run(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=1800)
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["driver", "learner"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["sharded", "unsharded", "alone"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=1536, help="MLP width (default 1536)")
    parser.add_argument("--depth", type=int, default=9, help="Linear layers (default 9: 21.2M parameters)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per learner process (default 30)")
    parser.add_argument("--pairs", type=int, default=5, help="attached/alone pairs (default 5; 0: memory and bytes only)")
    parser.add_argument("--world", type=int, default=2,
                        help="ranks of the sharded learner (default 2; 1: the link helper has a core to itself here)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.role == "learner":
        learner(args)
        return
    header = stamp(__file__)
    params = args.depth * (args.width * args.width + args.width)
    print(f"MLP {args.depth} x {args.width}: {params / 1e6:.1f}M parameters; load {header['load']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from ddiloco.runtime.learner.runtime import save_initial_state
        from ddiloco.testing import SyncProcess

        save_initial_state(build(args.width, args.depth), work / "init.safetensors")
        sync = SyncProcess(work / "port", work / "sync.log", init=work / "init.safetensors", learners=1,
                           tokens=10**12, state_dir=work / "state", env=ENV, timeout_s=600)
        try:
            port = sync.port
            (plain,) = run(args, "unsharded", port, work / "unsharded.jsonl")
            ranks = run(args, "sharded", port, work / "sharded.jsonl")
            pairs = []
            for i in range(args.pairs):
                order = ("sharded", "alone") if i % 2 == 0 else ("alone", "sharded")
                rates = {mode: statistics.mean(r["steps_per_s"] for r in run(args, mode, port, work / f"{mode}.jsonl"))
                         for mode in order}
                pairs.append(rates["sharded"] / rates["alone"])
                print(f"pair {i + 1}: attached {rates['sharded']:.3f} steps/s, alone {rates['alone']:.3f} steps/s, "
                      f"ratio {pairs[-1]:.3f} (load {load_now()})", flush=True)
        finally:
            sync.stop(60)
    above = [(r["vmhwm_kb"] - r["baseline_kb"]) for r in ranks]
    plain_above = plain["vmhwm_kb"] - plain["baseline_kb"]
    results = {
        **header, "parameters": params, "steps": args.steps, "world": args.world,
        "unsharded": plain, "sharded": ranks,
        "vmhwm_ratio_per_rank": [r["vmhwm_kb"] / plain["vmhwm_kb"] for r in ranks],
        "vmhwm_above_baseline_ratio_per_rank": [a / plain_above for a in above],
        "bytes_ratio_per_rank": [r["bytes_up"] / plain["bytes_up"] for r in ranks],
        # How many contributions a learner sends in a short run varies with timing (a fragment whose last
        # send is unanswered waits and is folded into the next one): per contribution is the like-for-like.
        "bytes_per_contribution_ratio_per_rank": [(r["bytes_up"] / r["contributions_sent"])
                                                  / (plain["bytes_up"] / plain["contributions_sent"]) for r in ranks],
        "throughput_pairs": pairs, "throughput_median": statistics.median(pairs) if pairs else None,
        "load_end": load_now(),
    }
    print(f"VmHWM unsharded {plain['vmhwm_kb'] / 1024:.0f} MiB ({plain_above / 1024:.0f} above its baseline); "
          + "; ".join(f"rank {r['rank']} {r['vmhwm_kb'] / 1024:.0f} MiB ({a / 1024:.0f} above)"
                      for r, a in zip(ranks, above))
          + "; link helpers: unsharded " + f"{plain['helper_vmhwm_kb'] / 1024:.0f} MiB, per rank "
          + ", ".join(f"{r['helper_vmhwm_kb'] / 1024:.0f}" for r in ranks))
    print("VmHWM ratio per rank " + ", ".join(f"{x:.2f}" for x in results["vmhwm_ratio_per_rank"])
          + "; above baseline " + ", ".join(f"{x:.2f}" for x in results["vmhwm_above_baseline_ratio_per_rank"]))
    print(f"bytes up: unsharded {plain['bytes_up']:,}; per rank " + ", ".join(f"{r['bytes_up']:,}" for r in ranks)
          + " (ratio " + ", ".join(f"{x:.2f}" for x in results["bytes_ratio_per_rank"]) + "); contributions sent: "
          + f"unsharded {plain['contributions_sent']}, per rank " + ", ".join(str(r["contributions_sent"]) for r in ranks)
          + "; bytes per contribution, rank / unsharded: "
          + ", ".join(f"{x:.3f}" for x in results["bytes_per_contribution_ratio_per_rank"]))
    if pairs:
        print(f"throughput attached/alone: median {results['throughput_median']:.3f} of {len(pairs)} pairs "
              f"(load at the end {results['load_end']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
