"""What the synchronizer's callers may hold: calls at once, per peer and in all, and for how long.

Every call holds a slot while it runs: at most ``per_peer`` per client host and ``total`` in
all; beyond that a call is refused at once as ``busy`` (the learner retries, or folds the
work into its next contribution). Uploads and full-state transfers have smaller pools of
their own, because each holds memory: an upload its payload (at most the int4 size of the
largest fragment), a state transfer a copy of the global state. Every stream has a deadline
that allows ``min_bytes_per_s`` — the slowest link the run is configured for
(``protocol.min_link_bytes_per_s``) — plus three leases; a client that stalls past it is cut
off as ``timed_out``. So no client, and no burst of clients, can hold the synchronizer's
memory or its call slots without end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from ddiloco.core.messages import RejectReason
from ddiloco.runtime.boundary import Abort

LEASES_ALLOWED = 3.0
"""What every stream is allowed on top of its bytes at the slowest configured rate, in leases."""
PER_PEER_CALLS = 64
"""Calls one client host may hold at once (all learners of a host share its address)."""


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """The client's host: ``ipv4:10.0.0.2:51234`` -> ``ipv4:10.0.0.2`` (its port changes per connection)."""
    peer = context.peer() or "unknown"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


@dataclass(slots=True)
class CallLimits:
    min_bytes_per_s: float
    max_learners: int
    lease_s: float
    per_peer: int = PER_PEER_CALLS
    active: collections.Counter = field(default_factory=collections.Counter)
    total_active: int = 0
    uploads: int = 0
    transfers: int = 0

    @property
    def total(self) -> int:
        """Calls held at once in all: every live learner's few, and room for operators."""
        return max(256, 8 * self.max_learners)

    @property
    def max_uploads(self) -> int:
        return max(16, 2 * self.max_learners)

    @property
    def max_transfers(self) -> int:
        return 8

    def deadline_s(self, nbytes: int) -> float:
        """How long a stream of ``nbytes`` may take."""
        return LEASES_ALLOWED * self.lease_s + nbytes / self.min_bytes_per_s

    @staticmethod
    def busy(what: str) -> Abort:
        return Abort(RejectReason.BUSY, f"{what}: try again later")

    @staticmethod
    def timed_out(what: str, seconds: float) -> Abort:
        return Abort(RejectReason.TIMED_OUT, f"{what} stalled past its {seconds:.0f}s deadline")

    @contextlib.asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Hold one call slot for this caller's host, or :class:`Abort` (``busy``)."""
        peer = peer_host(context)
        if self.active[peer] >= self.per_peer:
            raise self.busy(f"{self.per_peer} calls from {peer} at once")
        if self.total_active >= self.total:
            raise self.busy(f"{self.total} calls at once")
        self.active[peer] += 1
        self.total_active += 1
        try:
            yield
        finally:
            self.total_active -= 1
            self.active[peer] -= 1
            if not self.active[peer]:
                del self.active[peer]

    @contextlib.asynccontextmanager
    async def upload(self) -> AsyncIterator[None]:
        if self.uploads >= self.max_uploads:
            raise self.busy(f"{self.max_uploads} uploads at once")
        self.uploads += 1
        try:
            yield
        finally:
            self.uploads -= 1

    @contextlib.asynccontextmanager
    async def transfer(self) -> AsyncIterator[None]:
        """A slot for sending the full state (a join, a fetch): each holds a copy of it."""
        if self.transfers >= self.max_transfers:
            raise self.busy(f"{self.max_transfers} state transfers at once")
        self.transfers += 1
        try:
            yield
        finally:
            self.transfers -= 1

    async def write(self, context: grpc.aio.ServicerContext, data: bytes, what: str) -> None:
        """Send one message of a stream, or :class:`Abort` (``timed_out``) when the client stops reading."""
        seconds = self.deadline_s(len(data))
        try:
            await asyncio.wait_for(context.write(data), seconds)
        except asyncio.TimeoutError:
            raise self.timed_out(what, seconds) from None
