"""Decoupled DiLoCo inside your own PyTorch training loop.

Wrap a model whose inner optimizer you step yourself; call :meth:`LearnerRuntime.step`
after every inner step::

    runtime = LearnerRuntime(model, "sync-host:7000", "island-a", token=token)
    while not runtime.should_stop:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        runtime.step(tokens=x.numel())
    runtime.close()

The protocol is the core's :class:`~ddiloco.core.learner.Learner`; this module only moves
its messages. ``step`` never waits for the network: it takes the outer gradients that
fell due (a memory copy), hands them to a background thread that compresses and uploads
them, and applies the global updates that arrived meanwhile (between two steps, as the
algorithm wants). Three background threads do the talking:

- *sender*: compresses and uploads contributions; one it cannot deliver goes back to the
  training thread, which folds it into the fragment's next contribution (``requeue``);
- *receiver*: holds the stream of updates the synchronizer pushes, resubscribing (with the
  versions held, so recent updates are replayed) whenever it breaks;
- *control*: renews the lease with heartbeats and (re)joins — after a lease expiry, a
  missed version or a synchronizer restart — downloading the full state, which the
  training thread adopts at its next step.

A synchronizer that cannot be reached is retried with exponential backoff while training
goes on; a refused auth token is permanent and raised from the next ``step``.

Under ``torchrun`` (``torch.distributed`` initialized, world size > 1) the runtime is
data-parallel aware: rank 0 talks to the synchronizer; after every step it broadcasts which
fragments a merge changed, and their new values, to the other ranks. Gradients are the
user's to all-reduce (``DistributedDataParallel``), so all ranks keep identical weights.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from ddiloco.core.config import ProtocolConfig
from ddiloco.core.fragments import Fragment, FragmentPlan
from ddiloco.core.learner import Learner, UpdateResult
from ddiloco.errors import ConfigError, DdilocoError
from ddiloco.runtime.auth import AuthenticationError
from ddiloco.runtime.client import JoinResult, Refused, SyncClient, Unreachable
from ddiloco.runtime.proto import ddiloco_pb2 as pb

log = logging.getLogger("ddiloco.learner")

BACKOFF_START_S = 0.2
BACKOFF_MAX_S = 2.0
_STOP = object()


class LayoutMismatch(ConfigError):
    """The wrapped model does not have the parameters the synchronizer serves."""


@dataclass(slots=True)
class RuntimeStats:
    """What the runtime did, for logs, tests and benchmarks."""

    steps: int = 0
    contributions_sent: int = 0
    contributions_dropped: int = 0
    requeued: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)
    updates_applied: int = 0
    updates_ignored: int = 0
    gaps: int = 0
    joins: int = 0
    unreachable: int = 0
    bytes_up: int = 0
    step_overhead_s: float = 0.0
    """Seconds spent inside ``step`` (the runtime's whole cost to the training loop)."""


def plan_from_layout(header: pb.JoinHeader, params: dict[str, torch.Tensor]) -> FragmentPlan:
    """The synchronizer's fragment plan, checked against the model's parameters."""
    served: set[str] = set()
    fragments = []
    for f in header.fragments:
        names = []
        for p in f.params:
            if p.name not in params:
                raise LayoutMismatch(f"the synchronizer serves parameter {p.name!r}, which this model lacks "
                                     "(start learner and synchronizer with the same model options)")
            shape = tuple(params[p.name].shape)
            if shape != tuple(p.shape):
                raise LayoutMismatch(f"parameter {p.name!r} has shape {shape} here, {tuple(p.shape)} at the "
                                     "synchronizer (start both with the same model options)")
            names.append(p.name)
            served.add(p.name)
        fragments.append(Fragment(index=f.index, param_names=tuple(names), numel=f.numel, offset=f.offset,
                                  is_embedding=f.is_embedding))
    extra = sorted(set(params) - served)
    if extra:
        raise LayoutMismatch(f"parameters {extra[:3]} are not served by the synchronizer (another model?)")
    return FragmentPlan(fragments=tuple(fragments), period=header.period)


def save_initial_state(model: nn.Module, path: str | Path, embedding_names: list[str] | None = None) -> None:
    """Write a model's initial weights for ``ddiloco sync --init FILE`` (serving your own model).

    ``embedding_names`` are merged with the plain mean (their own fragment); by default the
    weights of every ``nn.Embedding`` module (and parameters tied to them).
    """
    if embedding_names is None:
        embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        embedding_names = [n for n, p in model.named_parameters() if id(p) in embedding_ids]
    tensors = {n: p.detach().to(torch.float32).contiguous().clone() for n, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"embedding_names": json.dumps(embedding_names)})


