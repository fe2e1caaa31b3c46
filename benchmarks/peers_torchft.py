"""torchft's side of ``bench_peers.py``: its Lighthouse, and one replica group per process.

    python benchmarks/peers_torchft.py lighthouse --port-file F
    python benchmarks/peers_torchft.py replica --kind diloco --index 0 --lighthouse ADDR --config C --out DIR

A replica trains ddiloco's reference workload (``ddiloco.workload``: the same model, initial
weights, per-learner data shard and inner AdamW as a ``ddiloco learner``) under torchft 0.2.0:
``Manager`` over ``ProcessGroupGloo`` with a ``TCPStore`` of its own (a replica group of one
process), wrapped either in ``torchft.local_sgd.DiLoCo`` (streaming DiLoCo: the run's fragments,
H as ``sync_every``, τ as ``fragment_sync_delay``, α as ``fragment_update_alpha``, an outer
Nesterov SGD per fragment) or in torchft's fault-tolerant DDP (``DistributedDataParallel`` and
``OptimizerWrapper``). torchft is used as its own examples use it; nothing of it is patched:
the replica only wraps ``should_commit`` and ``allreduce`` to write down what they did.

What a replica writes, for the harness to read (the same kinds of files a ``ddiloco learner``
writes, so one harness reads both): its batch log (``runtime/batch_log.py``: every batch it
trained, which kill -9 does not lose), its progress file (``runtime/progress.py``) with the
batches whose work reached the global model (``merged``) and the bytes it sent, a line per
committed outer step in ``commits-<i>.log`` (the commit stall), and now and then the global
model (``global-<i>.pt``, the fragments' committed values) for the eval-loss curve.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ddiloco.runtime.batch_log import BatchLog, read_batch_log
from ddiloco.runtime.layout import reference_layout
from ddiloco.runtime.progress import ProgressFile
from ddiloco.settings.config_sources import build_config
from ddiloco.workload.corpus import BatchSampler
from ddiloco.workload.trainer import InnerTrainer
from ddiloco.workload.workload import Workload

MIN_REPLICAS = 1
"""Lighthouse and Manager: a quorum may be one replica group, so survivors train on while a peer is
down (torchft's README runs its Lighthouse with ``--min_replicas 1``); 2 would stop everyone."""
JOIN_TIMEOUT_MS = 10_000
"""How long the Lighthouse waits for every healthy replica to ask before it forms a quorum without
the others (the README's ``--join_timeout_ms 10000``)."""
QUORUM_TICK_MS = 100
"""How often the Lighthouse looks for a quorum (the README's ``--quorum_tick_ms 100``)."""
TIMEOUT_S = 10.0
"""Collectives, ``should_commit`` and the heal's checkpoint transfer (torchft's own examples use 10 s):
long enough for a step on a loaded 2-core machine, short enough that a dead peer costs seconds."""
QUORUM_TIMEOUT_S = 60.0
"""How long a replica waits for a quorum: torchft's default; the Lighthouse forms one within its
join timeout, so it is never reached while one replica group lives."""
SNAPSHOT_EVERY_S = 2.0
"""The global model is written at most this often (the harness's eval-loss curve)."""


class Kind(enum.StrEnum):
    DILOCO = "diloco"
    DDP = "ddp"


def lighthouse(port_file: Path) -> int:
    """Serve a Lighthouse until killed; its address goes to ``port_file``."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=MIN_REPLICAS, join_timeout_ms=JOIN_TIMEOUT_MS,
                              quorum_tick_ms=QUORUM_TICK_MS)
    tmp = port_file.with_name(f".{port_file.name}.tmp")
    tmp.write_text(server.address())
    os.replace(tmp, port_file)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


class _Fragment(nn.Module):
    """One of the run's fragments (``reference_layout``) as the module torchft's DiLoCo syncs."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


class _Ledger:
    """This process's batches and which of them reached the global model.

    A batch counts as merged once every fragment's work on it was committed (the rule ddiloco's
    ``data_position`` follows): a sync that commits covers the fragment's batches since its previous
    sync in this process; one that does not, or a heal (the peer's state replaces ours), loses them.
    """

    def __init__(self, fragments: int, resumed_at: int) -> None:
        self.resumed_at = resumed_at
        self.trained = 0
        self.since = [0] * fragments
        self.covered = [bytearray() for _ in range(fragments)]
        self.bytes_sent = 0.0
        self.commits = 0
        self.failed_commits = 0

    def step(self) -> None:
        self.trained += 1
        for c in self.covered:
            c.append(0)

    def synced(self, fragment: int, committed: bool) -> None:
        if committed:
            for b in range(self.since[fragment], self.trained):
                self.covered[fragment][b] = 1
        self.since[fragment] = self.trained

    def healed(self) -> None:
        self.since = [self.trained] * len(self.since)

    @property
    def merged(self) -> int:
        return sum(1 for b in range(self.trained) if all(c[b] for c in self.covered))


def replica(args: argparse.Namespace) -> int:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.local_sgd import DiLoCo
    from torchft.optim import OptimizerWrapper

    kind = Kind(args.kind)
    config = build_config(preset="small", config_file=args.config)
    torch.set_num_threads(1)
    out = Path(args.out)
    name = f"learner-{args.index}"
    workload = Workload.build(config)
    model = workload.new_model()
    plan = reference_layout(config, config.protocol.for_mode(config.run.mode, config.run.learners)).plan
    by_name = dict(model.named_parameters())
    fragments = [_Fragment([by_name[n] for n in f.param_names]) for f in plan.fragments]
    names = [list(f.param_names) for f in plan.fragments]
    sampler = workload.sampler(args.index)
    args.tokens_per_step = workload.tokens_per_step
    previous = read_batch_log(out / f"{name}.batches")
    resumed_at = max((p.trained_to for p in previous), default=0)
    sampler.skip_to(resumed_at)  # torchft resumes no data: the batches of a dead replica are not trained
    batches = BatchLog(out / f"{name}.batches", resumed_at)
    ledger = _Ledger(len(fragments) if kind is Kind.DILOCO else 1, resumed_at)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    trainer = workload.new_trainer(model)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])
        ledger.healed()  # the peer's state replaces what this replica trained since its syncs

    inner = trainer.optimizer
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S)), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=MIN_REPLICAS, use_async_quorum=kind is Kind.DDP,
                      timeout=timedelta(seconds=TIMEOUT_S), quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
                      connect_timeout=timedelta(seconds=TIMEOUT_S), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
                      replica_id=name, port=0, hostname="localhost", init_sync=False)
    _count_bytes(manager, ledger)
    commits = open(out / f"commits-{args.index}.log", "a", buffering=1)
    progress = ProgressFile(out / f"{name}.progress")
    if kind is Kind.DDP:
        trainer.model = DistributedDataParallel(manager, model)
        trainer.optimizer = OptimizerWrapper(manager, inner)
        _watch_ddp_commits(manager, ledger, commits)
        return _train(trainer, sampler, batches, ledger, progress, manager, args, lambda: True,
                      lambda: _snapshot_ddp(model, out, args.index))
    outer = [torch.optim.SGD(f.parameters(), lr=config.protocol.outer_lr, momentum=config.protocol.outer_momentum,
                             nesterov=True) for f in fragments]
    with DiLoCo(manager, fragments, inner, outer, sync_every=config.protocol.period,
                fragment_sync_delay=config.protocol.overlap, fragment_update_alpha=config.protocol.alpha) as diloco:
        for i, frag in enumerate(diloco._fragments):
            _watch_diloco_sync(frag, i, ledger, commits)
        cycle_done = lambda: diloco._local_step == 0 and manager.current_step() % len(fragments) == 0  # noqa: E731
        return _train(trainer, sampler, batches, ledger, progress, manager, args, cycle_done,
                      lambda: _snapshot_diloco(diloco, names, out, args.index))


