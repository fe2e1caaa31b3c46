"""What rank 0 tells the other ranks of a learner under ``torchrun``, after every step.

Rank 0 alone runs the protocol (the core and the link). The other ranks train the same model
on their own batches, and must end every step with rank 0's weights and leave the loop after
the same step. So after every step rank 0 broadcasts :class:`StepFlags` (stop, failed, which
fragments a merge changed), then the parameters of each changed fragment. The flags travel
over a CPU (gloo) group: read from a GPU tensor they would be a device synchronization per
step, and the training thread would wait for the GPU to drain.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout


@dataclass(frozen=True, slots=True)
class StepFlags:
    stop: bool
    """The run's budget is spent (or the run failed): every rank leaves its loop after this step."""
    failed: bool
    """Rank 0 lost the synchronizer; the other ranks raise."""
    changed: frozenset[int]
    """The fragments a merge changed during this step."""

    def encode(self, fragments: int) -> torch.Tensor:
        flags = torch.zeros(fragments + 2, dtype=torch.int64)
        flags[0], flags[1] = int(self.stop), int(self.failed)
        for p in self.changed:
            flags[2 + p] = 1
        return flags

    @classmethod
    def decode(cls, flags: torch.Tensor) -> StepFlags:
        values = flags.tolist()
        return cls(bool(values[0]), bool(values[1]), frozenset(p for p, on in enumerate(values[2:]) if on))


def share_step(flags: StepFlags | None, fragment_params: Sequence[Sequence[torch.Tensor]], group: Any) -> StepFlags:
    """Every rank gets rank 0's ``flags`` (rank 0 passes them, the others None), then the values of
    the fragments they name, from rank 0 (``fragment_params``: each fragment's parameters)."""
    encoded = (flags or StepFlags(False, False, frozenset())).encode(len(fragment_params))  # others: overwritten
    dist.broadcast(encoded, src=0, group=group)
    agreed = StepFlags.decode(encoded)
    with torch.no_grad():
        for p in sorted(agreed.changed):
            for param in fragment_params[p]:
                dist.broadcast(param.data, src=0)
    return agreed


def init_group(backend: str) -> None:
    """``dist.init_process_group(backend)`` for a rank that torchrun started, in a store of its attempt's own.

    torchrun's static rendezvous (``--master-port``, no ``--rdzv-backend``) keeps one TCPStore for the
    whole job, across the restarts of its ranks, and ``init_process_group``'s ``env://`` adds no prefix
    per attempt (torch assumes a new store per restart, which only the c10d rendezvous makes). So the
    ranks of a restarted job meet under the keys their dead predecessors wrote: a rank that comes
    first reads a sibling's old gloo address, and its connect is refused or, on a port taken since by
    another process, hangs (issue 43: a rank killed with -9, the restarted job hung until its
    deadline). Every attempt here (``TORCHELASTIC_RESTART_COUNT``) meets under a prefix of its own; a
    process not under torchrun's agent store initializes as ``env://`` would."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                          timeout=default_pg_timeout)
    store = dist.PrefixStore(f"ddiloco/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def cpu_group() -> Any:
    """A process group that carries CPU tensors: the default one if its backend does (gloo), else
    a gloo group over the same ranks (made by every rank, at the same point: it is collective)."""
    return None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def leave_group() -> None:
    """Leave the process group together with every sibling rank, while the interpreter is whole.

    The barrier first: a rank that tears its gloo connections down while a sibling is still busy
    (rank 0 writing the final checkpoint) can take a gloo thread down with it, and the process then
    dies by ``std::terminate`` (SIGABRT, "terminate called without an active exception") after its
    work was done; a launcher that judges ranks by their exit codes calls that run failed. Then the
    group is destroyed and the objects still holding it (DDP's reducer) are collected here, not
    during the interpreter's finalization, when their threads can no longer take the GIL."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
