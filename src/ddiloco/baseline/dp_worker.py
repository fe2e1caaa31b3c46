"""One rank of real data parallel: the baseline Decoupled DiLoCo is compared with on the same links.

``ddiloco run --runtime processes --mode dp`` starts one of these per learner (``python -m
ddiloco.baseline.dp_worker``), each where that learner would run (its own network
namespace with ``--hosts netns``). They train the same model from the same initial weights
on the same data shards as the learners (rank r draws learner r's batches), and
all-reduce every step's gradients with ``torch.distributed`` (gloo) through
``DistributedDataParallel``, in bf16 as the bandwidth model assumes (``dp_bits`` = 16),
in buckets small enough that the all-reduce overlaps the backward pass as it does for a
large model. One failure stops everyone: that is data parallel.

The ranks stop together: after every step they agree (an all-reduce of one flag) whether
the budget is spent or any of them was asked to stop (SIGTERM). Rank 0 evaluates the
model at the same points of the budget as the other runtimes, keeps its step count in a
progress file (:mod:`ddiloco.runtime.progress`), and at the end writes the final
checkpoint (model and optimizer, atomically) and ``dp-result.json`` for the launcher.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the real classes.

import argparse
import datetime
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddiloco.measures.wire_bytes import BF16_BYTES, all_reduce_bytes
from ddiloco.runtime.learner.ranks import leave_group
from ddiloco.runtime.progress import ProgressFile
from ddiloco.settings.config import Config
from ddiloco.settings.config_sources import build_config
from ddiloco.workload.checkpoint import save_checkpoint
from ddiloco.workload.device import resolve_device
from ddiloco.workload.workload import Workload, weights_sha256

log = logging.getLogger("ddiloco.dp")

BUCKETS = 8
"""Gradient buckets per step: the all-reduce of the first starts while the backward pass computes the rest."""
INIT_TIMEOUT = datetime.timedelta(minutes=10)
RESULT_FILE = "dp-result.json"
METRICS_FILE = "dp-metrics.jsonl"
CHECKPOINT = Path("dp-state") / "dp.safetensors"


class CommTimer:
    """The state of :func:`bf16_allreduce`: the world size, and how long backward waited for the all-reduce.

    ``waited_s`` adds, per step, the time from the last bucket's launch to its result: the
    part of the all-reduce the backward pass could not hide.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.waited_s = 0.0


