"""The synchronizer as a gRPC service: the protocol core driven by real time and sockets.

One asyncio event loop serves every call (``grpc.aio``); the protocol core — the same
:class:`~ddiloco.core.synchronizer.Synchronizer` the virtual cluster drives — runs on one
dedicated worker thread, so its calls are serialized without locks and a long merge never
stalls the sockets. The service only moves bytes in and out of the core:

- it checks what the core cannot see: the auth token, the protocol version, protobuf
  syntax, chunk assembly and the size of an upload (wire-level rejections); everything
  else (fragment, codec, size, finite values, norm bound, version, staleness, duplicates,
  learner identity) is the core's ``Rejected``;
- it calls the core with ``time.monotonic()`` and wakes a background task at
  ``next_deadline()`` to call ``tick`` (grace windows, leases);
- it carries out the core's actions: pushes each ``Broadcast`` to the learners' update
  streams (keeping the last few updates per fragment to replay to a reconnecting learner),
  credits goodput on ``RoundClosed``;
- it checkpoints the core and its own counters atomically, every N rounds or S seconds.

Requests are parsed by the service itself (the handlers receive raw bytes), so that a
malformed message is counted and answered with a named reason instead of a generic error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from ddiloco.config import Config
from ddiloco.core.codecs import get_codec
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.fragments import FragmentPlan, flatten, plan_fragments
from ddiloco.core.messages import (
    Broadcast,
    Contribution,
    FragmentUpdate,
    LeaseExpired,
    Rejected,
    RoundClosed,
)
from ddiloco.core.synchronizer import Synchronizer
from ddiloco.errors import ConfigError
from ddiloco.runtime.auth import (
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    REASON_HEADER,
    Address,
    token_matches,
)
from ddiloco.runtime.wire import CHUNK_BYTES, KEEPALIVE_OPTIONS, MAX_MESSAGE_BYTES
from ddiloco.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ddiloco.runtime.metrics import ByteLedger, GoodputMeter, ServiceMetrics
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.workload.trainer import build_model

log = logging.getLogger("ddiloco.sync")

SERVICE_NAME = "ddiloco.v1.Synchronizer"
CHECKPOINT_NAME = "synchronizer.safetensors"
REPLAY_UPDATES = 8
"""Recent updates kept per fragment for learners whose update stream broke briefly..."""
REPLAY_BYTES = 256 << 20
"""... within this many bytes per fragment (a learner that misses more fetches the full state)."""
STREAM_BACKLOG = 64
"""Updates queued for one learner's stream before it is closed as too slow (it resubscribes)."""

SERVER_OPTIONS = KEEPALIVE_OPTIONS + [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]

WIRE_REASONS = ("malformed", "unauthenticated", "chunk_assembly", "too_large", "bad_protocol_version",
                "layout_mismatch", "finished")
"""Rejections decided at the boundary, before a message reaches the core."""

