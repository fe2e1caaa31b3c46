"""The synchronizer as a gRPC service: the handlers, and what the service itself counts.

The protocol is the core's (:class:`~ddiloco.core.synchronizer.Synchronizer`, run by
:class:`~ddiloco.runtime.core_host.SyncHost` on its own thread); this module only moves
bytes in and out of it:

- it checks what the core cannot see: the auth token, the protocol version, protobuf
  syntax, chunk assembly and the size of an upload (wire-level rejections, counted here);
  everything else is the core's decision, answered with the reason the core gave;
- it converts messages with :mod:`ddiloco.runtime.wire`, serves update streams
  (:mod:`ddiloco.runtime.streams`) and writes the checkpoints the core asks for
  (:mod:`ddiloco.runtime.state_dir`);
- it counts bytes per learner, fragment and direction, goodput, and Prometheus metrics.

Requests are parsed by the service itself (the handlers receive raw bytes), so that a
malformed message is counted and answered with a named reason instead of a generic error.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import re
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import grpc

from ddiloco.config import Config
from ddiloco.core.actions import Admitted, Finished, LeaseExpired, Refused, RoundClosed, StopLearners, SyncAction
from ddiloco.core.config import Mode
from ddiloco.core.messages import RejectReason
from ddiloco.core.run import RunLimits, RunPhase
from ddiloco.core.synchronizer import Synchronizer
from ddiloco.errors import ConfigError
from ddiloco.runtime import wire
from ddiloco.runtime.auth import REASON_HEADER
from ddiloco.runtime.checkpoint import CheckpointError
from ddiloco.runtime.boundary import Abort, Boundary
from ddiloco.runtime.core_host import SyncHost
from ddiloco.runtime.layout import ModelLayout, reference_layout
from ddiloco.runtime.metrics import ByteLedger, GoodputMeter, ServiceMetrics
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.state_dir import StateDir
from ddiloco.runtime.status_reply import status_reply
from ddiloco.runtime.streams import StreamItem, UpdateStreams

log = logging.getLogger("ddiloco.sync")

SERVICE_NAME = "ddiloco.v2.Synchronizer"



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
    clock: Callable[[], float] = time.monotonic
    """The core's clock (tests drive a service with a clock of their own)."""
    shard: int = 0
    """Which shard of a synchronizer sharded by fragment (``protocol.shards``) this process is."""