def bf16_allreduce(state: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: all-reduce each bucket in bf16 (PyTorch's own ``bf16_compress_hook``
    refuses gloo by name; gloo reduces bf16 fine)."""
    grads = bucket.buffer()
    compressed = grads.to(torch.bfloat16).div_(state.world)
    launched = time.perf_counter()
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def done(fut: torch.futures.Future) -> torch.Tensor:
        if bucket.is_last():
            state.waited_s += time.perf_counter() - launched
        grads.copy_(fut.value()[0])
        return grads

    return future.then(done)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddiloco.baseline.dp_worker", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's resolved configuration (TOML)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True, metavar="HOST:PORT", help="rank 0's rendezvous address")
    parser.add_argument("--out", required=True, help="the run's directory (progress, metrics, checkpoint)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ifname", help="network interface gloo uses (GLOO_SOCKET_IFNAME)")
    parser.add_argument("--epoch", type=float, default=None,
                        help="the launch's wall-clock time: metrics rows count seconds from it (default: now)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> NoReturn:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.epoch is None:
        args.epoch = time.time()
    logging.basicConfig(level="INFO", format=f"%(asctime)s dp/{args.rank} %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    torch.set_num_threads(args.threads)
    config = build_config(config_file=args.config)
    world = config.run.learners
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=world,
                            timeout=INIT_TIMEOUT)
    code = _train(config, args, stop, world)  # raises: a traceback, exit code 1, the launcher stops the run
    leave_group()
    # What is left to tear down is C++ (gloo's threads, torch's statics): exit without the interpreter's
    # finalization, which has crashed a finished rank before (see leave_group); every file is written.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train(config: Config, args: argparse.Namespace, stop: threading.Event, world: int) -> int:
    out = Path(args.out)
    rank = args.rank
    workload = Workload.build(config, resolve_device(args.device))
    model = workload.new_model()
    numel = sum(p.numel() for p in model.parameters())
    bucket_mb = max(0.01, numel * 4 / BUCKETS / 2**20)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    hook = CommTimer(world)
    ddp.register_comm_hook(hook, bf16_allreduce)
    trainer = workload.new_trainer(ddp)
    sampler = workload.sampler(rank)
    tokens_per_step = workload.tokens_per_step * world
    total_steps = math.ceil(config.run.tokens / tokens_per_step) if config.run.tokens else None
    payload = all_reduce_bytes(numel, world)  # per rank, step and direction
    progress = ProgressFile(out / "progress" / f"learner-{rank}.json")
    evaluator = _Evaluator(config, workload, model, out / METRICS_FILE, args.epoch) if rank == 0 else None
    log.info("rank %d of %d: %d parameters, %d-way bf16 all-reduce of %.2f MB per step", rank, world, numel,
             world, numel * BF16_BYTES / 1e6)
    steps, busy_s, started = 0, 0.0, None
    if evaluator is not None:
        evaluator.record(0, 0.0, 0.0)
    while True:
        step_started = time.perf_counter()
        waited = hook.waited_s
        x, y = sampler.next_batch()
        trainer.step(x, y)
        steps += 1
        started = started or step_started
        elapsed = time.perf_counter() - started
        busy_s += time.perf_counter() - step_started - (hook.waited_s - waited)
        spent = (total_steps is not None and steps >= total_steps) or bool(config.run.time_s and
                                                                           elapsed >= config.run.time_s)
        flag = torch.tensor([int(bool(spent) or stop.is_set())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if progress.due(steps) or flag.item():
            progress.write(steps, steps * workload.tokens_per_step, waited_s=round(hook.waited_s, 3))
        fraction = steps / total_steps if total_steps else elapsed / config.run.time_s
        if evaluator is not None and (flag.item() or evaluator.due(fraction)):
            evaluator.record(steps, busy_s / max(elapsed, 1e-9), payload * steps)
        if flag.item():
            break
    if rank == 0:
        trainer_state = trainer.optimizer.state_dict()
        save_checkpoint(out / CHECKPOINT, {
            "model": dict(model.state_dict()), "steps": steps,
            "optimizer": {"state": {str(k): {name: t.item() if t.dim() == 0 else t for name, t in v.items()}
                                    for k, v in trainer_state["state"].items()},
                          "param_groups": trainer_state["param_groups"]}})
        result = {"final": evaluator.rows[-1], "weights_sha256": weights_sha256(model), "steps": steps,
                  "stopped": stop.is_set(), "comm_wait_s": round(hook.waited_s, 3), "wall_s": round(elapsed, 3)}
        tmp = out / f".{RESULT_FILE}.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out / RESULT_FILE)
    log.info("rank %d: done, %d steps in %.1fs (%.1fs waiting for the all-reduce)", rank, steps, elapsed,
             hook.waited_s)
    return 0


class _Evaluator:
    """Rank 0's metrics rows, at the same fractions of the budget as the other runtimes."""

    def __init__(self, config: Config, workload: Workload, model: torch.nn.Module, path: Path, epoch: float) -> None:
        self.config = config
        self.workload = workload
        self.model = model
        self.path = path
        self.world = config.run.learners
        self.epoch = epoch
        self.rows: list[dict[str, Any]] = []

    def due(self, fraction: float) -> bool:
        done = len(self.rows)
        return done < self.config.train.evals and fraction >= done / self.config.train.evals

    def record(self, steps: int, goodput: float, payload_bytes: float) -> None:
        """A row after ``steps`` steps: ``goodput`` is the share of wall time spent computing, not
        waiting for the all-reduce; ``payload_bytes`` what each rank sent (and received) so far."""
        total_bytes = int(payload_bytes * self.world)
        row = {"virtual_time_s": round(time.time() - self.epoch, 3),
               "tokens": steps * self.workload.tokens_per_step * self.world,
               "eval_loss": self.workload.evaluate(self.model), "goodput": min(1.0, goodput) if steps else 0.0,
               "uptime": 1.0, "bytes_up": total_bytes, "bytes_down": total_bytes,
               "fragment_versions": [steps], "alive": self.world}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