_STATUS_CODES = {
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "unknown_learner": grpc.StatusCode.FAILED_PRECONDITION,
    "future_version": grpc.StatusCode.FAILED_PRECONDITION,
    "stale": grpc.StatusCode.FAILED_PRECONDITION,
    "bad_protocol_version": grpc.StatusCode.FAILED_PRECONDITION,
    "layout_mismatch": grpc.StatusCode.FAILED_PRECONDITION,
    "finished": grpc.StatusCode.FAILED_PRECONDITION,
    "duplicate": grpc.StatusCode.ALREADY_EXISTS,
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""gRPC status per rejection reason; everything else is INVALID_ARGUMENT."""

T = TypeVar("T")
M = TypeVar("M", bound=Message)


# ---- the model the service serves ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Fragments of the served model, their initial values and the parameters' shapes."""

    plan: FragmentPlan
    shapes: dict[str, tuple[int, ...]]
    initial_values: list[torch.Tensor]

    def to_proto(self) -> list[pb.FragmentLayout]:
        return [
            pb.FragmentLayout(
                index=f.index,
                params=[pb.Param(name=n, shape=list(self.shapes[n])) for n in f.param_names],
                numel=f.numel,
                offset=f.offset,
                is_embedding=f.is_embedding,
            )
            for f in self.plan.fragments
        ]

    def sha256(self, protocol: ProtocolConfig) -> str:
        doc = {
            "fragments": [
                [f.index, [[n, list(self.shapes[n])] for n in f.param_names], f.offset, f.is_embedding]
                for f in self.plan.fragments
            ],
            "period": self.plan.period,
            "codec": protocol.codec,
            "downlink_codec": protocol.downlink_codec,
            "block_size": protocol.block_size,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def model_layout(
    protocol: ProtocolConfig,
    named_params: Iterable[tuple[str, torch.Tensor]],
    embedding_names: Iterable[str],
) -> ModelLayout:
    """Plan fragments exactly as the virtual cluster does, from named parameters."""
    params = dict(named_params)
    plan = plan_fragments(
        [(n, tuple(p.shape)) for n, p in params.items()],
        num_fragments=protocol.fragments,
        period=protocol.period,
        strategy=protocol.fragmentation,
        embedding_names=tuple(embedding_names),
    )
    return ModelLayout(
        plan=plan,
        shapes={n: tuple(p.shape) for n, p in params.items()},
        initial_values=[flatten([params[n] for n in f.param_names]) for f in plan.fragments],
    )


def reference_layout(config: Config, protocol: ProtocolConfig) -> ModelLayout:
    """The reference workload's model, initialized as every learner of the virtual run is."""
    model = build_model(config.model, config.run.seed)
    return model_layout(protocol, model.named_parameters(), model.embedding_param_names())


# ---- the service ------------------------------------------------------------------------


class _Abort(Exception):
    """Internal: end the current call with a rejection."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_CLOSE = object()


@dataclass(slots=True)
class _Subscriber:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    backlog: int = 0


@dataclass(frozen=True, slots=True)
class ServiceOptions:
    """How the synchronizer process runs (what ``ddiloco sync`` takes besides the workload)."""

    state_dir: Path | None = None
    resume: bool = False
    token: str | None = None
    checkpoint_every_rounds: int = 20
    checkpoint_every_s: float = 30.0
    drain_timeout_s: float | None = None
    """After the budget is spent, how long to wait for learners to flush and leave (default 2 leases)."""


class SyncService:
    """Serves one run: a protocol core, its checkpoints, its learners' streams and counters."""

    def __init__(self, config: Config, options: ServiceOptions, *, layout: ModelLayout | None = None) -> None:
        if config.run.mode not in ("decoupled", "diloco"):
            raise ConfigError(f"the synchronizer serves modes decoupled and diloco, not {config.run.mode!r}")
        self.config = config
        self.options = options
        self.protocol = config.protocol.for_mode(config.run.mode, config.run.learners)
        self.layout = layout or reference_layout(config, self.protocol)
        self.layout_sha256 = self.layout.sha256(self.protocol)
        self.core = Synchronizer(
            self.protocol,
            self.layout.initial_values,
            embedding_fragments=[f.index for f in self.layout.plan.fragments if f.is_embedding],
        )
        self._downlink_codec = get_codec(self.protocol.downlink_codec, block_size=self.protocol.block_size).name
        total = sum(f.numel for f in self.layout.plan.fragments)
        self._share = [f.numel / total for f in self.layout.plan.fragments]
        self._max_payload = max(4 * f.numel for f in self.layout.plan.fragments)
        self.instance_id = uuid.uuid4().hex
        self.metrics = ServiceMetrics()
        self.ledger = ByteLedger()
        self.goodput = GoodputMeter(learners=config.run.learners)
        self.wire_rejections: collections.Counter[str] = collections.Counter()
        self.learner_wire_rejected: collections.Counter[str] = collections.Counter()
        self.learner_tokens: collections.Counter[str] = collections.Counter()
        self.learner_index: dict[str, int] = {}
        self.tokens = 0
        self.stopping = False
        self.finished = False
        self.checkpoints = 0
        self._process_start_s = time.monotonic()
        self._run_start_s: float | None = None
        self._stop_at_s: float | None = None
        self._last_checkpoint_s: float | None = None
        self._rounds_since_checkpoint = 0
        self._checkpoint_task: asyncio.Task | None = None
        self._checkpoint_lock = asyncio.Lock()
        self._finish_s: float | None = None
        self._arrivals: dict[tuple[str, int], float] = {}
        self._recent: list[collections.deque[list[bytes]]] = [
            collections.deque(maxlen=REPLAY_UPDATES) for _ in self.layout.plan.fragments
        ]
        self._recent_versions: list[collections.deque[int]] = [
            collections.deque(maxlen=REPLAY_UPDATES) for _ in self.layout.plan.fragments
        ]
        self._subscribers: dict[str, _Subscriber] = {}
        self._left: set[str] = set()
        self._last_merge_s: float | None = None
        self.longest_pause_s = 0.0
        """Longest time between two merges of this incarnation (the global model standing still)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-core")
        self._wake: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._lock_fd: int | None = None
        self.port: int | None = None
        if options.state_dir is not None:
            self._open_state_dir(options.state_dir, options.resume)

    # ---- state directory and checkpoints ---------------------------------------------------

    @property
    def checkpoint_path(self) -> Path | None:
        return None if self.options.state_dir is None else self.options.state_dir / CHECKPOINT_NAME

    def _open_state_dir(self, state_dir: Path, resume: bool) -> None:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"--state-dir {str(state_dir)!r}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"--state-dir {str(state_dir)!r} is in use by another synchronizer") from None
        path = state_dir / CHECKPOINT_NAME
        try:
            if not path.exists():
                if resume:
                    log.info("no checkpoint in %s: starting a new run", state_dir)
            elif not resume:
                raise ConfigError(
                    f"--state-dir {str(state_dir)!r} already holds a checkpoint: pass --resume to continue "
                    "that run, or choose another directory"
                )
            else:
                self._restore(load_checkpoint(path))
                log.info("resumed from %s: fragment versions %s, %d tokens", path, list(self.core.versions()),
                         self.tokens)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def _restore(self, state: dict[str, Any]) -> None:
        service = state["service"]
        if service["layout_sha256"] != self.layout_sha256:
            raise CheckpointError(
                "the checkpoint belongs to a run with another model, fragmentation or codec: "
                "start with the same --preset/--config/--set as the run that wrote it"
            )
        try:
            self.core.load_state_dict(state["core"])
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"checkpoint does not fit this synchronizer: {err}") from None
        self.tokens = int(service["tokens"])
        self.finished = self.stopping = bool(service["finished"])
        self.learner_index = {k: int(v) for k, v in service["learner_index"].items()}
        self.learner_tokens = collections.Counter({k: int(v) for k, v in service["learner_tokens"].items()})
        self.wire_rejections = collections.Counter({k: int(v) for k, v in service["wire_rejections"].items()})
        self.learner_wire_rejected = collections.Counter(
            {k: int(v) for k, v in service["learner_wire_rejected"].items()}
        )
        self.ledger.load_state_dict(service["bytes"])
        self.goodput.load_state_dict(service["goodput"])
        self.checkpoints = int(service["checkpoints"])

    def _service_state(self, now: float) -> dict[str, Any]:
        if self._finish_s is not None:
            now = self._finish_s
        wall = 0.0 if self._run_start_s is None else now - self._run_start_s
        uptime = 0.0 if self._run_start_s is None else self.goodput.uptime(self._run_start_s, now)
        return {
            "layout_sha256": self.layout_sha256,
            "tokens": self.tokens,
            "finished": self.finished,
            "learner_index": dict(self.learner_index),
            "learner_tokens": dict(self.learner_tokens),
            "wire_rejections": dict(self.wire_rejections),
            "learner_wire_rejected": dict(self.learner_wire_rejected),
            "bytes": self.ledger.state_dict(),
            "goodput": self.goodput.state_dict(wall, uptime),
            "checkpoints": self.checkpoints + 1,
            "config": self.config.to_dict(),
        }

    async def checkpoint(self) -> None:
        """Snapshot now and write it atomically (after any write already under way)."""
        path = self.checkpoint_path
        if path is None:
            return
        async with self._checkpoint_lock:
            core_state = await self._core(lambda now: self.core.state_dict())
            state = {"core": core_state, "service": self._service_state(time.monotonic())}
            self._rounds_since_checkpoint = 0
            self._last_checkpoint_s = time.monotonic()
            started = time.perf_counter()
            size = await asyncio.to_thread(save_checkpoint, path, state)
            self.checkpoints += 1
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            log.debug("checkpoint %d written (%d bytes, versions %s)", self.checkpoints, size,
                      [f["version"] for f in core_state["fragments"]])

    def _checkpoint_due(self, now: float) -> bool:
        if self.checkpoint_path is None or self._rounds_since_checkpoint == 0:
            return False
        if self._rounds_since_checkpoint >= self.options.checkpoint_every_rounds:
            return True
        last = self._last_checkpoint_s if self._last_checkpoint_s is not None else self._process_start_s
        return now - last >= self.options.checkpoint_every_s

    # ---- the core, on its own thread -------------------------------------------------------

    async def _core(self, fn: Callable[[float], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(time.monotonic()))

    async def _core_timed(self, fn: Callable[[float], list[Any]]) -> tuple[list[Any], float]:
        def timed(now: float) -> tuple[list[Any], float]:
            started = time.perf_counter()
            actions = fn(now)
            return actions, time.perf_counter() - started

        return await self._core(timed)

    def _handle(self, actions: list[Any], compute_s: float = 0.0) -> None:
        """Carry out the core's actions on the event loop."""
        started = time.perf_counter()
        merged = False
        for action in actions:
            if isinstance(action, RoundClosed):
                merged = True
                if self._last_merge_s is not None and not self.stopping:
                    self.longest_pause_s = max(self.longest_pause_s, action.closed_at_s - self._last_merge_s)
                self._last_merge_s = action.closed_at_s
                self._rounds_since_checkpoint += 1
                self.metrics.rounds.labels(action.reason).inc()
                self.metrics.versions.labels(str(action.fragment)).set(action.version)
                for mc in action.merged:
                    arrived = self._arrivals.pop((mc.learner_id, action.fragment), action.closed_at_s)
                    self.goodput.credit(mc.compute_s, self._share[action.fragment], arrived)
                log.debug("fragment %d -> v%d (%s, %d contributions)", action.fragment, action.version,
                          action.reason, len(action.merged))
            elif isinstance(action, Broadcast):
                self._broadcast(action)
            elif isinstance(action, LeaseExpired):
                if action.learner_id not in self._left:
                    log.info("learner %s: lease expired", action.learner_id)
                sub = self._subscribers.pop(action.learner_id, None)
                if sub is not None:
                    sub.queue.put_nowait(_CLOSE)
        if merged:
            elapsed = compute_s + time.perf_counter() - started
            self.metrics.merge_seconds.observe(elapsed)
            self._pool.submit(self.core.observe_sync_time, elapsed)
        if self._wake is not None:
            self._wake.set()

    def _broadcast(self, action: Broadcast) -> None:
        update = action.update
        chunks = _update_chunks(update)
        recent, versions = self._recent[update.fragment], self._recent_versions[update.fragment]
        recent.append(chunks)
        versions.append(update.version)
        while len(recent) > 1 and sum(len(c) for chunk_list in recent for c in chunk_list) > REPLAY_BYTES:
            recent.popleft()
            versions.popleft()
        for name in action.recipients:
            sub = self._subscribers.get(name)
            if sub is None:
                continue  # not listening right now: it replays or rejoins when it resubscribes
            if sub.backlog >= STREAM_BACKLOG:
                log.warning("learner %s: update stream too slow, closing it", name)
                self._subscribers.pop(name, None)
                sub.queue.put_nowait(_CLOSE)
                continue
            sub.backlog += 1
            sub.queue.put_nowait((update.fragment, chunks))

    # ---- boundary checks -------------------------------------------------------------------

    def _admit(self, context: grpc.aio.ServicerContext, learner: str | None = None) -> None:
        metadata = context.invocation_metadata()
        if not token_matches(metadata, self.options.token):
            raise _Abort("unauthenticated", "missing or wrong auth token")
        for key, value in metadata or ():
            if key == PROTOCOL_HEADER and str(value) != str(PROTOCOL_VERSION):
                raise _Abort("bad_protocol_version",
                             f"client speaks protocol {value}, this synchronizer speaks {PROTOCOL_VERSION}")

    @staticmethod
    def _parse(message_type: type[M], raw: bytes) -> M:
        try:
            return message_type.FromString(raw)
        except (DecodeError, RuntimeWarning, ValueError) as err:
            raise _Abort("malformed", f"cannot parse {message_type.__name__}: {err}") from None

    async def _reject(self, context: grpc.aio.ServicerContext, reason: str, detail: str,
                      learner: str | None = None, *, counted: bool = False) -> None:
        if not counted:
            self.wire_rejections[reason] += 1
            if learner:
                self.learner_wire_rejected[learner] += 1
        self.metrics.rejections.labels(reason).inc()
        code = _STATUS_CODES.get(reason, grpc.StatusCode.INVALID_ARGUMENT)
        log.info("rejected %s%s: %s", reason, f" from {learner}" if learner else "", detail)
        await context.abort(code, f"{reason}: {detail}", trailing_metadata=((REASON_HEADER, reason),))

    def _out(self, learner: str, fragment: int, message: Message) -> bytes:
        data = message.SerializeToString()
        self.ledger.add(learner, fragment, "down", len(data))
        self.metrics.bytes.labels("down").inc(len(data))
        return data

    def _receive(self, context: grpc.aio.ServicerContext, message_type: type[M], raw: bytes) -> M:
        """Admit the caller, parse its request and count its bytes (raises :class:`_Abort`)."""
        self._admit(context)
        request = self._parse(message_type, raw)
        if hasattr(request, "learner_id"):  # status and state fetches are not a learner's traffic
            self._in(request.learner_id, -1, len(raw))
        return request

    def _in(self, learner: str, fragment: int, size: int) -> None:
        self.ledger.add(learner, fragment, "up", size)
        self.metrics.bytes.labels("up").inc(size)

    def _versions(self) -> list[int]:
        return list(self.core.versions())

    # ---- RPC handlers ----------------------------------------------------------------------

    async def join(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        learner = ""
        try:
            req = self._receive(context, pb.JoinRequest, raw)
            learner = req.learner_id
            header = pb.JoinHeader(
                instance_id=self.instance_id,
                protocol_json=json.dumps(asdict(self.protocol)),
                period=self.layout.plan.period,
                fragments=self.layout.to_proto(),
                finished=self.finished,
                layout_sha256=self.layout_sha256,
                heartbeat_s=self.protocol.heartbeat_interval_s,
                run_json=json.dumps(self.config.to_dict()),
            )
            if self.finished or req.probe:
                header.versions.extend(self._versions())
                if req.probe and learner:
                    header.learner_index = self._assign_index(learner)
                yield self._out(learner, -1, pb.JoinReply(header=header))
                return
            try:
                state = await self._core(lambda now: self.core.register(learner, now))
            except Rejected as err:
                await self._reject(context, err.reason, err.detail, learner or None)
                return
        except _Abort as err:
            await self._reject(context, err.reason, err.detail, learner or None)
            return
        self._left.discard(learner)
        if self._run_start_s is None:
            self._run_start_s = time.monotonic()
        header.learner_index = self._assign_index(learner)
        header.versions.extend(f.version for f in state.fragments)
        log.info("learner %s joined (index %d) at versions %s", learner, header.learner_index,
                 list(header.versions))
        self._wake_up()
        yield self._out(learner, -1, pb.JoinReply(header=header))
        for frag in state.fragments:
            for chunk in _state_chunks(frag.fragment, frag.version, frag.values):
                yield self._out(learner, frag.fragment, pb.JoinReply(chunk=chunk))

    def _report_progress(self, learner: str, tokens: int) -> None:
        """Tokens a learner trained (reported with heartbeats and contributions): the budget."""
        if tokens:
            self.tokens += tokens
            self.learner_tokens[learner] += tokens
            self._check_budget()

    def _assign_index(self, learner: str) -> int:
        """The learner's data shard: its trailing number if it has one, else the next free index."""
        if learner not in self.learner_index:
            m = self.config.run.learners
            match = re.search(r"(\d+)$", learner)
            used = set(self.learner_index.values())
            if match and int(match.group(1)) < m:
                index = int(match.group(1))
            else:
                free = [i for i in range(m) if i not in used]
                index = free[0] if free else len(self.learner_index) % m
            self.learner_index[learner] = index
        return self.learner_index[learner]

    async def heartbeat(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = self._receive(context, pb.HeartbeatRequest, raw)
        except _Abort as err:
            await self._reject(context, err.reason, err.detail)
            return b""
        learner = req.learner_id
        self._report_progress(learner, req.tokens)
        try:
            await self._core(lambda now: self.core.heartbeat(learner, now))
        except Rejected as err:
            # Expected after a lease expiry or a synchronizer restart: the learner joins again.
            await context.abort(_STATUS_CODES.get(err.reason, grpc.StatusCode.INVALID_ARGUMENT),
                                f"{err.reason}: {err.detail}", trailing_metadata=((REASON_HEADER, err.reason),))
            return b""
        self._wake_up()
        return self._out(learner, -1, pb.HeartbeatReply(stop=self.stopping, versions=self._versions()))

    async def contribute(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        learner = ""
        fragment = -1
        header: pb.ContributionHeader | None = None
        payload = bytearray()
        try:
            self._admit(context)
            async for raw in requests:
                chunk = self._parse(pb.ContributionChunk, raw)
                if header is None:
                    if not chunk.HasField("header"):
                        raise _Abort("chunk_assembly", "the first chunk carries no header")
                    header = chunk.header
                    learner, fragment = header.learner_id, int(header.fragment)
                    self._report_progress(learner, header.trained_tokens)
                    if header.payload_bytes > self._max_payload:
                        raise _Abort("too_large", f"{header.payload_bytes} payload bytes, at most "
                                     f"{self._max_payload} accepted")
                elif chunk.HasField("header"):
                    raise _Abort("chunk_assembly", "a header in a chunk after the first")
                self._in(learner, fragment, len(raw))
                if chunk.offset != len(payload):
                    raise _Abort("chunk_assembly", f"chunk at offset {chunk.offset}, expected {len(payload)}")
                if len(payload) + len(chunk.data) > header.payload_bytes:
                    raise _Abort("chunk_assembly", f"more than the announced {header.payload_bytes} bytes")
                payload += chunk.data
            if header is None:
                raise _Abort("chunk_assembly", "empty upload")
            if len(payload) != header.payload_bytes:
                raise _Abort("chunk_assembly", f"upload ended after {len(payload)} of {header.payload_bytes} bytes")
            if self.finished:
                raise _Abort("finished", "the run is over")
            try:
                contribution = Contribution(
                    learner_id=learner,
                    fragment=fragment,
                    base_version=int(header.base_version),
                    seq=int(header.seq),
                    tokens=int(header.tokens),
                    steps=int(header.steps),
                    compute_s=float(header.compute_s),
                    step_time_s=float(header.step_time_s),
                    codec=header.codec,
                    payload=bytes(payload),
                    first_step=int(header.first_step),
                )
            except ValueError as err:
                raise _Abort("malformed", str(err)) from None
        except _Abort as err:
            await self._reject(context, err.reason, err.detail, learner or None)
            return b""
        try:
            actions, compute_s = await self._core_timed(lambda now: self.core.contribute(contribution, now))
        except Rejected as err:
            self.metrics.contributions.labels(err.reason).inc()
            await self._reject(context, err.reason, err.detail, learner, counted=True)
            return b""
        self.metrics.contributions.labels("accepted").inc()
        self._arrivals[(learner, fragment)] = time.monotonic()
        self._handle(actions, compute_s)
        await self._after_rounds()
        return self._out(learner, -1, pb.ContributeReply(versions=self._versions(), stop=self.stopping))

    async def updates(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        learner = ""
        try:
            req = self._receive(context, pb.UpdatesRequest, raw)
            learner = req.learner_id
            if req.instance_id and req.instance_id != self.instance_id:
                raise _Abort("unknown_learner", "the synchronizer restarted: join again")
            if not await self._core(lambda now: learner in self.core.alive()):
                raise _Abort("unknown_learner", f"learner {learner!r} holds no lease: join first")
        except _Abort as err:
            if err.reason != "unknown_learner":
                await self._reject(context, err.reason, err.detail, learner or None)
            # Not counted: joining again is the normal way back after a lease expiry or a restart.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err),
                                trailing_metadata=((REASON_HEADER, err.reason),))
            return
        sub = _Subscriber()
        previous = self._subscribers.get(learner)
        if previous is not None:
            previous.queue.put_nowait(_CLOSE)
        self._subscribers[learner] = sub
        try:
            have = list(req.have_versions)
            for p, (versions, updates) in enumerate(zip(self._recent_versions, self._recent)):
                held = have[p] if p < len(have) else 0
                for version, chunks in zip(list(versions), list(updates)):
                    if version > held:
                        for data in chunks:
                            self.ledger.add(learner, p, "down", len(data))
                            yield data
            if self.stopping:
                yield self._out(learner, -1, pb.Update(stop=True))
            while True:
                item = await sub.queue.get()
                if item is _CLOSE:
                    return
                if item == "stop":
                    yield self._out(learner, -1, pb.Update(stop=True))
                    continue
                sub.backlog -= 1
                p, chunks = item
                for data in chunks:
                    self.ledger.add(learner, p, "down", len(data))
                    self.metrics.bytes.labels("down").inc(len(data))
                    yield data
        finally:
            if self._subscribers.get(learner) is sub:
                del self._subscribers[learner]

    async def fetch_state(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            self._receive(context, pb.FetchStateRequest, raw)
        except _Abort as err:
            await self._reject(context, err.reason, err.detail)
            return
        state = await self._core(lambda now: self.core.global_state())
        for frag in state.fragments:
            for chunk in _state_chunks(frag.fragment, frag.version, frag.values):
                yield chunk.SerializeToString()

    async def leave(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = self._receive(context, pb.LeaveRequest, raw)
        except _Abort as err:
            await self._reject(context, err.reason, err.detail)
            return b""
        learner = req.learner_id
        self._left.add(learner)
        try:
            actions = await self._core(lambda now: self.core.leave(learner, now))
        except Rejected:
            actions = []  # already gone: leaving is idempotent
        log.info("learner %s left", learner)
        self._handle(actions)
        sub = self._subscribers.pop(learner, None)
        if sub is not None:
            sub.queue.put_nowait(_CLOSE)
        await self._after_rounds()
        return self._out(learner, -1, pb.LeaveReply())

    async def status(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            self._receive(context, pb.StatusRequest, raw)
        except _Abort as err:
            await self._reject(context, err.reason, err.detail)
            return b""
        return (await self.status_reply()).SerializeToString()

    async def status_reply(self) -> pb.StatusReply:
        core = await self._core(self._core_snapshot)
        now = time.monotonic()
        reply = pb.StatusReply(
            instance_id=self.instance_id,
            protocol_version=PROTOCOL_VERSION,
            uptime_s=now - self._process_start_s,
            quorum=self.protocol.quorum,
            effective_quorum=core["effective_quorum"],
            grace_window_s=core["grace_window_s"],
            grace_quorum_s=core["grace_quorum_s"],
            grace_sync_s=core["grace_sync_s"],
            bytes_up=self.ledger.total("up"),
            bytes_down=self.ledger.total("down"),
            tokens=self.tokens,
            token_budget=self.config.run.tokens,
            finished=self.finished,
            checkpoints=self.checkpoints,
            last_checkpoint_s_ago=-1.0 if self._last_checkpoint_s is None else now - self._last_checkpoint_s,
            mode=self.config.run.mode,
            longest_pause_s=self.longest_pause_s,
        )
        if self._run_start_s is not None:
            end = self._finish_s if self._finish_s is not None else now
            reply.goodput = self.goodput.goodput(end - self._run_start_s)
            reply.model_uptime = self.goodput.uptime(self._run_start_s, end)
        up_by_learner, down_by_learner = self.ledger.by(0, "up"), self.ledger.by(0, "down")
        for rec in core["learners"]:
            name = rec["id"]
            reply.learners.append(pb.LearnerStatus(
                id=name,
                alive=rec["alive"],
                last_seen_s_ago=now - rec["last_seen_s"] if rec["last_seen_s"] else -1.0,
                accepted=rec["accepted"],
                rejected=rec["rejected"] + self.learner_wire_rejected.get(name, 0),
                registrations=rec["registrations"],
                tokens=self.learner_tokens.get(name, 0),
                bytes_up=up_by_learner.get(name, 0),
                bytes_down=down_by_learner.get(name, 0),
                step_time_s=rec["step_time_s"] or 0.0,
            ))
        up_by_frag, down_by_frag = self.ledger.by(1, "up"), self.ledger.by(1, "down")
        for index, (version, f) in enumerate(zip(core["versions"], self.layout.plan.fragments)):
            reply.fragments.append(pb.FragmentStatus(
                id=index, version=version, numel=f.numel,
                bytes_up=up_by_frag.get(index, 0), bytes_down=down_by_frag.get(index, 0),
            ))
        for key, count in sorted(core["rounds_closed"].items()):
            reply.rounds_closed.append(pb.CountEntry(key=key, count=count))
        rejections = collections.Counter(core["rejections"]) + self.wire_rejections
        for key, count in sorted(rejections.items()):
            reply.rejections.append(pb.CountEntry(key=key, count=count))
        return reply

    def _core_snapshot(self, now: float) -> dict[str, Any]:
        """Plain copies of what status reports from the core (runs on the core thread)."""
        core = self.core
        return {
            "versions": list(core.versions()),
            "learners": [
                {"id": name, "alive": rec.alive, "last_seen_s": rec.last_seen_s, "accepted": rec.accepted,
                 "rejected": rec.rejected, "registrations": rec.registrations, "step_time_s": rec.step_time_s}
                for name, rec in sorted(core.learners.items())
            ],
            "effective_quorum": core.effective_quorum(),
            "grace_window_s": core.grace_length_s(),
            "grace_quorum_s": core.grace.quorum_s.get(),
            "grace_sync_s": core.grace.sync_s.get(),
            "rounds_closed": dict(core.rounds_closed),
            "rejections": dict(core.rejections),
        }

    # ---- budget, end of run, timers --------------------------------------------------------

    def _check_budget(self) -> None:
        if self.stopping:
            return
        run = self.config.run
        now = time.monotonic()
        spent_tokens = bool(run.tokens) and self.tokens >= run.tokens
        spent_time = bool(run.time_s) and self._run_start_s is not None and now - self._run_start_s >= run.time_s
        if spent_tokens or spent_time:
            self.stopping = True
            self._stop_at_s = now
            log.info("budget spent (%d tokens): asking learners to flush and leave", self.tokens)
            for sub in self._subscribers.values():
                sub.queue.put_nowait("stop")
            self._wake_up()

    async def _maybe_finish(self) -> None:
        if not self.stopping or self.finished:
            return
        now = time.monotonic()
        timeout = self.options.drain_timeout_s
        if timeout is None:
            timeout = 2 * self.protocol.lease_s
        alive = await self._core(lambda now: self.core.alive())
        if alive and now - (self._stop_at_s or now) < timeout:
            return
        actions, compute_s = await self._core_timed(lambda now: self.core.drain(now))
        self._handle(actions, compute_s)
        self.finished = True
        self._finish_s = time.monotonic()
        log.info("run finished: %d tokens, fragment versions %s", self.tokens, self._versions())
        await self.checkpoint()

    async def _after_rounds(self) -> None:
        if self._checkpoint_due(time.monotonic()):
            self._checkpoint_soon()

    def _checkpoint_soon(self) -> None:
        if not self._checkpoint_lock.locked():
            self._checkpoint_task = asyncio.ensure_future(self.checkpoint())

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _timer_loop(self) -> None:
        """Call ``tick`` at the core's next deadline (at least every second)."""
        assert self._wake is not None and self._closing is not None
        while not self._closing.is_set():
            deadline = await self._core(lambda now: self.core.next_deadline())
            wait_s = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            self._wake.clear()
            actions, compute_s = await self._core_timed(lambda now: self.core.tick(now))
            if actions:
                self._handle(actions, compute_s)
            self._check_budget()
            await self._maybe_finish()
            if self._checkpoint_due(time.monotonic()):
                self._checkpoint_soon()
            self.metrics.alive.set(len(await self._core(lambda now: self.core.alive())))

    # ---- serving ---------------------------------------------------------------------------

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Join": grpc.unary_stream_rpc_method_handler(self.join),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self.heartbeat),
            "Contribute": grpc.stream_unary_rpc_method_handler(self.contribute),
            "Updates": grpc.unary_stream_rpc_method_handler(self.updates),
            "FetchState": grpc.unary_stream_rpc_method_handler(self.fetch_state),
            "Leave": grpc.unary_unary_rpc_method_handler(self.leave),
            "Status": grpc.unary_unary_rpc_method_handler(self.status),
        })

    async def start(self, listen: Address, credentials: grpc.ServerCredentials | None = None) -> int:
        """Bind and start serving; returns the port (useful with port 0)."""
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers([self.handlers()])
        target = str(listen)
        try:
            if credentials is None:
                port = self._server.add_insecure_port(target)
            else:
                port = self._server.add_secure_port(target, credentials)
        except RuntimeError as err:
            raise ConfigError(f"cannot listen on {target}: {err}") from None
        if port == 0:
            raise ConfigError(f"cannot listen on {target} (address in use?)")
        await self._server.start()
        self.port = port
        self._timer = asyncio.ensure_future(self._timer_loop())
        log.info("synchronizer %s listening on %s:%d (%s, M=%d, %d fragments, instance %s)",
                 "resumed" if self.checkpoints else "started", listen.host, port, self.config.run.mode,
                 self.config.run.learners, len(self.layout.plan.fragments), self.instance_id[:8])
        return port

    async def wait_closed(self) -> None:
        assert self._closing is not None
        await self._closing.wait()

    def request_stop(self) -> None:
        if self._closing is not None:
            self._closing.set()

    async def stop(self) -> None:
        """Final checkpoint, then close every stream and the port."""
        self.request_stop()
        if hasattr(self, "_timer"):
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        with contextlib.suppress(Exception):
            await self.checkpoint()
        for sub in self._subscribers.values():
            sub.queue.put_nowait(_CLOSE)
        await self._server.stop(grace=1.0)
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _state_chunks(fragment: int, version: int, values: torch.Tensor) -> Iterable[pb.StateChunk]:
    data = memoryview(values.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())
    total = len(data)
    for offset in range(0, max(total, 1), CHUNK_BYTES):
        yield pb.StateChunk(fragment=fragment, version=version, offset=offset, total_bytes=total,
                            data=bytes(data[offset : offset + CHUNK_BYTES]))


def _update_chunks(update: FragmentUpdate) -> list[bytes]:
    data = memoryview(update.payload)
    total = len(data)
    return [
        pb.Update(fragment=update.fragment, version=update.version, codec=update.codec, offset=offset,
                  total_bytes=total, data=bytes(data[offset : offset + CHUNK_BYTES])).SerializeToString()
        for offset in range(0, max(total, 1), CHUNK_BYTES)
    ]


async def serve(
    service: SyncService,
    listen: Address,
    *,
    credentials: grpc.ServerCredentials | None = None,
    port_file: Path | None = None,
    exit_when_finished: bool = False,
) -> None:
    """Run ``service`` until SIGINT/SIGTERM (or the end of the run with ``exit_when_finished``)."""
    port = await service.start(listen, credentials)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.request_stop)
    loop.add_signal_handler(signal.SIGUSR2, _dump_tasks)
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, port_file)
    try:
        if exit_when_finished:
            while not service.finished and not service._closing.is_set():  # noqa: SLF001
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(service.wait_closed(), 0.2)
        else:
            await service.wait_closed()
    finally:
        log.info("shutting down")
        await service.stop()


def layout_from_file(path: str | Path, protocol: ProtocolConfig) -> ModelLayout:
    """Serve your own model: initial weights written by ``learner_runtime.save_initial_state``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            params = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"--init {str(path)!r}: cannot read initial weights ({err})") from None
    try:
        embedding_names = json.loads(metadata.get("embedding_names", "[]"))
    except json.JSONDecodeError:
        raise ConfigError(f"--init {str(path)!r}: bad embedding_names metadata") from None
    return model_layout(protocol, params.items(), embedding_names)


def _dump_tasks() -> None:
    """``kill -USR2 PID``: log where every asyncio task of the service is waiting."""
    import io

    for task in asyncio.all_tasks():
        out = io.StringIO()
        task.print_stack(file=out)
        log.warning("task %s:\n%s", task.get_name(), out.getvalue())
