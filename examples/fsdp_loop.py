"""The own-loop example (own_loop.py) as one learner sharded over the ranks of an FSDP2 job.

The model is own_loop's byte-level GRU; here ``fully_shard`` spreads its parameters over the
ranks of a ``torchrun`` job, so the learner may be larger than one device. Nothing else changes
for ddiloco's part: ``LearnerRuntime`` sees FSDP2 shards and makes every rank measure, send and
receive its own slice of each fragment. Runs on CPUs with gloo, on GPUs with NCCL::

    python examples/fsdp_loop.py init gru-init.safetensors
    ddiloco sync --init gru-init.safetensors --learners 2 --tokens 2000000
    torchrun --nproc-per-node 2 examples/fsdp_loop.py learner --connect 127.0.0.1:7000 --id island-a
    python examples/own_loop.py learner --connect 127.0.0.1:7000 --id island-b   # an unsharded one beside it

``init`` is own_loop's (same model, same options).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from byte_text import ByteBatches, learner_seed, load_bytes
from own_loop import build_model, build_parser, lm_loss
from roles import run_role
from torch.distributed.fsdp import fully_shard

from ddiloco.runtime.learner.ranks import init_group, leave_group
from ddiloco.runtime.learner.runtime import LearnerRuntime

PROG = "fsdp_loop.py"


def learner(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    init_group("nccl" if cuda else "gloo")  # each torchrun restart in a store of its own (ranks.py says why)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    args.id = args.id or os.environ.get("DDILOCO_LEARNER_ID", "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.id}/{rank} %(levelname)s %(message)s")
    torch.manual_seed(args.seed)  # every rank starts from the same weights (the join replaces them anyway)
    model = build_model(args).to(device)
    fully_shard(model)  # every parameter a Shard(0) DTensor over the job's ranks
    batches = ByteBatches(load_bytes(args.text), batch_size=args.batch_size, seq_len=args.seq_len,
                          seed=learner_seed(f"{args.id}/{rank}", args.seed))  # each rank its own batches
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    token = args.token_file.read_text().strip() if args.token_file else os.environ.get("DDILOCO_TOKEN")
    options = {"join_timeout_s": args.join_timeout, "on_data_position": batches.skip_to}
    runtime = (LearnerRuntime(model, args.connect, args.id, token=token, **options) if args.connect
               else LearnerRuntime.from_env(model, **options))
    steps, loss_sum, started = 0, 0.0, time.monotonic()
    with runtime:
        if rank == 0:
            print(f"{args.id} resuming data at batch {runtime.data_position}", flush=True)
        while not runtime.should_stop and (args.max_steps is None or steps < args.max_steps):
            ids = batches.next().to(device)
            loss = lm_loss(model, ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            runtime.step(tokens=ids.numel())  # this rank's batch; collective: every rank calls it
            steps += 1
            loss_sum += loss.item()
            if rank == 0 and steps % args.log_every == 0:
                print(f"{args.id} step {steps}: loss {loss_sum / args.log_every:.3f} "
                      f"({steps / (time.monotonic() - started):.1f} steps/s)", flush=True)
                loss_sum = 0.0
    print(f"{args.id} rank {rank} done after {steps} steps, sent {runtime.bytes_up} bytes", flush=True)
    leave_group()  # together with the sibling ranks


def main(argv: list[str] | None = None) -> int:
    return run_role(build_parser(PROG, learner), argv)


if __name__ == "__main__":
    sys.exit(main())