class SyncService:
    """Serves one run: handlers around a core host, its streams, state directory and counters."""

    def __init__(self, config: Config, options: ServiceOptions, *, layout: ModelLayout | None = None) -> None:
        if not Mode(config.run.mode).uses_protocol:
            raise ConfigError(f"the synchronizer serves modes decoupled and diloco, not {config.run.mode!r}")
        self.config = config
        self.options = options
        self.protocol = config.protocol.for_mode(config.run.mode, config.run.learners)
        if not 0 <= options.shard < self.protocol.shards:
            raise ConfigError(f"--shard {options.shard}/{self.protocol.shards}: the shard index must be in "
                              f"[0, {self.protocol.shards})")
        self.shard = options.shard
        self.layout = layout or reference_layout(config, self.protocol)
        self.layout_sha256 = self.layout.sha256(self.protocol)
        # Every shard of one run serves the same model and configuration; learners check this.
        self.run_sha256 = hashlib.sha256((self.layout_sha256 + json.dumps(config.to_dict(), sort_keys=True))
                                         .encode()).hexdigest()
        self.incarnation = secrets.randbits(48)
        checkpoints = options.state_dir is not None
        limits = RunLimits(
            tokens=0 if config.run.time_s else config.run.tokens,
            time_s=config.run.time_s,
            drain_timeout_s=2 * self.protocol.lease_s if options.drain_timeout_s is None else options.drain_timeout_s,
            checkpoint_every_rounds=options.checkpoint_every_rounds if checkpoints else 0,
            checkpoint_every_s=options.checkpoint_every_s if checkpoints else 0.0,
        )
        self.core = Synchronizer(
            self.protocol, self.layout.initial_values,
            embedding_fragments=[f.index for f in self.layout.plan.fragments if f.is_embedding],
            limits=limits, incarnation=self.incarnation, shard=self.shard,
        )
        owned = [self.layout.plan.fragments[p] for p in self.core.owned]
        self.layout = replace(self.layout, initial_values=[])  # the core holds the owned values
        total = sum(f.numel for f in self.layout.plan.fragments)
        self._share = [f.numel / total for f in self.layout.plan.fragments]
        self.metrics = ServiceMetrics()
        self.ledger = ByteLedger()
        self.boundary = Boundary(options.token, max(4 * f.numel for f in owned), self.metrics, self.ledger)
        self.goodput = GoodputMeter(learners=config.run.learners)
        self.learner_index: dict[str, int] = {}
        self.checkpoints = 0
        self.port: int | None = None
        self.process_start_s = time.monotonic()
        self.first_join_s: float | None = None
        self.last_checkpoint_s: float | None = None
        self._writes: set[asyncio.Task] = set()
        self._write_lock: asyncio.Lock | None = None
        self.state_dir = None if options.state_dir is None else StateDir(options.state_dir, resume=options.resume)
        if self.state_dir is not None:
            try:
                saved = self.state_dir.load()
                if saved is not None:
                    self._restore(saved)
                    log.info("resumed from %s: fragment versions %s", self.state_dir.checkpoint_path,
                             list(self.core.versions()))
                elif options.resume:
                    log.info("no checkpoint in %s: starting a new run", options.state_dir)
            except BaseException:
                self.state_dir.close()
                raise
        self.streams = UpdateStreams(len(self.layout.plan.fragments))
        self.host: SyncHost | None = None

    @property
    def finished(self) -> bool:
        return self.core.phase is RunPhase.FINISHED

    # ---- checkpoints ---------------------------------------------------------------------

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
        self.learner_index = {k: int(v) for k, v in service["learner_index"].items()}
        self.boundary.rejections = collections.Counter({k: int(v) for k, v in service["wire_rejections"].items()})
        self.boundary.learner_rejected = collections.Counter(
            {k: int(v) for k, v in service["learner_wire_rejected"].items()})
        self.ledger.load_state_dict(service["bytes"])
        self.goodput.load_state_dict(service["goodput"])
        self.checkpoints = int(service["checkpoints"])

    def _service_state(self) -> dict[str, Any]:
        now = time.monotonic()
        wall = 0.0 if self.first_join_s is None else now - self.first_join_s
        uptime = 0.0 if self.first_join_s is None else self.goodput.uptime(self.first_join_s, now)
        return {
            "layout_sha256": self.layout_sha256,
            "learner_index": dict(self.learner_index),
            "wire_rejections": dict(self.boundary.rejections),
            "learner_wire_rejected": dict(self.boundary.learner_rejected),
            "bytes": self.ledger.state_dict(),
            "goodput": self.goodput.state_dict(wall, uptime),
            "checkpoints": self.checkpoints + 1,
            "config": self.config.to_dict(),
        }

    def on_checkpoint(self, core_state: dict[str, Any]) -> None:
        """The core asks for a checkpoint: write it in the background (one write at a time)."""
        if self.state_dir is None:
            return
        state = {"core": core_state, "service": self._service_state()}
        task = asyncio.ensure_future(self._write(state))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, state: dict[str, Any]) -> None:
        assert self.state_dir is not None and self._write_lock is not None
        async with self._write_lock:
            started = time.perf_counter()
            size = await asyncio.to_thread(self.state_dir.save, state)
            self.checkpoints += 1
            self.last_checkpoint_s = time.monotonic()
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            log.debug("checkpoint %d written (%d bytes)", self.checkpoints, size)

    async def checkpoint(self) -> None:
        """Snapshot now and write it (after any write already under way)."""
        if self.state_dir is None or self.host is None:
            return
        core_state = await self.host.query(lambda core: core.state_dict(self.options.clock()))
        self.on_checkpoint(core_state)
        await asyncio.gather(*list(self._writes))

    # ---- what the host reports -------------------------------------------------------------

    def on_round(self, record: RoundClosed, elapsed_s: float) -> None:
        self.metrics.rounds.labels(str(record.reason)).inc()
        self.metrics.versions.labels(str(record.fragment)).set(record.version)
        if len(record.merged) >= 2:
            self.metrics.coherence.labels(str(record.fragment)).set(record.coherence)
        self.metrics.merge_seconds.observe(elapsed_s)
        for mc in record.merged:
            self.goodput.credit(mc.compute_s, self._share[record.fragment], mc.arrived_s)
        log.debug("fragment %d -> v%d (%s, %d contributions)", record.fragment, record.version, record.reason,
                  len(record.merged))

    def on_event(self, actions: list[SyncAction]) -> None:
        self.metrics.alive.set(len(self.core.alive()))
        for action in actions:
            if isinstance(action, Admitted) and self.first_join_s is None:
                self.first_join_s = time.monotonic()
            elif isinstance(action, StopLearners):
                log.info("budget spent: asking learners %s to flush and leave", ", ".join(action.recipients) or "-")
            elif isinstance(action, LeaseExpired):
                log.info("learner %s: lease expired", action.learner_id)
            elif isinstance(action, Finished):
                log.info("run finished: %d tokens, fragment versions %s", self.core.status().tokens,
                         list(self.core.versions()))

    def _header(self, learner: str) -> pb.JoinHeader:
        return pb.JoinHeader(
            incarnation=self.incarnation,
            protocol_json=json.dumps(asdict(self.protocol)),
            period=self.layout.plan.period,
            fragments=self.layout.to_proto(),
            finished=self.finished,
            layout_sha256=self.layout_sha256,
            run_json=json.dumps(self.config.to_dict()),
            shard=self.shard,
            shards=self.protocol.shards,
            run_sha256=self.run_sha256,
            learner_index=self._assign_index(learner) if learner else 0,
        )

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

    # ---- RPC handlers ----------------------------------------------------------------------

    async def join(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        learner = ""
        try:
            req = self.boundary.receive(context, pb.JoinRequest, raw)
            learner = req.learner_id
            if req.probe:
                header = self._header(learner)
                header.versions.extend(self.core.versions())
                yield self.boundary.out(learner, -1, pb.JoinReply(header=header))
                return
            try:
                join = wire.join_from_pb(req)
            except wire.WireError as err:
                raise Abort(RejectReason.MALFORMED, str(err)) from None
        except Abort as err:
            await self.boundary.reject(context, err.reason, err.detail, learner or None)
            return
        reply = await self._host.handle(join)
        if isinstance(reply, Refused):
            await self.boundary.refused(context, reply)
            return
        assert isinstance(reply, Admitted) and reply.state.session is not None
        header = self._header(learner)
        header.session.CopyFrom(wire.session_to_pb(reply.state.session))
        header.stop = reply.stop
        header.versions.extend(reply.state.versions())
        log.info("learner %s joined (index %d, session %s) at versions %s", learner, header.learner_index,
                 reply.state.session, list(header.versions))
        yield self.boundary.out(learner, -1, pb.JoinReply(header=header))
        for chunk in wire.state_chunks(reply.state):
            yield self.boundary.out(learner, chunk.fragment, pb.JoinReply(chunk=chunk))

    async def heartbeat(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = self.boundary.receive(context, pb.HeartbeatRequest, raw)
            beat = wire.heartbeat_from_pb(req)
        except (Abort, wire.WireError) as err:
            await self.boundary.wire_error(context, err)
            return b""
        reply = await self._host.handle(beat)
        if isinstance(reply, Refused):
            await self.boundary.refused(context, reply)
            return b""
        return self.boundary.out(beat.learner_id, -1, pb.HeartbeatReply(stop=reply.stop))

    async def contribute(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        learner = ""
        try:
            contribution = await self.boundary.assemble(requests, context)
            learner = contribution.learner_id
        except Abort as err:
            await self.boundary.reject(context, err.reason, err.detail, err.learner)
            return b""
        reply = await self._host.handle(contribution)
        if isinstance(reply, Refused):
            self.metrics.contributions.labels(str(reply.reason)).inc()
            await self.boundary.refused(context, reply)
            return b""
        self.metrics.contributions.labels("accepted").inc()
        return self.boundary.out(learner, -1, pb.ContributeReply(stop=reply.stop))

    async def updates(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        learner = ""
        try:
            req = self.boundary.receive(context, pb.UpdatesRequest, raw)
            learner = req.learner_id
            session = wire.session_from_pb(req.session)
        except (Abort, ValueError) as err:
            await self.boundary.wire_error(context, err, learner)
            return
        if not await self._host.query(lambda core: core.holds_session(learner, session)):
            # Not counted: joining again is the normal way back after a lease expiry or a restart.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"unknown_learner: no live session {session} for {learner!r}: join again",
                                trailing_metadata=((REASON_HEADER, str(RejectReason.UNKNOWN_LEARNER)),))
            return
        sub = self.streams.subscribe(learner)
        try:
            for p, chunks in self.streams.replay(list(req.have_versions)):
                for data in chunks:
                    self.ledger.add(learner, p, "down", len(data))
                    yield data
            if self.core.phase in (RunPhase.STOPPING, RunPhase.FINISHED):
                yield self.boundary.out(learner, -1, pb.Update(stop=True))
            while True:
                item = await sub.queue.get()
                if item is StreamItem.CLOSE:
                    return
                if item is StreamItem.STOP:
                    yield self.boundary.out(learner, -1, pb.Update(stop=True))
                    continue
                sub.backlog -= 1
                p, chunks = item
                for data in chunks:
                    self.ledger.add(learner, p, "down", len(data))
                    self.metrics.bytes.labels("down").inc(len(data))
                    yield data
        finally:
            self.streams.unsubscribe(learner, sub)

    async def fetch_state(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            self.boundary.receive(context, pb.FetchStateRequest, raw)
        except Abort as err:
            await self.boundary.reject(context, err.reason, err.detail)
            return
        state = await self._host.query(lambda core: core.global_state())
        for chunk in wire.state_chunks(state):
            yield chunk.SerializeToString()

    async def leave(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = self.boundary.receive(context, pb.LeaveRequest, raw)
            leave = wire.leave_from_pb(req)
        except (Abort, wire.WireError) as err:
            await self.boundary.wire_error(context, err)
            return b""
        await self._host.handle(leave)  # a refusal means the session had ended already: leaving is idempotent
        log.info("learner %s left", leave.learner_id)
        self.streams.close(leave.learner_id)
        return self.boundary.out(leave.learner_id, -1, pb.LeaveReply())

    async def status(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            self.boundary.receive(context, pb.StatusRequest, raw)
        except Abort as err:
            await self.boundary.reject(context, err.reason, err.detail)
            return b""
        return (await self.status_reply()).SerializeToString()

    async def status_reply(self) -> pb.StatusReply:
        now = self.options.clock()
        core = await self._host.query(lambda c: c.status())
        return status_reply(self, core, now)

    # ---- serving ---------------------------------------------------------------------------

    @property
    def _host(self) -> SyncHost:
        assert self.host is not None, "the service is not started"
        return self.host

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

    def start_host(self) -> SyncHost:
        """Create the core host on the running event loop (``serve`` does this; tests may too)."""
        self._write_lock = asyncio.Lock()
        self.host = SyncHost(self.core, self.streams, self, clock=self.options.clock)
        self.host.start()
        return self.host

    async def stop(self) -> None:
        """Stop the timer, write the final checkpoint, close every stream, stop the host."""
        if self.host is not None:
            await self.host.stop_timer()
            if self.host.failure is None:  # a core that failed mid-event may hold half an update
                await self.checkpoint()
            self.streams.close_all()
            await self.host.stop()
        if self.state_dir is not None:
            self.state_dir.close()