def _train(trainer: InnerTrainer, sampler: BatchSampler, batches: BatchLog, ledger: _Ledger,
           progress: ProgressFile, manager: Any, args: argparse.Namespace, cycle_done: Callable[[], bool],
           snapshot: Callable[[], None]) -> int:
    """Train until the stop time, then to the end of an outer step (every fragment synced once: torchft has
    no flush, so work past the last sync would be lost for nothing)."""
    last_snapshot = 0.0
    tokens = args.tokens_per_step
    stop_at = float("inf")
    while time.time() < stop_at or not cycle_done():
        if stop_at == float("inf") and ledger.trained % 10 == 0:
            stop_at = _stop_time(Path(args.out))
        x, y = sampler.next_batch()
        ledger.step()  # before the step: its sync (inside the optimizer's step) covers this batch
        trainer.step(x, y)
        batches.trained(ledger.resumed_at + ledger.trained - 1)
        if time.time() - last_snapshot >= SNAPSHOT_EVERY_S and ledger.commits:
            last_snapshot = time.time()
            snapshot()
        if progress.due(ledger.trained):
            progress.write(ledger.trained, ledger.trained * tokens, merged=ledger.merged, bytes_sent=ledger.bytes_sent,
                           commits=ledger.commits, failed_commits=ledger.failed_commits)
    if ledger.commits:  # a replica that never joined a quorum holds no global model
        snapshot()
    progress.write(ledger.trained, ledger.trained * tokens, merged=ledger.merged, bytes_sent=ledger.bytes_sent,
                   commits=ledger.commits, failed_commits=ledger.failed_commits, finished=True)
    batches.close()
    manager.shutdown(wait=False)
    return 0


