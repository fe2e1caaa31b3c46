"""The synchronizer's boundary: what is checked and counted before a message reaches the core.

Who is calling (the shared token or a learner's own credentials, and that a learner speaks
only for itself), the protocol version, protobuf syntax, chunk assembly and the size of an
upload are the wire's business (rejections counted here, answered with a named reason);
every other decision is the core's. Bytes are counted per learner, fragment and direction
as they cross the socket — per learner only for learners the core registered (``known``);
everything else is counted under one key, so ids made up by a caller never grow the ledger.
"""

from __future__ import annotations

import collections
import logging
import mmap
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from ddiloco.core.shared.actions import Refused
from ddiloco.core.shared.messages import Contribution, RejectReason, check_id
from ddiloco.measures.wire_bytes import ByteLedger, Direction
from ddiloco.runtime import wire
from ddiloco.runtime.auth import PROTOCOL_HEADER, PROTOCOL_VERSION, REASON_HEADER, Authenticator, Identity
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.sync.metrics import ServiceMetrics

log = logging.getLogger("ddiloco.sync")

STATUS_CODES = {
    RejectReason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    RejectReason.UNKNOWN_LEARNER: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.SUPERSEDED: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.FUTURE_VERSION: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.STALE: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.BAD_PROTOCOL_VERSION: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.LAYOUT_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.FINISHED: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    RejectReason.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.REGISTRY_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    RejectReason.REPLACED: grpc.StatusCode.FAILED_PRECONDITION,
}
"""gRPC status per rejection reason; everything else is INVALID_ARGUMENT."""

M = TypeVar("M", bound=Message)
GRPC_FRAME_BYTES = 5
"""Every gRPC message is prefixed by 1 compression flag byte and a 4-byte length (counted with it;
HTTP/2 frame headers and TLS records are not)."""
UNREGISTERED = "(unregistered)"
"""The ledger's key for traffic of ids the core has not registered (or has forgotten)."""


def _check_learner(learner_id: str) -> None:
    """An id becomes a key of the byte ledger, the rejection counts and checkpoints: only plausible ones."""
    try:
        check_id(learner_id, "learner id")
    except ValueError as err:
        raise Abort(RejectReason.MALFORMED, str(err)) from None


def payload_buffer(size: int) -> memoryview | bytearray:
    """An upload's payload, exactly the announced size and allocated once: the chunks are copied
    into it as they arrive, and it is the payload the core sees (no joined or converted copy).

    Fresh anonymous memory, not a ``bytearray``: ``bytearray(n)`` zero-fills all of it at once,
    on the event loop with the GIL held. At 1B parameters an upload is 22 MB, and that fill
    took 0.17–0.3 s while a checkpoint was written beside it. No status or stream was answered
    in that time. Here the kernel hands out zeroed pages as each chunk is copied in, one MiB at
    a time between two awaits."""
    return memoryview(mmap.mmap(-1, size)) if size else bytearray()


