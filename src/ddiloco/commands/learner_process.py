"""The reference learner process (``ddiloco learner``): one learner of a real run.

Its environment (threads, device, ``torch.distributed`` under torchrun with DDP over the
ranks of one learner), the probe for the run's configuration, the workload, and the training
loop around :class:`~ddiloco.runtime.learner.runtime.LearnerRuntime`, with its progress file,
batch log, TensorBoard lines and a clean stop on SIGTERM. The command line is ``commands/learner.py``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ddiloco.core.shared.errors import ConfigError
from ddiloco.outputs.tb_log import EventLog
from ddiloco.runtime.auth import load_secret, load_token, parse_address
from ddiloco.runtime.batch_log import BatchLog
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.layout import LayoutMismatch
from ddiloco.runtime.learner.connect import probe_with_backoff
from ddiloco.runtime.learner.ranks import init_group, leave_group
from ddiloco.runtime.learner.runtime import LearnerRuntime
from ddiloco.runtime.progress import ProgressFile
from ddiloco.settings.config import Config, check_seed
from ddiloco.settings.config_sources import config_of_sync
from ddiloco.workload.corpus import BatchSampler
from ddiloco.workload.device import process_group_backend, resolve_device
from ddiloco.workload.trainer import InnerTrainer
from ddiloco.workload.workload import Workload, weights_sha256

log = logging.getLogger("ddiloco.learner")

LOG_EVERY_S = 5.0
"""A progress line every 50 steps, at most this often: on a fast model a line per 50 steps would
be several a second, and an outage's few lines (``Outage``) would scroll away among them."""


def describe_model(config: Config, model: torch.nn.Module | None = None) -> str:
    """A model's size in the terms of its configuration, for errors that compare two sides."""
    m = config.model
    size = f", {sum(p.numel() for p in model.parameters()):,} parameters" if model is not None else ""
    return f"d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, seq_len {m.seq_len}{size}"


def start_runtime(args: argparse.Namespace, clients: list[SyncClient], model: torch.nn.Module, workload: Workload,
                  sync_config: dict) -> LearnerRuntime:
    """Join the run; a model the synchronizer does not serve is an error naming both sides' models."""
    try:
        return LearnerRuntime(model, clients or None, args.id, join_timeout_s=args.join_timeout,
                              tokens_per_step=workload.tokens_per_step)
    except LayoutMismatch as err:
        raise LayoutMismatch(f"{err}. This learner's model: {describe_model(workload.config, model)}; the "
                             f"synchronizer's run: {describe_model(config_of_sync(sync_config))} (leave out "
                             "--preset to train the synchronizer's model, or give both sides the same preset)") from None


@dataclass(frozen=True)
class Place:
    """Where this process runs: rank ``rank`` of a torchrun job of ``world`` ranks (0 of 1 without
    torchrun), on ``device``. Only rank 0 talks to the synchronizer and writes files."""

    rank: int
    world: int
    device: torch.device


def start_process(args: argparse.Namespace) -> Place:
    """Diagnostics, logging, threads, the device and ``torch.distributed``: everything that must be
    set before the first byte is sent or the first tensor allocated."""
    with contextlib.suppress(AttributeError, ValueError, OSError):  # stderr may not be a file
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.id}" + (f"/{rank}" if rank else "") + " %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(args.device)
    if device.type == "cuda" and device.index is None and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        init_group(process_group_backend(device))
    return Place(rank, world, device)


def probe_run(args: argparse.Namespace, place: Place) -> tuple[list[SyncClient], dict | None, int]:
    """The clients (rank 0's only), the synchronizer's configuration and this learner's data shard.

    Rank 0 probes before joining, holding no lease yet, because building the workload may take
    longer than a lease; the other ranks of a torchrun job receive what it learned."""
    addresses = [parse_address(a.strip(), option="--connect") for a in args.connect.split(",") if a.strip()]
    if not addresses:
        raise ConfigError(f"--connect {args.connect!r}: expected HOST:PORT[,HOST:PORT...]")
    clients: list[SyncClient] = []
    if place.rank == 0 or args.fsdp:  # every rank of a sharded learner talks to the synchronizer itself
        secret = load_secret(args.secret_file)
        token = secret or load_token(args.token_file)
        clients = [SyncClient(a, token=token, tls_ca=args.tls_ca, learner_id=args.id if secret else None)
                   for a in addresses]
    if place.rank == 0:
        probe = probe_with_backoff(clients[0], args.id, timeout_s=args.join_timeout)
        box = [probe.run_config, args.index if args.index is not None else probe.header.data_shard]
    else:
        box = [None, None]
    if place.world > 1:
        dist.broadcast_object_list(box, src=0)
    return clients, box[0], int(box[1])


def log_step(runtime: LearnerRuntime, steps: int, loss: torch.Tensor, events: EventLog | None) -> None:
    """One progress line (and its TensorBoard scalars); reading the loss waits for the step."""
    loss_value = float(loss)
    st = runtime.stats
    log.info("step %d  loss %.3f  versions %s  sent %d  applied %d  backlog %d  dropped %d  "
             "unreachable %d", steps, loss_value, runtime.versions, st.contributions_sent,
             st.updates_applied, runtime.backlog, st.contributions_dropped, st.unreachable)
    if events is not None:
        events.add(steps, {"train_loss": loss_value, "fragment_versions": runtime.versions,
                           "contributions_sent": st.contributions_sent,
                           "updates_applied": st.updates_applied, "backlog": runtime.backlog,
                           "contributions_dropped": st.contributions_dropped,
                           "unreachable": st.unreachable})


