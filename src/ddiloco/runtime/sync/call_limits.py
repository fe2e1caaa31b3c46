"""What the synchronizer's callers may hold: calls at once, per host, per learner and in all, and for how long.

A call is anonymous until it names a live session of a registered learner. While anonymous it
holds a slot from its client host's pool (``per_peer``) and one from ``calls`` in all; beyond
that it is refused at once as ``busy`` (the learner retries, or folds the work into its next
contribution). Host pools cannot tell a member from honest learners behind the same address (a
NAT, a login node, loopback), so nothing long-lived stays in them: a stream that proves its
session (an upload's header, an update stream's request) leaves them for a pool of its own,
accounted per learner.

- An upload waits for its header in ``awaiting`` (per host; when full, the longest-waiting
  stream of that host is closed to make room: honest learners send their header at once, so
  a host that opens stalled streams only closes its own). Its header must name a live session
  of its learner, asked of the core, before a slot in ``uploads`` is taken, as the core's
  admission of uploads decides (``core/sync_side/upload_admission.py``: at most one upload per
  learner and fragment, two per learner, room for as many for every lease the registry grants; a
  full pool first closes the uploads of sessions no longer live).
- An update stream is one per learner (a new one replaces the old: ``streams.py``).
- Joins and state fetches hold one of ``transfers`` (each holds a copy of one fragment at a time).

Every stream is held to the slowest link the run is configured for
(``protocol.min_link_bytes_per_s``), by the rules of ``core/shared/deadlines.py``: an upload's header
must arrive within a lease, and every later message by when a sender at that rate, one lease
late, would have delivered it (``upload_pace_s``); every message sent must leave within three
leases plus its bytes at that rate (``stream_deadline_s``); a join's whole state within the
core's admission window (``admission_window_s``). A stream that falls
behind is closed as ``timed_out`` (``DEADLINE_EXCEEDED``), counted per learner. So no client,
no burst of clients and no member holding the shared token can hold the synchronizer's memory
or the slots honest learners need for longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import grpc

from ddiloco.core.shared import deadlines
from ddiloco.core.shared.messages import RejectReason, Session
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.upload_admission import InFlight, UploadAdmission, Verdict
from ddiloco.runtime.sync.boundary import Abort
from ddiloco.runtime.wire import MAX_MESSAGE_BYTES

STATE_TRANSFERS = 8
"""Joins and state fetches sent at once (each holds a copy of one fragment at a time)."""
PER_PEER_CALLS = 64
"""Anonymous calls one client host may hold at once (all learners of a host share its address)."""
AWAITING_PER_PEER = 16
"""Uploads of one client host waiting for their header at once (the longest-waiting one makes room)."""

Liveness = Callable[[list[tuple[str, Session]]], Awaitable[list[bool]]]
"""Which of these (learner, session) pairs are live sessions (the core's answer)."""


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """The client's host: ``ipv4:10.0.0.2:51234`` -> ``ipv4:10.0.0.2`` (its port changes per connection)."""
    peer = context.peer() or "unknown"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


def busy(what: str) -> Abort:
    return Abort(RejectReason.BUSY, f"{what}: try again later")


def timed_out(what: str, seconds: float) -> Abort:
    return Abort(RejectReason.TIMED_OUT, f"{what} stalled past its {seconds:.0f}s deadline")


def _retrieved(task: asyncio.Future) -> None:
    """Mark a task's outcome as seen (a read's, a send's): its error or the stream's end
    (StopAsyncIteration) is its caller's to act on through ``result()``, and when the caller no longer
    will (it was cancelled, or it raised before), the outcome is of no use to anyone and must not be
    logged as lost ("Task exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


async def within(work: Awaitable[None], seconds: float, what: str) -> None:
    """``work``, or :class:`Abort` (``timed_out``) once it took ``seconds``. Its error is read even
    when the caller was cancelled meanwhile (a client gone mid-send fails grpc's write): asyncio's
    ``wait_for`` leaves it unread, and the log showed "Task exception was never retrieved"."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_retrieved)
    try:
        await asyncio.wait_for(task, seconds)
    except asyncio.TimeoutError:
        raise timed_out(what, seconds) from None


class PoolSlot:
    """One place held in a pool; released once, by its holder or by the pool (evicted)."""

    def __init__(self, pool: "Pool", key: str) -> None:
        self.pool = pool
        self.key = key
        self.evicted: asyncio.Event = asyncio.Event()
        self.reason: Abort | None = None
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.pool.drop(self)

    def evict(self, reason: Abort) -> None:
        """Free the place now; the holder's next wait ends with ``reason``."""
        self.reason = reason
        self.evicted.set()
        self.release()


@dataclass(slots=True)
class Pool:
    """At most ``limit`` holders at once, per key (one key: a plain pool); when full, a newcomer
    is refused as ``busy`` or, with ``evict_oldest``, takes the place of the oldest holder of its key."""

    limit: int
    what: str
    evict_oldest: bool = False
    held: dict[str, list[PoolSlot]] = field(default_factory=dict)

    def take(self, key: str = "") -> PoolSlot:
        holders = self.held.setdefault(key, [])
        if len(holders) >= self.limit:
            if not self.evict_oldest:
                raise busy(f"{self.limit} {self.what}{' from ' + key if key else ''} at once")
            holders[0].evict(busy(f"{self.limit} newer {self.what}{' from ' + key if key else ''}"))
        slot = PoolSlot(self, key)
        self.held.setdefault(key, []).append(slot)
        return slot

    def drop(self, slot: PoolSlot) -> None:
        holders = self.held.get(slot.key, [])
        if slot in holders:
            holders.remove(slot)
        if not holders:
            self.held.pop(slot.key, None)

    @contextlib.asynccontextmanager
    async def hold(self, key: str = "") -> AsyncIterator[PoolSlot]:
        """A slot for the block, or :class:`Abort` (``busy``) when every one is taken."""
        slot = self.take(key)
        try:
            yield slot
        finally:
            slot.release()

    def __len__(self) -> int:
        return sum(map(len, self.held.values()))


class UploadSlots:
    """The buffers of the uploads the core's admission let in (``core/sync_side/upload_admission.py``),
    and the streams it ends to make way."""

    def __init__(self, max_learners: int) -> None:
        self.admission = UploadAdmission(max_learners)
        self.pool = Pool(self.admission.total, "uploads")
        self.held: dict[InFlight, PoolSlot] = {}

    async def take(self, learner: str, session: Session, fragment: int, live: Liveness) -> PoolSlot:
        """A slot for an upload of a session the core just called live, or :class:`Abort` (``busy``)."""
        verdict = self._carry_out(self.admission.consider(learner, session, fragment))
        if verdict.check:
            answers = await live([(u.learner, u.session) for u in verdict.check])
            self._carry_out(self.admission.with_live(learner, fragment, verdict.check, answers))
        slot = self.pool.take()
        upload = InFlight(learner, session, fragment)
        self.admission.admit(upload)
        self.held[upload] = slot
        return slot

    def release(self, slot: PoolSlot) -> None:
        for upload in [u for u, held in self.held.items() if held is slot]:
            del self.held[upload]
            self.admission.end(upload)
        slot.release()

    def _carry_out(self, verdict: Verdict) -> Verdict:
        """Close the streams of the uploads ended to make way; :class:`Abort` if this one is refused."""
        for e in verdict.ended:
            if (slot := self.held.pop(e.upload, None)) is not None:
                slot.evict(Abort(e.reason, e.detail))
        if verdict.refused is not None:
            raise Abort(*verdict.refused)
        return verdict

    def __len__(self) -> int:
        return len(self.held)


_anonymous: contextvars.ContextVar[tuple[PoolSlot, ...]] = contextvars.ContextVar("anonymous_slots", default=())
"""The anonymous slots of the call this task serves (each gRPC call runs in a task of its own)."""


class CallLimits:
    def __init__(self, protocol: ProtocolConfig, max_learners: int) -> None:
        self.protocol = protocol
        self.per_peer = Pool(PER_PEER_CALLS, "calls")
        self.awaiting = Pool(AWAITING_PER_PEER, "uploads waiting for their header", evict_oldest=True)
        self.calls = Pool(max(256, 8 * max_learners), "calls")
        """Every live learner's few calls at once, and room for operators."""
        self.uploads = UploadSlots(max_learners)
        """Each holds its payload: at most the int4 size of the largest fragment."""
        self.transfers = Pool(STATE_TRANSFERS, "state transfers")
        """A join's or a fetch's: each holds a copy of the global state."""

    def deadline_s(self, nbytes: int) -> float:
        """How long a message of ``nbytes`` (or a state fetch of that size) may take to leave."""
        return deadlines.stream_deadline_s(nbytes, self.protocol)

    def transfer_deadline_s(self, state_bytes: int) -> float:
        """How long a join's state transfer may take: the core's admission window (its session lives
        no longer without the state)."""
        return deadlines.admission_window_s(state_bytes, self.protocol)

    @contextlib.asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext, *, upload: bool = False) -> AsyncIterator[None]:
        """Hold one anonymous slot of this caller's host (of ``awaiting`` for an ``upload``) and one
        in all until the call names its session (:meth:`bound_to_session`) or ends; or :class:`Abort` (``busy``)."""
        host = (self.awaiting if upload else self.per_peer).take(peer_host(context))
        try:
            slots = (host, self.calls.take())
        except Abort:
            host.release()
            raise
        token = _anonymous.set(slots)
        try:
            yield
        finally:
            _anonymous.reset(token)
            for slot in slots:
                slot.release()

    def bound_to_session(self) -> None:
        """The call named a live session: from now on it is accounted per learner, not per host."""
        for slot in _anonymous.get():
            slot.release()

    def paced(self, requests: AsyncIterator[bytes]) -> "Paced":
        """``requests``, each message by when the slowest configured link would have delivered it."""
        slots = _anonymous.get()
        return Paced(requests, self, slots[0] if slots else None)

    async def write(self, context: grpc.aio.ServicerContext, data: bytes, what: str) -> None:
        """Send one message of a stream, or :class:`Abort` (``timed_out``) when the client stops reading."""
        seconds = self.deadline_s(len(data))
        try:
            await asyncio.wait_for(context.write(data), seconds)
        except asyncio.TimeoutError:
            raise timed_out(what, seconds) from None


class Paced:
    """An upload's messages: the first (its header) within a lease, every later one by when a
    sender at ``protocol.min_link_bytes_per_s`` that started a lease late would have delivered it whole. A
    message later than that, or an evicted :attr:`slot`, ends the upload with :class:`Abort`."""

    def __init__(self, requests: AsyncIterator[bytes], limits: CallLimits, slot: PoolSlot | None) -> None:
        self._requests = requests
        self._messages: AsyncIterator[bytes] | None = None
        """Opened at the first read: a call refused before it (its token, say) leaves nothing unawaited."""
        self._limits = limits
        self.slot = slot
        self._start = asyncio.get_running_loop().time()
        self._received = 0

    def __aiter__(self) -> "Paced":
        return self

    async def __anext__(self) -> bytes:
        limits = self._limits
        allowed = deadlines.upload_pace_s(self._received, MAX_MESSAGE_BYTES, limits.protocol)
        wait_s = max(0.0, self._start + allowed - asyncio.get_running_loop().time())
        if self._messages is None:
            self._messages = self._requests.__aiter__()
        read = asyncio.ensure_future(self._messages.__anext__())
        read.add_done_callback(_retrieved)
        waits = {read}
        if self.slot is not None:
            waits.add(asyncio.ensure_future(self.slot.evicted.wait()))
        try:
            await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # The call was cancelled while it waited (a stop, the client gone): its read must not
            # outlive it. Left running, it ended with the stream's StopAsyncIteration that no one
            # retrieved, and asyncio logged "Task exception was never retrieved" (issue 57).
            read.cancel()
            raise
        finally:
            for task in waits - {read}:
                task.cancel()
        if not read.done():
            read.cancel()
            if self.slot is not None and self.slot.reason is not None:
                raise self.slot.reason
            raise Abort(RejectReason.TIMED_OUT, f"the upload sent {self._received} bytes in {allowed:.1f}s, "
                                                 f"less than {limits.protocol.min_link_bytes_per_s:g} bytes/s "
                                                 "after a lease")
        raw = read.result()  # StopAsyncIteration ends the upload
        self._received += len(raw)
        return raw