def join_with_backoff(client: SyncClient, learner_id: str, *, timeout_s: float | None = None,
                      probe: bool = False) -> JoinResult:
    """Join (or ``probe``), retrying while the synchronizer is unreachable (forever unless ``timeout_s``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = BACKOFF_START_S
    while True:
        try:
            return client.join(learner_id, probe=probe)
        except Unreachable as err:
            if deadline is not None and time.monotonic() + delay > deadline:
                raise DdilocoError(f"synchronizer at {client.address} unreachable: {err}") from None
            log.info("synchronizer at %s unreachable; retrying in %.1fs", client.address, delay)
            time.sleep(delay)
            delay = _next_delay(delay)


def _next_delay(delay: float) -> float:
    return min(BACKOFF_MAX_S, delay * 2) * random.uniform(0.8, 1.2)


class LearnerRuntime:
    """One learner of a Decoupled DiLoCo run, wrapped around a model you train yourself."""

    def __init__(
        self,
        model: nn.Module,
        connect: str | SyncClient | None,
        learner_id: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        join: JoinResult | None = None,
        join_timeout_s: float | None = None,
    ) -> None:
        if not learner_id:
            raise ConfigError("a learner needs a non-empty id")
        self.model = model
        self.learner_id = learner_id
        self.stats = RuntimeStats()
        self._params = dict(model.named_parameters())
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        self.is_leader = self.rank == 0
        self._stop_flag = threading.Event()
        self._closing = threading.Event()
        self._fatal: BaseException | None = None
        self._last_step_end = time.perf_counter()
        self.core: Learner | None = None
        self.plan: FragmentPlan | None = None
        self.instance_id = ""
        self.header: pb.JoinHeader | None = None
        if self.is_leader:
            if connect is None:
                raise ConfigError("the leading rank needs a synchronizer address")
            self.client = connect if isinstance(connect, SyncClient) else SyncClient(connect, token=token, tls_ca=tls_ca)
            if join is None:
                join = join_with_backoff(self.client, learner_id, timeout_s=join_timeout_s)
            self._setup(join)
        if self.world > 1:
            self._share_layout()

    # ---- setup -----------------------------------------------------------------------------

    def _setup(self, join: JoinResult) -> None:
        self.header = join.header
        self.instance_id = join.header.instance_id
        protocol = ProtocolConfig(**join.protocol)
        self.protocol = protocol
        self.plan = plan_from_layout(join.header, self._params)
        self.core = Learner(self.learner_id, protocol, self.plan, self._params)
        self.stats.joins += 1
        self._outbox: queue.Queue = queue.Queue()
        self._inbox: queue.Queue = queue.Queue()
        self._send_lock = threading.Lock()
        self._join_needed = threading.Event()
        self._resubscribe = threading.Event()
        """Set after a (re)join: the receiver stops backing off and subscribes at once."""
        self._join_epoch = 0
        self._adopted_epoch = 0
        self._adopted_instance = join.header.instance_id
        self._published_versions: list[int] = list(join.header.versions)
        self._progress_lock = threading.Lock()
        self._unreported_tokens = 0
        self._unreported_steps = 0
        self._stream = None
        self.heartbeat_s = protocol.heartbeat_interval_s
        if join.header.finished:
            self._stop_flag.set()
            return
        self.core.adopt(join.state)
        self._published_versions = list(self.core.versions)
        self._threads = [
            threading.Thread(target=self._sender, name=f"ddiloco-send-{self.learner_id}", daemon=True),
            threading.Thread(target=self._receiver, name=f"ddiloco-recv-{self.learner_id}", daemon=True),
            threading.Thread(target=self._control, name=f"ddiloco-ctl-{self.learner_id}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _share_layout(self) -> None:
        """Rank 0 tells the other ranks the fragments, then everyone takes rank 0's weights."""
        box = [[f.param_names for f in self.plan.fragments] if self.plan is not None else None,
               self._stop_flag.is_set()]
        dist.broadcast_object_list(box, src=0)
        self._fragment_names = box[0]
        self._stop_agreed = bool(box[1])
        with torch.no_grad():
            for names in self._fragment_names:
                for name in names:
                    dist.broadcast(self._params[name].data, src=0)

    # ---- the training thread's API ---------------------------------------------------------

    @property
    def should_stop(self) -> bool:
        """True once the synchronizer says the run's budget is spent.

        Under torchrun every rank sees the value rank 0 broadcast at the last ``step``, so
        all ranks leave their loop after the same step.
        """
        return self._stop_agreed if self.world > 1 else self._stop_flag.is_set()

    @property
    def backlog(self) -> int:
        """Contributions waiting for the sender thread."""
        return self._outbox.qsize() if self.core is not None else 0

    @property
    def versions(self) -> list[int]:
        return list(self.core.versions) if self.core is not None else []

    def step(self, tokens: int, duration_s: float | None = None) -> None:
        """Account one finished inner step of ``tokens`` tokens (this rank's batch).

        ``duration_s`` defaults to the time since the previous call (the step time the
        synchronizer uses to size its grace window). Never waits for the network (except
        in synchronous DiLoCo mode, whose learners wait for their fragments by design).
        """
        entered = time.perf_counter()
        if duration_s is None:
            duration_s = entered - self._last_step_end
        changed: set[int] = set()
        if self.is_leader and self.core is not None:
            if self._fatal is not None:
                raise self._fatal
            self.stats.steps += 1
            if self.core.joined:
                for due in self.core.record_step_unencoded(tokens * self.world, duration_s):
                    self._outbox.put((self._adopted_epoch, due))
            with self._progress_lock:
                self._unreported_tokens += tokens * self.world
                self._unreported_steps += 1
            changed = self._drain_inbox(block=False)
            while not self.core.can_step() and not self._stop_flag.is_set() and self._fatal is None:
                changed |= self._drain_inbox(block=True)  # synchronous DiLoCo: wait for our fragments
            if self._fatal is not None:
                raise self._fatal
        if self.world > 1:
            changed = self._sync_ranks(changed)
        now = time.perf_counter()
        self.stats.step_overhead_s += now - entered
        self._last_step_end = now

    def close(self, *, flush: bool = True, timeout_s: float = 60.0) -> None:
        """Send what is left (``flush``), leave the run, stop the background threads."""
        if not self.is_leader or self.core is None or self._closing.is_set():
            return
        threads = getattr(self, "_threads", [])
        if flush and self._fatal is None and self.core.joined and threads:
            self._drain_inbox(block=False)
            for due in self.core.flush_unencoded():
                self._outbox.put((self._adopted_epoch, due))
        self._outbox.put((0, _STOP))
        if threads:
            threads[0].join(timeout_s)  # the sender delivers everything queued before _STOP
        if threads and self._fatal is None:
            try:
                self.client.leave(self.learner_id)
            except (Unreachable, Refused, AuthenticationError) as err:
                log.info("leave failed: %s", err)
        self._closing.set()
        self._join_needed.set()
        self._resubscribe.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        for t in threads[1:]:
            t.join(timeout_s)
        self.client.close()

    def __enter__(self) -> "LearnerRuntime":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(flush=exc_type is None)

    # ---- training thread internals ---------------------------------------------------------

    def _drain_inbox(self, *, block: bool) -> set[int]:
        """Apply what the background threads received; returns the fragments that changed."""
        assert self.core is not None
        changed: set[int] = set()
        while True:
            try:
                kind, tag, item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            except queue.Empty:
                return changed
            block = False
            if kind == "adopt":
                join: JoinResult = item
                if join.header.finished:
                    self._stop_flag.set()
                    continue
                self.core.adopt(join.state)
                self._adopted_epoch = tag
                self._adopted_instance = join.header.instance_id
                changed |= set(range(len(join.state.fragments)))
                log.info("adopted the global state at versions %s", list(self.core.versions))
            elif kind == "update":
                if tag != self._adopted_instance:
                    continue  # from a synchronizer incarnation we no longer follow
                result = self.core.apply_update(item)
                if result is UpdateResult.APPLIED:
                    self.stats.updates_applied += 1
                    changed.add(item.fragment)
                elif result is UpdateResult.IGNORED:
                    self.stats.updates_ignored += 1
                elif not self._join_needed.is_set():
                    self.stats.gaps += 1
                    log.info("missed a version of fragment %d: fetching the full state", item.fragment)
                    self._join_needed.set()
            elif kind == "requeue":
                if tag == self._adopted_epoch:
                    self.core.requeue(item)
                    self.stats.requeued += 1
            self._published_versions = list(self.core.versions)

    def _sync_ranks(self, changed: set[int]) -> set[int]:
        """Every rank takes rank 0's merged fragments (and stop / error flags)."""
        names = self._fragment_names
        flags = torch.zeros(len(names) + 2, dtype=torch.int64)
        if self.is_leader:
            flags[0] = int(self._stop_flag.is_set())
            flags[1] = int(self._fatal is not None)
            for p in changed:
                flags[2 + p] = 1
        dist.broadcast(flags, src=0)
        self._stop_agreed = bool(flags[0])
        if flags[1] and not self.is_leader:
            raise DdilocoError("rank 0 lost the synchronizer (see its log)")
        changed = {p for p in range(len(names)) if flags[2 + p]}
        with torch.no_grad():
            for p in sorted(changed):
                for name in names[p]:
                    dist.broadcast(self._params[name].data, src=0)
        return changed

    # ---- background threads ----------------------------------------------------------------

    def _fail(self, err: BaseException) -> None:
        if self._fatal is None:
            self._fatal = err
            log.error("%s", err)
        self._closing.set()
        self._join_needed.set()
        self._inbox.put(("noop", None, None))

    def _take_progress(self) -> tuple[int, int]:
        with self._progress_lock:
            tokens, steps = self._unreported_tokens, self._unreported_steps
            self._unreported_tokens = self._unreported_steps = 0
        return tokens, steps

    def _return_progress(self, tokens: int, steps: int) -> None:
        with self._progress_lock:
            self._unreported_tokens += tokens
            self._unreported_steps += steps

    def _sender(self) -> None:
        while True:
            epoch, due = self._outbox.get()
            if due is _STOP:
                return
            if self._fatal is not None:
                continue
            if epoch != self._join_epoch:
                self.stats.contributions_dropped += 1  # measured from a state we no longer hold
                continue
            contribution = due.encode()
            tokens, steps = self._take_progress()
            try:
                with self._send_lock:
                    if epoch != self._join_epoch:
                        self.stats.contributions_dropped += 1
                        self._return_progress(tokens, steps)
                        continue
                    reply = self.client.contribute(contribution, instance_id=self.instance_id,
                                                   trained_tokens=tokens, trained_steps=steps)
                self.stats.contributions_sent += 1
                self.stats.bytes_up += len(contribution.payload)
                if reply.stop:
                    self._stop_flag.set()
            except Unreachable as err:
                if str(err) != getattr(self, "_last_upload_error", None):
                    self._last_upload_error = str(err)
                    log.info("upload failed, folding it into the next one: %s", err)
                self.stats.unreachable += 1
                self._return_progress(tokens, steps)
                self._inbox.put(("requeue", epoch, due))  # folded into this fragment's next one
            except Refused as err:
                self.stats.rejected[err.reason] += 1
                if err.reason in ("unknown_learner", "stale", "future_version"):
                    # Not registered any more, or our anchors are too far from the global
                    # versions (missed updates, or a synchronizer that rolled back): join again.
                    if not self._join_needed.is_set():
                        log.info("contribution to fragment %d refused (%s): joining again", due.fragment,
                                 err.reason)
                    self._join_needed.set()
                elif err.reason == "finished":
                    self._stop_flag.set()
                else:
                    log.warning("contribution to fragment %d rejected: %s", due.fragment, err.detail)
            except AuthenticationError as err:
                self._fail(err)

    def _receiver(self) -> None:
        delay = BACKOFF_START_S
        while not self._closing.is_set():
            if self._join_needed.is_set():
                self._closing.wait(0.05)
                continue
            instance = self.instance_id
            self._resubscribe.clear()
            try:
                stream = self.client.updates(self.learner_id, list(self._published_versions), instance)
                self._stream = stream
                for update in stream:
                    delay = BACKOFF_START_S
                    if update is None:
                        self._stop_flag.set()
                    else:
                        self._inbox.put(("update", instance, update))
                self._resubscribe.wait(BACKOFF_START_S)  # closed by the synchronizer: subscribe again
            except Unreachable:
                if self._resubscribe.wait(delay):
                    delay = BACKOFF_START_S
                else:
                    delay = _next_delay(delay)
            except Refused as err:
                if err.reason == "unknown_learner":
                    self._join_needed.set()
                else:
                    log.warning("update stream refused: %s", err.detail)
                    self._resubscribe.wait(delay)
                    delay = _next_delay(delay)
            except AuthenticationError as err:
                self._fail(err)
                return
            finally:
                self._stream = None

    def _control(self) -> None:
        delay = BACKOFF_START_S
        while not self._closing.is_set():
            if self._join_needed.is_set():
                if self._rejoin():
                    delay = BACKOFF_START_S
                    continue
                self._closing.wait(delay)
                delay = _next_delay(delay)
                continue
            tokens, steps = self._take_progress()
            try:
                reply = self.client.heartbeat(self.learner_id, tokens=tokens, steps=steps,
                                              instance_id=self.instance_id)
                if reply.stop:
                    self._stop_flag.set()
                delay = BACKOFF_START_S
                wait = self.heartbeat_s
            except Unreachable as err:
                if str(err) != getattr(self, "_last_upload_error", None):
                    self._last_upload_error = str(err)
                    log.info("upload failed, folding it into the next one: %s", err)
                self.stats.unreachable += 1
                self._return_progress(tokens, steps)
                wait = delay
                delay = _next_delay(delay)
            except Refused as err:
                if err.reason == "unknown_learner":
                    # Lease lost or the synchronizer restarted: it no longer knows us. The
                    # tokens were still trained; report them after joining again.
                    self._return_progress(tokens, steps)
                    self._join_needed.set()
                    continue
                log.warning("heartbeat refused: %s", err.detail)
                wait = delay
            except AuthenticationError as err:
                self._fail(err)
                return
            self._join_needed.wait(wait)

    def _rejoin(self) -> bool:
        """Register again and hand the full state to the training thread."""
        try:
            with self._send_lock:
                join = self.client.join(self.learner_id)
                self._join_epoch += 1
                self.instance_id = join.header.instance_id
                epoch = self._join_epoch
        except Unreachable as err:
            self.stats.unreachable += 1
            log.info("rejoin: synchronizer unreachable (%s)", err)
            return False
        except Refused as err:
            log.warning("rejoin refused: %s", err.detail)
            return False
        except AuthenticationError as err:
            self._fail(err)
            return False
        self.stats.joins += 1
        log.info("rejoined synchronizer instance %s at versions %s", join.header.instance_id[:8],
                 list(join.header.versions))
        self._published_versions = list(join.header.versions)
        self._inbox.put(("adopt", epoch, join))
        self._join_needed.clear()
        self._resubscribe.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()  # subscribe again for this incarnation of the synchronizer
        return True


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