def train(args: argparse.Namespace, config: Config, place: Place, runtime: LearnerRuntime, trainer: InnerTrainer,
          sampler: BatchSampler) -> int:
    """Step until the run stops, SIGTERM or ``--max-steps``, keeping the progress file and the log;
    the runtime is closed (its contributions flushed) however the loop ends. Returns the steps taken."""
    steps = 0
    logged_at = time.perf_counter() - LOG_EVERY_S
    progress = ProgressFile(Path(args.progress_file) if place.rank == 0 and args.progress_file else None)
    batches = BatchLog(Path(args.batch_log) if place.rank == 0 and args.batch_log else None, runtime.data_position)
    stop = threading.Event()  # SIGTERM (a launcher, Slurm, systemd): finish the step, flush, leave
    if place.world == 1:  # ranks of one torchrun job could stop at different steps and hang in their all-reduce
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    events = None
    if place.rank == 0 and args.tensorboard_dir:
        events = EventLog(args.tensorboard_dir)
    try:
        while not runtime.should_stop and not stop.is_set() and (args.max_steps is None or steps < args.max_steps):
            step_started = time.perf_counter()
            x, y = sampler.next_batch()
            loss = trainer.step(x, y)
            batches.trained(sampler.batches_drawn - 1)
            if args.min_step_s:
                time.sleep(max(0.0, args.min_step_s - (time.perf_counter() - step_started)))
            runtime.step(tokens=x.numel())
            steps += 1
            if progress.due(steps):
                st = runtime.stats
                progress.write(steps, steps * x.numel(), contributions_sent=st.contributions_sent,
                               updates_applied=st.updates_applied, step_overhead_s=round(st.step_overhead_s, 6))
            if place.rank == 0 and steps % 50 == 0 and time.perf_counter() >= logged_at + LOG_EVERY_S:
                logged_at = time.perf_counter()
                log_step(runtime, steps, loss, events)
    finally:
        batches.close()
        runtime.close()
        progress.write(steps, steps * config.train.batch_size * config.model.seq_len)
        if events is not None:
            events.close()
    return steps


def run(args: argparse.Namespace, resolve_config: Callable[[dict], Config]) -> int:
    """Train as learner ``args.id``; ``resolve_config`` turns the synchronizer's configuration into
    this learner's (the command line's workload options, if any, checked against it)."""
    if args.seed is not None:
        check_seed(args.seed, "--seed")  # before waiting for a synchronizer, not after it answers
    place = start_process(args)
    clients, sync_config, index = probe_run(args, place)
    config = resolve_config(sync_config).validate_for_processes()
    if not args.threads and config.train.threads:
        torch.set_num_threads(config.train.threads)
    if not 0 <= index < config.run.learners:
        raise ConfigError(f"--index {index} is not in [0, {config.run.learners}) (the run has M={config.run.learners})")
    workload = Workload.build(config, place.device)
    model = workload.new_model()
    trained = model
    if place.world > 1 and args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in getattr(model, "blocks", ()):
            fully_shard(block)  # one block's full weights at a time
        fully_shard(model)  # LearnerRuntime then makes each rank send its own slices (runtime/learner/fsdp/fsdp_runtime.py)
    elif place.world > 1:
        trained = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[place.device] if place.device.type == "cuda" else None)
    trainer = workload.new_trainer(trained)
    sampler = workload.sampler(index, place.rank)
    runtime = start_runtime(args, clients, model, workload, sync_config=sync_config)
    if runtime.should_stop:  # the synchronizer refused our join: the run is over
        log.info("the run is already finished")
        runtime.close(flush=False)
        return 0
    log.info("training as learner %s (data shard %d of %d, %d parameters, on %s)", args.id, index,
             config.run.learners, sum(p.numel() for p in model.parameters()), place.device)
    sampler.skip_to(runtime.data_position)
    if place.rank == 0:
        log.info("resuming data at batch %d (every batch before it reached the global model)" if runtime.data_position
                 else "data from batch %d (none of this learner's batches reached the global model yet)",
                 runtime.data_position)
    started = time.perf_counter()
    steps = train(args, config, place, runtime, trainer, sampler)
    elapsed = time.perf_counter() - started
    if place.rank == 0:
        s = runtime.stats
        log.info("done: %d steps in %.1fs; %d contributions sent, %d updates applied, %d joins, rejected %s%s%s",
                 steps, elapsed, s.contributions_sent, s.updates_applied, s.joins,
                 ", ".join(f"{reason} {n}" for reason, n in sorted(s.rejected.items())) or "none",
                 f"; {s.answers_lost} answers lost after the merge (the updates said so)" if s.answers_lost else "",
                 f"; the last flush left out {s.steps_unsent} steps (fragments still awaiting the update of "
                 "their last send: sent, they would carry its work twice)" if s.steps_unsent else "")
    if place.world > 1:
        if not args.fsdp:  # a sharded model's ranks hold different slices
            log.info("rank %d of %d: weights sha256 %s", place.rank, place.world, weights_sha256(model))
        leave_group()
    return 0
