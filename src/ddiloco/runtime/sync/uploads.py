"""An upload, from its first message to a contribution the core can judge.

The header is read first, within a lease, while the stream holds only an anonymous slot of its
host (:mod:`ddiloco.runtime.sync.call_limits`); the wire checks it (:mod:`ddiloco.runtime.sync.boundary`)
and the core says whether it names the live session of its learner. Only then does it take an
upload slot of that learner — so a stream of an unknown, expired or another learner's session is
refused with the core's reason before any payload is read, and what a member holds is counted
against its own sessions, never against the honest learners behind its address. The payload
then has to keep to the run's slowest configured link.
"""

from __future__ import annotations

from typing import AsyncIterator, Callable

import grpc

from ddiloco.core.shared.messages import Contribution, Session
from ddiloco.runtime import wire
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.sync.boundary import Abort, Boundary
from ddiloco.runtime.sync.call_limits import CallLimits, PoolSlot
from ddiloco.runtime.sync.core_host import SyncHost


class Uploads:
    def __init__(self, boundary: Boundary, calls: CallLimits, host: Callable[[], SyncHost]) -> None:
        self.boundary = boundary
        self.calls = calls
        self._host = host

    async def receive(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Contribution:
        """The contribution ``requests`` carry, or :class:`Abort` with the reason it was refused."""
        paced = self.calls.paced(requests)
        held: list[PoolSlot] = []

        async def on_header(header: pb.ContributionHeader) -> None:
            name, session = header.learner_id, wire.session_from_pb(header.session)
            boot = header.progress.boot if header.HasField("progress") else None
            problem = await self._host().query(lambda core: core.session_problem(name, session, boot))
            if problem is not None:
                raise Abort(problem.reason, problem.detail)
            # Each rank of a sharded learner uploads its own slices, at once: the limits hold per rank.
            uploader = f"{name}/rank{header.slice.rank}" if header.HasField("slice") else name
            paced.slot = await self.calls.uploads.take(uploader, session, int(header.fragment), self._live)
            held.append(paced.slot)
            self.calls.bound_to_session()

        try:
            return await self.boundary.assemble(paced, context, on_header)
        finally:
            for slot in held:
                self.calls.uploads.release(slot)

    async def _live(self, sessions: list[tuple[str, Session]]) -> list[bool]:
        return await self._host().query(lambda core: [core.session_problem(name, s) is None for name, s in sessions])