class Abort(Exception):
    """End the current call with a wire-level rejection."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.learner: str | None = None


class Boundary:
    def __init__(self, auth: Authenticator, max_payload: int, fragments: int, metrics: ServiceMetrics,
                 ledger: ByteLedger) -> None:
        self.auth = auth
        self.max_payload = max_payload
        self.fragments = fragments
        self.metrics = metrics
        self.ledger = ledger
        self.known: set[str] = set()
        """Learner ids the core registered and has not forgotten (the service keeps this up to date)."""
        self.rejections: collections.Counter[str] = collections.Counter()
        self.learner_rejected: collections.Counter[str] = collections.Counter()

    def key(self, learner: str) -> str:
        return learner if learner in self.known else UNREGISTERED

    def admit(self, context: grpc.aio.ServicerContext) -> Identity:
        """Who is calling (:class:`Abort` ``unauthenticated`` when nobody we know)."""
        metadata = context.invocation_metadata()
        identity = self.auth.identify(metadata)
        if identity is None:
            raise Abort(RejectReason.UNAUTHENTICATED, "missing or wrong auth token or learner secret")
        for key, value in metadata or ():
            if key == PROTOCOL_HEADER and str(value) != str(PROTOCOL_VERSION):
                raise Abort(RejectReason.BAD_PROTOCOL_VERSION,
                             f"client speaks protocol {value}, this synchronizer speaks {PROTOCOL_VERSION}")
        return identity

    @staticmethod
    def speaks_for(identity: Identity, learner_id: str) -> None:
        """A learner's credentials speak for that learner only; an operator's for none."""
        if identity.operator or (identity.learner is not None and identity.learner != learner_id):
            who = "the shared token" if identity.operator else f"the credentials of {identity.learner!r}"
            raise Abort(RejectReason.UNAUTHENTICATED, f"{who} cannot speak for learner {learner_id!r}")

    @staticmethod
    def parse(message_type: type[M], raw: bytes) -> M:
        try:
            return message_type.FromString(raw)
        except (DecodeError, RuntimeWarning, ValueError) as err:
            raise Abort(RejectReason.MALFORMED, f"cannot parse {message_type.__name__}: {err}") from None

    def receive(self, context: grpc.aio.ServicerContext, message_type: type[M], raw: bytes) -> M:
        """Admit the caller, parse its request, check it speaks for itself, count its bytes
        (raises :class:`Abort`)."""
        identity = self.admit(context)
        request = self.parse(message_type, raw)
        # Status and whole-state fetches are not a learner's traffic; a rank's fetch of its slices is.
        if hasattr(request, "learner_id") and (request.learner_id or not isinstance(request, pb.FetchStateRequest)):
            _check_learner(request.learner_id)
            self.count_in(request.learner_id, -1, len(raw))
            try:
                self.speaks_for(identity, request.learner_id)
            except Abort as err:
                err.learner = request.learner_id
                raise
        return request

    async def reject(self, context: grpc.aio.ServicerContext, reason: RejectReason, detail: str,
                      learner: str | None = None, *, counted: bool = False) -> None:
        """End the call with ``reason``; wire-level rejections are counted here (the core counts its own)."""
        if not counted:
            self.rejections[str(reason)] += 1
            if learner:
                self.learner_rejected[self.key(learner)] += 1
        self.metrics.rejections.labels(str(reason)).inc()
        code = STATUS_CODES.get(reason, grpc.StatusCode.INVALID_ARGUMENT)
        log.info("rejected %s%s: %s", reason, f" from {learner}" if learner else "", detail)
        await context.abort(code, f"{reason}: {detail}", trailing_metadata=((REASON_HEADER, str(reason)),))

    async def refused(self, context: grpc.aio.ServicerContext, reply: Refused) -> None:
        await self.reject(context, reply.reason, reply.detail, reply.learner_id, counted=True)

    def out(self, learner: str, fragment: int, message: Message) -> bytes:
        data = message.SerializeToString()
        self.count_out(learner, fragment, len(data))
        return data

    def count_out(self, learner: str, fragment: int, size: int) -> None:
        self._count(learner, fragment, Direction.DOWN, size)

    def count_in(self, learner: str, fragment: int, size: int) -> None:
        self._count(learner, fragment, Direction.UP, size)

    def _count(self, learner: str, fragment: int, direction: Direction, size: int) -> None:
        """One count of a message's bytes on the wire, framed, read by the status and Prometheus alike."""
        framed = size + GRPC_FRAME_BYTES
        self.ledger.add(self.key(learner), self._fragment_key(fragment), direction, framed)
        self.metrics.bytes.labels(str(direction)).inc(framed)

    def _fragment_key(self, fragment: int) -> int:
        return fragment if 0 <= fragment < self.fragments else -1  # a made-up index is control traffic

    async def assemble(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                       on_header: Callable[[pb.ContributionHeader], Awaitable[None]]) -> Contribution:
        """Chunks into one contribution; wire-level problems raise :class:`Abort`. ``on_header`` sees
        the header once it passed the wire's checks, before any payload is read (and may refuse it)."""
        learner, fragment = "", -1
        header: pb.ContributionHeader | None = None
        payload = bytearray()
        received = 0
        try:
            identity = self.admit(context)
            async for raw in requests:
                chunk = self.parse(pb.ContributionChunk, raw)
                if header is None:
                    if not chunk.HasField("header"):
                        raise Abort(RejectReason.CHUNK_ASSEMBLY, "the first chunk carries no header")
                    header = chunk.header
                    _check_learner(header.learner_id)
                    self.speaks_for(identity, header.learner_id)
                    learner, fragment = header.learner_id, int(header.fragment)
                    if header.payload_bytes > self.max_payload:
                        raise Abort(RejectReason.TOO_LARGE, f"{header.payload_bytes} payload bytes, at most "
                                                             f"{self.max_payload} accepted")
                    self.count_in(learner, fragment, len(raw))
                    await on_header(header)
                    payload = payload_buffer(header.payload_bytes)
                else:
                    if chunk.HasField("header"):
                        raise Abort(RejectReason.CHUNK_ASSEMBLY, "a header in a chunk after the first")
                    self.count_in(learner, fragment, len(raw))
                if chunk.offset != received:
                    raise Abort(RejectReason.CHUNK_ASSEMBLY, f"chunk at offset {chunk.offset}, expected {received}")
                if received + len(chunk.data) > header.payload_bytes:
                    raise Abort(RejectReason.CHUNK_ASSEMBLY, f"more than the announced {header.payload_bytes} bytes")
                payload[received:received + len(chunk.data)] = chunk.data
                received += len(chunk.data)
            if header is None:
                raise Abort(RejectReason.CHUNK_ASSEMBLY, "empty upload")
            if received != header.payload_bytes:
                raise Abort(RejectReason.CHUNK_ASSEMBLY,
                             f"upload ended after {received} of {header.payload_bytes} bytes")
            try:
                return wire.contribution_from_pb(header, payload)  # type: ignore[arg-type]  # read-only from here
            except wire.WireError as err:
                raise Abort(RejectReason.MALFORMED, str(err)) from None
        except Abort as err:
            err.learner = learner or None
            raise

    async def wire_error(self, context: grpc.aio.ServicerContext, err: Exception, learner: str = "") -> None:
        if isinstance(err, Abort):
            await self.reject(context, err.reason, err.detail, learner or None)
        else:
            await self.reject(context, RejectReason.MALFORMED, str(err), learner or None)

