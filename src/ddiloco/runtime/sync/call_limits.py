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
from ddiloco.runtime.sync.boundary import Abort

LEASES_ALLOWED = 3.0
"""What every stream is allowed on top of its bytes at the slowest configured rate, in leases."""
PER_PEER_CALLS = 64
"""Calls one client host may hold at once (all learners of a host share its address)."""


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """The client's host: ``ipv4:10.0.0.2:51234`` -> ``ipv4:10.0.0.2`` (its port changes per connection)."""
    peer = context.peer() or "unknown"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


def busy(what: str) -> Abort:
    return Abort(RejectReason.BUSY, f"{what}: try again later")


def timed_out(what: str, seconds: float) -> Abort:
    return Abort(RejectReason.TIMED_OUT, f"{what} stalled past its {seconds:.0f}s deadline")


@dataclass(slots=True)
class Pool:
    """At most ``limit`` holders at once, per key (one key: a plain pool)."""

    limit: int
    what: str
    held: collections.Counter = field(default_factory=collections.Counter)

    @contextlib.asynccontextmanager
    async def hold(self, key: str = "") -> AsyncIterator[None]:
        """A slot, or :class:`Abort` (``busy``) when every one is taken."""
        if self.held[key] >= self.limit:
            raise busy(f"{self.limit} {self.what}{' from ' + key if key else ''} at once")
        self.held[key] += 1
        try:
            yield
        finally:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]

    def __len__(self) -> int:
        return sum(self.held.values())


class CallLimits:
    def __init__(self, min_bytes_per_s: float, max_learners: int, lease_s: float) -> None:
        self.min_bytes_per_s = min_bytes_per_s
        self.lease_s = lease_s
        self.per_peer = Pool(PER_PEER_CALLS, "calls")
        self.calls = Pool(max(256, 8 * max_learners), "calls")
        """Every live learner's few calls at once, and room for operators."""
        self.uploads = Pool(max(16, 2 * max_learners), "uploads")
        """Each holds its payload: at most the int4 size of the largest fragment."""
        self.transfers = Pool(8, "state transfers")
        """A join's or a fetch's: each holds a copy of the global state."""

    def deadline_s(self, nbytes: int) -> float:
        """How long a stream of ``nbytes`` may take."""
        return LEASES_ALLOWED * self.lease_s + nbytes / self.min_bytes_per_s

    @contextlib.asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Hold one call slot for this caller's host and one in all, or :class:`Abort` (``busy``)."""
        async with self.per_peer.hold(peer_host(context)), self.calls.hold():
            yield

    async def write(self, context: grpc.aio.ServicerContext, data: bytes, what: str) -> None:
        """Send one message of a stream, or :class:`Abort` (``timed_out``) when the client stops reading."""
        seconds = self.deadline_s(len(data))
        try:
            await asyncio.wait_for(context.write(data), seconds)
        except asyncio.TimeoutError:
            raise timed_out(what, seconds) from None
