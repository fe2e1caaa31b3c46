"""The synchronizer as a gRPC service: the handlers, and what the service itself counts.

The protocol is the core's (:class:`~ddiloco.core.sync_side.synchronizer.Synchronizer`, run by
:class:`~ddiloco.runtime.sync.core_host.SyncHost` on its own thread, the only one that touches
it); this module only moves bytes in and out of it:

- it checks what the core cannot see (:mod:`ddiloco.runtime.sync.boundary`): who is calling and
  that a learner speaks only for itself, the protocol version, protobuf syntax, chunk
  assembly and the size of an upload; everything else is the core's decision, answered with
  the reason the core gave;
- it bounds what callers may hold (:mod:`ddiloco.runtime.sync.call_limits`): calls per peer and
  in all, uploads and state transfers at once, a deadline on every stream;
- it converts messages with :mod:`ddiloco.runtime.wire`, serves update streams
  (:mod:`ddiloco.runtime.sync.streams`), writes the checkpoints the core asks for
  (:mod:`ddiloco.runtime.sync.checkpoint_writer`) and counts bytes, goodput and Prometheus metrics.

Requests are parsed by the service itself (the handlers receive raw bytes), so that a
malformed message is counted and answered with a named reason instead of a generic error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from ddiloco.core.shared.actions import Admitted, Refused, StateDelivered
from ddiloco.core.shared.deadlines import stop_deadline_s
from ddiloco.core.shared.errors import ConfigError
from ddiloco.core.shared.messages import RejectReason, Session, StopNotice
from ddiloco.core.shared.protocol_config import Mode
from ddiloco.core.sync_side.replay import replay_budget
from ddiloco.core.sync_side.status_snapshot import CoreView
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.measures.useful_work import fragment_shares
from ddiloco.measures.wire_bytes import ByteLedger
from ddiloco.runtime import wire
from ddiloco.runtime.auth import REASON_HEADER, Authenticator
from ddiloco.runtime.layout import ModelLayout, reference_layout
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.sync.boundary import Abort, Boundary
from ddiloco.runtime.sync.call_limits import CallLimits, within
from ddiloco.runtime.sync.checkpoint_writer import CheckpointWriter
from ddiloco.runtime.sync.core_host import SyncHost
from ddiloco.runtime.sync.memory import available_bytes, check_memory, shard_memory_plan
from ddiloco.runtime.sync.metrics import GoodputMeter, ServiceMetrics
from ddiloco.runtime.sync.resume import Resume
from ddiloco.runtime.sync.service_records import ServiceRecords
from ddiloco.runtime.sync.shutdown import StopDeadline
from ddiloco.runtime.sync.slice_parts import Part, SliceParts, part_of
from ddiloco.runtime.sync.state_copies import SharedCopies
from ddiloco.runtime.sync.state_dir import StateDir
from ddiloco.runtime.sync.status_reply import status_reply
from ddiloco.runtime.sync.streams import CLOSE, UpdateStreams
from ddiloco.runtime.sync.uploads import Uploads
from ddiloco.settings.config import Config

log = logging.getLogger("ddiloco.sync")

SERVICE_NAME = "ddiloco.v2.Synchronizer"


@dataclass(frozen=True, slots=True)
class ServiceOptions:
    """How the synchronizer process runs (what ``ddiloco sync`` takes besides the workload)."""

    state_dir: Path | None = None
    resume: Resume = Resume.NEW_RUN
    token: str | None = None
    credentials: dict[str, str] | None = None
    """Per-learner secrets (``--credentials``): each learner may speak only for itself."""
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
        limits = config.run_limits(checkpoint_every_rounds=options.checkpoint_every_rounds if checkpoints else 0,
                                   checkpoint_every_s=options.checkpoint_every_s if checkpoints else 0.0,
                                   drain_timeout_s=options.drain_timeout_s)
        check_memory(shard_memory_plan(self.protocol, self.layout.plan, self.shard, config.run.learners),
                     available_bytes())
        self.core = Synchronizer(
            self.protocol, self.layout.initial_values,
            embedding_fragments=[f.index for f in self.layout.plan.fragments if f.is_embedding],
            limits=limits, incarnation=self.incarnation, shard=self.shard, session_salt=secrets.randbits(64),
        )
        self.layout = replace(self.layout, initial_values=[])  # the core holds the owned values
        self.metrics = ServiceMetrics()
        self.ledger = ByteLedger()
        largest = max(self.layout.plan.fragments[p].numel for p in self.core.owned)
        self.boundary = Boundary(Authenticator(options.token, options.credentials),
                                 self.protocol.uplink().encoded_size(largest),
                                 len(self.layout.plan.fragments), self.metrics, self.ledger)
        self.calls = CallLimits(self.protocol, limits.max_learners)
        self.uploads = Uploads(self.boundary, self.calls, lambda: self._host)
        self.goodput = GoodputMeter(learners=config.run.learners)
        self.port: int | None = None
        self.process_start_s = time.monotonic()
        self._pending: set[asyncio.Future] = set()
        state_dir = None if options.state_dir is None else StateDir(options.state_dir, resume=options.resume)
        self.writer = CheckpointWriter(state_dir, self.metrics, self.core.owned,
                                       {"layout_sha256": self.layout_sha256, "shard": self.shard})
        self.records = ServiceRecords(config, self.protocol, incarnation=self.incarnation,
                                      layout_sha256=self.layout_sha256, core=self.core, boundary=self.boundary,
                                      ledger=self.ledger, goodput=self.goodput, metrics=self.metrics,
                                      writer=self.writer, view=lambda: self.view,
                                      share=fragment_shares(f.numel for f in self.layout.plan.fragments))
        if self.writer.restore(self.layout_sha256, self.records.restore, self.records.replay):
            log.info("resumed from %s: fragment versions %s (%d rounds from the round log after the checkpoint)",
                     options.state_dir, list(self.core.versions()), self.writer.replayed)
        elif options.resume is not Resume.NEW_RUN:
            log.info("no checkpoint in %s: starting a new run", options.state_dir)
        self.parts = SliceParts(self.layout, self.protocol.block_size)
        self.streams = UpdateStreams(len(self.layout.plan.fragments), replay_budget(self.core.state_bytes),
                                     self.parts.update)
        self.host: SyncHost | None = None
        self.copies = SharedCopies(lambda fn: self._host.query(fn), lambda: self._host.durable())
        self.stop_missed: list[str] = []  # what the last stop gave up waiting for (shutdown.py)

    @property
    def view(self) -> CoreView:
        """What the core's thread published after its latest event (the core itself before the host starts)."""
        return self.host.view if self.host is not None else self.core.view()

    @property
    def finished(self) -> bool:
        return self.view.finished

    async def checkpoint(self) -> None:
        """Snapshot now and write it (after any write already under way)."""
        if self.writer.state_dir is None or self.host is None:
            return
        core_meta = await self.host.query(lambda core: core.checkpoint_meta(self.options.clock()))
        self.records.on_checkpoint(core_meta)
        await self.writer.drain()

    def _header(self, data_shard: int) -> pb.JoinHeader:
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
            data_shard=data_shard,
        )

    # ---- RPC handlers ----------------------------------------------------------------------

    async def _guarded(self, context: grpc.aio.ServicerContext, work: Callable[[], Awaitable[Any]], *,
                       upload: bool = False) -> Any:
        """Run a handler's work in a call slot; a wire-level problem ends the call with its reason."""
        try:
            async with self.calls.call(context, upload=upload):
                return await work()
        except wire.WireError as err:
            await self.boundary.reject(context, RejectReason.MALFORMED, str(err))
        except Abort as err:
            await self.boundary.reject(context, err.reason, err.detail, err.learner)
        return None

    async def join(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        async def work() -> None:
            req = self.boundary.receive(context, pb.JoinRequest, raw)
            if req.probe:
                name = req.learner_id
                header = self._header(await self._host.query(lambda core: core.data_shard(name)))
                header.versions.extend(self.view.versions)
                await self.calls.write(context, self.boundary.out(req.learner_id, -1, pb.JoinReply(header=header)),
                                       "join")
                return
            join, part = wire.join_from_pb(req), part_of(req)
            async with self.calls.transfers.hold():
                reply = await self._host.handle(join)
                if isinstance(reply, Refused):
                    await self.boundary.refused(context, reply)
                    return
                assert isinstance(reply, Admitted)
                self.parts.worlds.pop(join.learner_id, None)
                if part is not None:  # a sharded learner: its other ranks fetch and follow under this session
                    self.parts.worlds[join.learner_id] = part[1]
                await self._send_state(context, reply, part)

        await self._guarded(context, work)

    async def _send_state(self, context: grpc.aio.ServicerContext, reply: Admitted, part: Part | None) -> None:
        """The header and the global state; the core hears whether it all went out (the lease waits till then)."""
        learner, session = reply.learner_id, reply.state.session
        assert session is not None
        header = self._header(reply.data_shard)
        header.session.CopyFrom(wire.session_to_pb(session))
        header.stop = reply.stop
        header.data_position = reply.state.data_position
        header.versions.extend(reply.state.versions())
        seen = "rejoined" if learner in self.records.joined else "joined"
        log.info("learner %s %s (index %d, session %s) at versions %s", learner, seen, header.data_shard, session,
                 list(header.versions))
        self.records.joined.add(learner)
        self.streams.open_for(learner, session, part)  # before the first copy: no update falls between

        async def send() -> None:
            await self.calls.write(context, self.boundary.out(learner, -1, pb.JoinReply(header=header)), "join")
            await self.copies.send(self.core.owned, lambda chunk: self.calls.write(
                context, self.boundary.out(learner, chunk.fragment, pb.JoinReply(chunk=chunk)), "join"),
                None if part is None else lambda value: self.parts.value(value, part))

        delivered = False
        try:
            await within(send(), self.calls.transfer_deadline_s(self.core.state_bytes), "the global state's transfer")
            delivered = True
        finally:  # also when the client went away (the task is cancelled): never await here
            self._spawn(self._host.handle(StateDelivered(learner, session, delivered)))

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def heartbeat(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            beat = wire.heartbeat_from_pb(self.boundary.receive(context, pb.HeartbeatRequest, raw))
            reply = await self._host.handle(beat)
            if isinstance(reply, Refused):
                await self.boundary.refused(context, reply)
                return b""
            return self.boundary.out(beat.learner_id, -1, pb.HeartbeatReply(stop=reply.stop))

        return await self._guarded(context, work) or b""

    async def contribute(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            contribution = await self.uploads.receive(requests, context)
            reply = await self._host.handle(contribution)
            if isinstance(reply, Refused):
                self.metrics.contributions.labels(str(reply.reason)).inc()
                await self.boundary.refused(context, reply)
                return b""
            self.metrics.contributions.labels("accepted").inc()
            return self.boundary.out(contribution.learner_id, -1, pb.ContributeReply(stop=reply.stop))

        return await self._guarded(context, work, upload=True) or b""

    async def updates(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        async def work() -> None:
            req = self.boundary.receive(context, pb.UpdatesRequest, raw)
            name, part, session = req.learner_id, part_of(req), wire.session_from_pb(req.session)
            if not await self._live_session(context, name, session, part):
                return
            self.calls.bound_to_session()  # one stream per learner (and rank) from here: a new one replaces it
            sub, opened_by_state = self.streams.subscribe(name, session, part)
            try:
                replay = () if opened_by_state else self.streams.replay(list(req.have_versions), part)
                for p, chunks in replay:
                    for data in chunks:
                        self.boundary.count_out(name, p, len(data))
                        await self.calls.write(context, data, "the update stream")
                if self.view.stopping:
                    await self.calls.write(context, self.boundary.out(name, -1, pb.Update(stop=True)), "the update stream")
                while True:
                    item = await sub.queue.get()
                    if item is CLOSE:
                        return
                    if isinstance(item, StopNotice):
                        await self.calls.write(context, self.boundary.out(name, -1, pb.Update(stop=True)),
                                               "the update stream")
                        continue
                    sub.backlog -= 1
                    p, chunks, delivery = item
                    try:
                        for data in chunks:
                            self.boundary.count_out(name, p, len(data))
                            await self.calls.write(context, data, "the update stream")
                    finally:
                        if delivery is not None:
                            delivery.done()
            finally:
                self.streams.unsubscribe(name, sub)

        await self._guarded(context, work)

    async def fetch_state(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        async def work() -> None:
            req = self.boundary.receive(context, pb.FetchStateRequest, raw)
            part = part_of(req)
            session = wire.session_from_pb(req.session)
            if part is not None:  # a rank of a sharded learner: it follows its stream from these values
                if not await self._live_session(context, req.learner_id, session, part):
                    return
                self.streams.open_for(req.learner_id, session, part)
            async with self.calls.transfers.hold():
                cut = None if part is None else lambda value: self.parts.value(value, part)
                await within(self.copies.send(self.core.owned, lambda chunk: self.calls.write(
                    context, chunk.SerializeToString(), "the state fetch"), cut),
                    self.calls.deadline_s(self.core.state_bytes), "the state fetch")

        await self._guarded(context, work)

    async def _live_session(self, context: grpc.aio.ServicerContext, name: str, session: Session,
                            part: Part | None) -> bool:
        """Does ``session`` of learner ``name`` live (and ``part`` fit the W it joined with)? Else the
        call ends: ``unknown_learner``, not counted (joining again is the normal way back after a lease
        expiry or a restart); a part of another W is malformed."""
        if await self._host.query(lambda core: core.session_problem(name, session)) is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"unknown_learner: no live session {session} for {name!r}: join again",
                                trailing_metadata=((REASON_HEADER, str(RejectReason.UNKNOWN_LEARNER)),))
            return False
        self.parts.check_world(name, part)
        return True

    async def leave(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            leave = wire.leave_from_pb(self.boundary.receive(context, pb.LeaveRequest, raw))
            reply = await self._host.handle(leave)
            if isinstance(reply, Refused):  # not its current session: nothing of the learner's is touched
                await self.boundary.refused(context, reply)
                return b""
            log.info("learner %s left", leave.learner_id)
            self.streams.close(leave.learner_id)
            return self.boundary.out(leave.learner_id, -1, pb.LeaveReply())

        return await self._guarded(context, work) or b""

    async def status(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async def work() -> bytes:
            req = self.boundary.receive(context, pb.StatusRequest, raw)
            return (await self.status_reply(req.learner_offset, req.learner_limit)).SerializeToString()

        return await self._guarded(context, work) or b""

    async def status_reply(self, learner_offset: int = 0, learner_limit: int = 0) -> pb.StatusReply:
        core = await self._host.status()
        return status_reply(self, core, self.options.clock(), learner_offset, learner_limit)

    # ---- serving ---------------------------------------------------------------------------

    @property
    def _host(self) -> SyncHost:
        assert self.host is not None, "the service is not started"
        return self.host

    def start_host(self) -> SyncHost:
        """Create the core host on the running event loop (``serve`` does this; tests may too)."""
        self.writer.start(lambda p: self._host.query(lambda core: core.fragment_state(p)))
        self.host = SyncHost(self.core, self.streams, self.records, clock=self.options.clock,
                             round_log=self.writer.round_log)
        self.host.start()
        return self.host

    async def stop(self, deadline: StopDeadline | None = None) -> None:
        """Stop the timer, the final checkpoint, the streams, the host: each wait bounded (``shutdown.py``)."""
        stop = deadline or StopDeadline(stop_deadline_s(self.core.state_bytes))
        if self.host is not None:
            await stop.wait(self.host.stop_timer(), "the core's timer")
            if self.host.failure is None:  # a core that failed mid-event may hold half an update
                await stop.wait(self.checkpoint(), "the final checkpoint")
            await stop.wait(self.host.flush(), "the updates queued behind the round log")
            self.streams.close_all()
            await stop.wait(asyncio.gather(*list(self._pending), return_exceptions=True), "the transfers' reports")
            await self.host.stop()
        self.writer.close(stop)
        self.stop_missed = stop.missed
