"""Decoupled DiLoCo inside your own PyTorch training loop.

Wrap a model whose inner optimizer you step yourself; call :meth:`LearnerRuntime.step`
after every inner step::

    runtime = LearnerRuntime(model, "sync-host:7000", "island-a", token=token)
    loader.skip_to(runtime.data_position)  # a restarted learner: what reached the global model is not trained again
    while not runtime.should_stop:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        runtime.step(tokens=x.numel())
    runtime.close()

The protocol is the core's :class:`~ddiloco.core.learner_side.learner_core.Learner`; this module feeds it the
training loop's steps and carries out its actions through
:class:`~ddiloco.runtime.learner.link.LearnerLink`, whose helper process compresses, uploads,
heartbeats, rejoins and receives (the training process's interpreter is left to training).
``step`` never waits for the network: it writes the outer gradients that fell due into shared
slots (a memory copy), announces them to the helper in one message, and applies the global
updates that arrived meanwhile (between two steps, as the algorithm wants). It waits only when
the core says so: synchronous DiLoCo, or ``protocol.max_wait_s``. On a GPU it does not wait for
the device either: Δ and updates cross through the pinned slots on asynchronous copies (``staging.py``).

Under ``torchrun`` (``torch.distributed`` initialized, world size > 1) the runtime is
data-parallel aware: rank 0 talks to the synchronizer; after every step it broadcasts which
fragments a merge changed, and their new values, to the other ranks. Gradients are the
user's to all-reduce (``DistributedDataParallel``), so all ranks keep identical weights.
What rank 0 tells the others after every step is :mod:`ddiloco.runtime.learner.ranks`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from ddiloco.core.learner_side.flat import ModelHold
from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.learner_side.learner_kernels import compile_learner_kernels
from ddiloco.core.learner_side.learner_phase import LoopMove, UpdateResult
from ddiloco.core.shared.errors import ConfigError, DdilocoError, ParameterError
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.runtime import script_env
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.layout import LayoutMismatch, plan_from_layout
from ddiloco.runtime.learner.connect import connect_all, on_loopback, one_run, probe_with_backoff
from ddiloco.runtime.learner.link import Inbox, LearnerLink
from ddiloco.runtime.learner.ranks import StepFlags, cpu_group, distributed, share_step
from ddiloco.runtime.learner.staging import HostStaging
from ddiloco.runtime.learner.stats import RuntimeStats

log = logging.getLogger("ddiloco.learner")

__all__ = ["LayoutMismatch", "LearnerRuntime", "RuntimeStats", "probe_with_backoff", "save_initial_state"]


def save_initial_state(model: nn.Module, path: str | Path, embedding_names: list[str] | None = None) -> None:
    """Write a model's initial weights for ``ddiloco sync --init FILE`` (serving your own model).

    ``embedding_names`` are merged with the plain mean (their own fragment); by default the
    weights of every ``nn.Embedding`` module (and parameters tied to them).
    """
    if embedding_names is None:
        embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        embedding_names = [n for n, p in model.named_parameters() if id(p) in embedding_ids]
    from ddiloco.workload.model_file import tied_names

    tensors = {n: p.detach().to(torch.float32).contiguous().clone() for n, p in model.named_parameters()}
    # safetensors stores tensors by sorted name; the model's own order is kept beside them, because
    # layer-wise and strided fragmentation follow it (layer 10 must not come before layer 2). The tied
    # names and a Hugging Face model's configuration let `ddiloco export` write a file the model loads.
    metadata = {"embedding_names": json.dumps(embedding_names), "param_order": json.dumps(list(tensors)),
                "aliases": json.dumps(tied_names(model))}
    hf_config = getattr(model, "config", None)
    if hasattr(hf_config, "to_json_string"):
        metadata["hf_config"] = hf_config.to_json_string(use_diff=False)
    save_file(tensors, str(path), metadata=metadata)


def is_sharded(model: nn.Module) -> bool:
    """Does the model hold any parameter as a ``DTensor`` (FSDP2's ``fully_shard``)? Only a process
    that imported ``torch.distributed.tensor`` can hold one, so it is looked up, never imported:
    an unsharded learner is spared the import (about a second of CPU, sympy's among it)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


class LearnerRuntime:
    """One learner of a Decoupled DiLoCo run, wrapped around a model you train yourself."""

    def __new__(cls, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if cls is LearnerRuntime and is_sharded(model):  # FSDP2: every rank streams its own slice
            from ddiloco.runtime.learner.fsdp.fsdp_runtime import FsdpLearnerRuntime

            return FsdpLearnerRuntime(model, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        connect: str | SyncClient | Sequence[str | SyncClient] | None,
        learner_id: str,
        *,
        token: str | None = None,
        secret: str | None = None,
        tls_ca: str | None = None,
        join_timeout_s: float | None = None,
        tokens_per_step: int = 0,
        on_data_position: Callable[[int], None] | None = None,
    ) -> None:
        """``token``: the run's shared token; ``secret``: this learner's own (per-learner credentials).
        ``tokens_per_step``: the most tokens one call of :meth:`step` reports (this rank's batch), so
        the synchronizer can bound what this learner claims; 0 leaves it to the run's configuration.
        ``on_data_position``: called once the learner joined (on every rank, before the first step)
        with :attr:`data_position`, for a loader to skip ahead to it."""
        if not learner_id:
            raise ConfigError("a learner needs a non-empty id")
        if token is not None and secret is not None:
            raise ConfigError("give a learner the run's shared token or its own secret, not both")
        self.model = model
        self.learner_id = learner_id
        self.boot = uuid.uuid4().hex[:12]
        self._params = dict(model.named_parameters())
        if not self._params:
            raise ParameterError(f"the model ({type(model).__name__}) has no parameters: nothing to train or synchronize")
        self._hold = ModelHold(model)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)
        self.tokens_per_step = tokens_per_step * self.world
        self.is_leader = self.rank == 0
        self._lock = threading.RLock()
        self._last_step_end = time.perf_counter()
        self._steps = 0
        self._overhead_s = 0.0
        self._closed = False
        self.core: Learner | None = None
        self.link: LearnerLink | None = None
        self.plan = None
        if self.is_leader:
            if connect is None:
                raise ConfigError("the leading rank needs a synchronizer address")
            self.clients = connect_all(connect, token=secret or token, tls_ca=tls_ca,
                                       learner_id=learner_id if secret is not None else None)
            self._setup(join_timeout_s)
        self._data_position = self.core.next_batch if self.core is not None else 0
        if self.world > 1:
            self._flags_group = cpu_group()
            self._share_layout()
        if on_data_position is not None:
            on_data_position(self._data_position)
        # The first step is timed from here: the join (the whole state's download, 40 s on a
        # 1 Mbit/s link) is not a step, and the synchronizer spaces rounds by the step time.
        self._last_step_end = time.perf_counter()

    @classmethod
    def from_env(cls, model: nn.Module, **options: Any) -> "LearnerRuntime":
        """The learner ``ddiloco launch`` started this process as: the synchronizer's address, this
        learner's id and the run's token from the environment (:mod:`ddiloco.runtime.script_env`);
        ``options`` as for the constructor. The data shard is ``$DDILOCO_DATA_SHARD`` of
        ``$DDILOCO_DATA_SHARDS``, for the script's own loader."""
        missing = [name for name in (script_env.CONNECT, script_env.LEARNER_ID) if not os.environ.get(name)]
        if missing:
            raise ConfigError(f"LearnerRuntime.from_env: ${' and $'.join(missing)} not set: start this script with "
                              "`ddiloco launch --learners M -- python SCRIPT ...`, or give LearnerRuntime the address "
                              "and id itself")
        options.setdefault("token", os.environ.get(script_env.TOKEN) or None)
        return cls(model, os.environ.get(script_env.CONNECT), os.environ.get(script_env.LEARNER_ID, ""), **options)

    # ---- setup -----------------------------------------------------------------------------

    def _setup(self, join_timeout_s: float | None) -> None:
        # Probe before registering: the served layout to check the model against (a learner
        # refused for its model must not hold a lease, and count toward the quorum, until it
        # expires) and the run's protocol.
        probes = [probe_with_backoff(c, self.learner_id, timeout_s=join_timeout_s) for c in self.clients]
        self.clients = one_run(self.clients, probes)
        probes.sort(key=lambda probe: probe.header.shard)
        self.plan = plan_from_layout(probes[0].header, self._params)
        protocol = ProtocolConfig(**probes[0].protocol)
        self.core = core = Learner(self.learner_id, protocol, self.plan, self._params, boot=self.boot,
                                   tokens_per_step=self.tokens_per_step, on_loopback=on_loopback(self.clients))
        device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        downlink = protocol.downlink()
        compile_learner_kernels()  # now, not at the first due fragment (a stall of seconds)
        staging = HostStaging(device, downlink, [f.numel for f in self.plan.fragments],
                              [core.decodes_updates(f.index) for f in self.plan.fragments])
        self.link = link = LearnerLink(core, [c.spec for c in self.clients], self._lock, staging)
        for client in self.clients:  # the helper makes its own: no gRPC channel stays in this process
            client.close()
        link.start()
        # The first join is the core's like every other: retried while unreachable or refused
        # for now, given up on for good (a wrong secret, another process with this id), or the
        # end of a run that is already finished.
        link.tell_core(lambda c: c.start(time.monotonic()))
        deadline = None if not join_timeout_s else time.monotonic() + join_timeout_s
        while self._between_steps() is LoopMove.WAIT:  # no global state yet
            if deadline is not None and time.monotonic() > deadline:
                raise DdilocoError(f"{self.learner_id!r} could not join the synchronizer in {join_timeout_s:g}s")
            self._drain_inbox(block=True)
        self._raise_if_failed()

    def _share_layout(self) -> None:
        """Rank 0 tells the other ranks the fragments, then everyone takes rank 0's weights."""
        box = [[f.param_names for f in self.plan.fragments] if self.plan is not None else None,
               self._leader_should_stop(), self._data_position]
        dist.broadcast_object_list(box, src=0)
        self._fragment_params = [[self._params[name] for name in names] for names in box[0] or []]
        self._stop_agreed = bool(box[1])
        self._data_position = int(box[2])
        with torch.no_grad():
            for params in self._fragment_params:
                for param in params:
                    dist.broadcast(param.data, src=0)

    # ---- the training thread's API ---------------------------------------------------------

    @property
    def should_stop(self) -> bool:
        """True once the synchronizer says the run's budget is spent (or the run failed).

        Under torchrun every rank sees the value rank 0 broadcast at the last ``step``, so
        all ranks leave their loop after the same step.
        """
        if self.world > 1:
            return self._stop_agreed
        return self._leader_should_stop()

    def _leader_should_stop(self) -> bool:
        return self.core is not None and self.core.should_stop

    @property
    def data_position(self) -> int:
        """The batch of this learner's data stream its first step trains: where the synchronizer says
        its data reached the global model (every fragment merged the steps before it), 0 for a new
        learner id. A restarted learner that resumes its loader here trains again at most about one
        period of batches that already reached the model, and skips none that did not."""
        return self._data_position

    @property
    def backlog(self) -> int:
        """Contributions waiting for the sender thread."""
        return self.link.backlog if self.link is not None else 0

    @property
    def versions(self) -> list[int]:
        return list(self.core.versions) if self.core is not None else []

    @property
    def stats(self) -> RuntimeStats:
        link, core = self.link, self.core
        updates = core.updates if core is not None else {}
        return RuntimeStats(
            steps=self._steps,
            contributions_sent=link.stats.contributions_sent if link else 0,
            contributions_dropped=core.dropped if core else 0,
            answers_lost=core.answers_lost if core else 0,
            steps_unsent=core.steps_unsent if core else 0,
            rejected=dict(link.stats.rejected) if link else {},
            updates_applied=updates.get(UpdateResult.APPLIED, 0),
            updates_ignored=updates.get(UpdateResult.IGNORED, 0),
            gaps=updates.get(UpdateResult.GAP, 0),
            joins=link.stats.joins if link else 0,
            unreachable=link.stats.unreachable if link else 0,
            bytes_up=link.stats.bytes_up if link else 0,
            step_overhead_s=self._overhead_s,
        )

    def step(self, tokens: int, duration_s: float | None = None) -> None:
        """Account one finished inner step of ``tokens`` tokens (this rank's batch).

        ``duration_s`` defaults to the time since the previous call (the step time the
        synchronizer uses to size its grace window). Never waits for the network unless the
        core says the learner must wait (synchronous DiLoCo, ``protocol.max_wait_s``).
        """
        entered = time.perf_counter()
        if duration_s is None:
            duration_s = entered - self._last_step_end
        changed: set[int] = set()
        core, link = self.core, self.link
        if self.is_leader and core is not None and link is not None:
            self._raise_if_failed()
            self._hold.check()  # the core's flat buffers are still the model's parameters
            self._steps += 1
            with link.calls.batched():  # the step's announces reach the helper together
                with self._lock:
                    actions = core.record_step(tokens * self.world, duration_s, time.monotonic())
                link.dispatch(actions)
                changed = self._drain_inbox(block=False)
            while self._between_steps() is LoopMove.WAIT:
                changed |= self._drain_inbox(block=True)  # the core says: wait for the synchronizer
            self._raise_if_failed()
        if self.world > 1:
            changed = self._sync_ranks(changed)
        now = time.perf_counter()
        self._overhead_s += now - entered
        self._last_step_end = now

    def _between_steps(self) -> LoopMove:
        assert self.core is not None
        with self._lock:
            return self.core.between_steps(time.monotonic())

    def _raise_if_failed(self) -> None:
        if self.link is not None and self.link.fatal is not None:
            raise self.link.fatal

    def close(self, *, flush: bool = True, timeout_s: float = 60.0) -> None:
        """Send what is left (``flush``), leave the run, stop the background threads."""
        if not self.is_leader or self._closed:
            return
        self._closed = True
        core, link = self.core, self.link
        if core is not None and link is not None:
            if flush and link.fatal is None:
                # Updates that arrived after the last step are applied only without other ranks:
                # they could not follow (the ranks' last exchange was that step), and all ranks
                # must end with the same weights. The flush is measured from the anchors held.
                if self.world == 1:
                    self._drain_inbox(block=False)
                with self._lock:
                    actions = core.close(time.monotonic())
                link.dispatch(actions)
            link.close(timeout_s)

    def export(self, path: str | Path, *, dtype: str = "fp32") -> None:
        """Write the global model as this learner last received it (its anchors: every update merged
        so far, not its own training since) as the model's ``state_dict`` in a safetensors file,
        loadable with ``model.load_state_dict(safetensors.torch.load_file(path))``. Rank 0 writes."""
        from ddiloco.workload.model_file import full_state_dict, parameters, save_state_dict

        if self.core is None or self.plan is None:
            return
        shapes = {name: tuple(p.shape) for name, p in self._params.items()}
        with self._lock:
            params = parameters(self.plan, shapes, {f.index: self.core.anchor(f.index) for f in self.plan.fragments})
        save_state_dict(Path(path), full_state_dict(self.model, params), dtype)

    def __enter__(self) -> "LearnerRuntime":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(flush=exc_type is None)

    # ---- training thread internals ---------------------------------------------------------

    def _drain_inbox(self, *, block: bool) -> set[int]:
        """Hand the core what the background threads received; returns the fragments that changed."""
        core, link = self.core, self.link
        assert core is not None and link is not None
        changed: set[int] = set()
        while True:
            try:
                kind, item = link.inbox.get(timeout=0.1) if block else link.inbox.get_nowait()
            except queue.Empty:
                return changed
            block = False
            now = time.monotonic()
            if kind is Inbox.ADMITTED:
                shard, result = item
                with self._lock:
                    held = core.links[shard].session
                    actions = core.on_admitted(result.state, now, stop=result.header.stop, shard=shard)
                    if core.links[shard].session != held:
                        changed |= {f.fragment for f in result.state.fragments} - set(core.kept)
                        log.info("adopted the global state at versions %s%s", list(core.versions),
                                 f"; kept this learner's progress on fragments {list(core.kept)} (the synchronizer "
                                 "holds the values it holds)" if core.kept else "")
                link.dispatch(actions)
            elif kind is Inbox.UPDATE:
                update, values, slot = item  # slot: the fragment whose in slot holds it, -1 if none
                try:
                    with self._lock:
                        before = core.versions[update.fragment]
                        actions = core.on_update(update, now, values=values)
                        if core.versions[update.fragment] != before:
                            changed.add(update.fragment)
                finally:
                    if slot >= 0:
                        link.release(slot)
                link.dispatch(actions)

    def _sync_ranks(self, changed: set[int]) -> set[int]:
        """Every rank takes rank 0's merged fragments (and stop / failed flags)."""
        mine = StepFlags(self._leader_should_stop(), self.link is not None and self.link.fatal is not None,
                         frozenset(changed)) if self.is_leader else None
        agreed = share_step(mine, self._fragment_params, self._flags_group)
        self._stop_agreed = agreed.stop
        if agreed.failed and not self.is_leader:
            raise DdilocoError("rank 0 lost the synchronizer (see its log)")
        return set(agreed.changed)