def _stop_time(out: Path) -> float:
    """The stop time the harness writes once every learner trains (``peers_systems.STOP_FILE``); none yet: inf."""
    try:
        return float((out / "stop_at").read_text())
    except (OSError, ValueError):
        return float("inf")


def _count_bytes(manager: Any, ledger: _Ledger) -> None:  # Any: torchft's Manager, imported in replica()
    """What this replica sends in each all-reduce: gloo's ring sends 2(n-1)/n of the tensor per member."""
    allreduce = manager.allreduce

    def counted(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        n = manager.num_participants()
        ledger.bytes_sent += tensor.numel() * tensor.element_size() * 2 * (n - 1) / max(1, n)
        return allreduce(tensor, *a, **kw)

    manager.allreduce = counted


def _watch_diloco_sync(frag: Any, index: int, ledger: _Ledger, commits: Any) -> None:
    perform_sync = frag.perform_sync

    def watched() -> bool:
        committed = perform_sync()
        ledger.synced(index, committed)
        _note(ledger, commits, committed, index)
        return committed

    frag.perform_sync = watched


def _watch_ddp_commits(manager: Any, ledger: _Ledger, commits: Any) -> None:
    should_commit = manager.should_commit

    def watched(*a: Any, **kw: Any) -> bool:
        participating = manager.is_participating()
        committed = should_commit(*a, **kw)
        ledger.synced(0, committed and participating)
        _note(ledger, commits, committed, 0)
        return committed

    manager.should_commit = watched


def _note(ledger: _Ledger, commits: Any, committed: bool, fragment: int) -> None:
    if committed:
        ledger.commits += 1
        commits.write(f"{time.time():.3f} {fragment}\n")
    else:
        ledger.failed_commits += 1


def _snapshot_diloco(diloco: Any, names: list[list[str]], out: Path, index: int) -> None:
    """The global model: every fragment's committed values (DiLoCo's ``original_parameters``)."""
    state = {}
    for frag, frag_names in zip(diloco._fragments, names):
        for key, tensor in frag.original_parameters.items():
            state[frag_names[int(key.rsplit(".", 1)[1])]] = tensor.clone()
    _write_snapshot(state, out, index)


def _snapshot_ddp(model: nn.Module, out: Path, index: int) -> None:
    _write_snapshot({k: v.detach().clone() for k, v in model.named_parameters()}, out, index)


def _write_snapshot(state: dict[str, torch.Tensor], out: Path, index: int) -> None:
    path = out / f"global-{index}.pt"
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"time": time.time(), "params": state}, tmp)
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    light = sub.add_parser("lighthouse")
    light.add_argument("--port-file", required=True)
    rep = sub.add_parser("replica")
    rep.add_argument("--kind", choices=[k.value for k in Kind], required=True)
    rep.add_argument("--index", type=int, required=True)
    rep.add_argument("--lighthouse", required=True)
    rep.add_argument("--config", required=True, help="the run's configuration (the synchronizer's TOML)")
    rep.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "lighthouse":
        return lighthouse(Path(args.port_file))
    return replica(args)


if __name__ == "__main__":
    sys.exit(main())
