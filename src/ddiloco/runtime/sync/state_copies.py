"""Fragment copies for the state transfers of joins and fetches, shared while they are sent.

A join or a state fetch sends the global state one fragment at a time: it asks the core's
thread for a copy of the next fragment (``Synchronizer.fragment_value``), sends it in chunks
and lets it go, so a transfer holds one fragment beyond the steady state instead of a copy
of the whole model. Transfers under way at once share one copy of a fragment as long as its
version has not moved on: eight learners joining together cost one copy of each fragment in
turn, not eight copies of the model. A copy leaves only once the round log holds its version
(``durable``): a learner never receives a version a restart could not restore.
"""

from __future__ import annotations

import weakref
from typing import Awaitable, Callable, Sequence

from ddiloco.core.shared.messages import FragmentValue
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.runtime import wire
from ddiloco.runtime.proto import ddiloco_pb2 as pb


class _Shared:
    """A fragment copy, held by the transfers sending it (a weak reference stays in the cache)."""

    __slots__ = ("value", "__weakref__")

    def __init__(self, value: FragmentValue) -> None:
        self.value = value


Query = Callable[[Callable[[Synchronizer], _Shared]], Awaitable[_Shared]]


class SharedCopies:
    def __init__(self, query: Query, durable: Callable[[], Awaitable[None]]) -> None:
        self._query = query
        self._durable = durable
        self._cache: weakref.WeakValueDictionary[int, _Shared] = weakref.WeakValueDictionary()

    async def get(self, fragment: int) -> _Shared:
        """The fragment's current value: a copy another transfer holds if it is of the current version."""
        cached = self._cache.get(fragment)

        def take(core: Synchronizer) -> _Shared:  # on the core's thread
            if cached is not None and cached.value.version == core.fragment_version(fragment):
                return cached
            return _Shared(core.fragment_value(fragment))

        shared = await self._query(take)
        self._cache[fragment] = shared
        return shared

    async def send(self, fragments: Sequence[int], write: Callable[[pb.StateChunk], Awaitable[None]],
                   cut: Callable[[FragmentValue], FragmentValue] | None = None) -> None:
        """Send these fragments' values in chunks, one fragment's copy held at a time (each ``cut`` to
        a rank's slice if given: ``slice_parts.py``)."""
        for p in fragments:
            shared = await self.get(p)
            await self._durable()
            for chunk in wire.fragment_chunks(shared.value if cut is None else cut(shared.value)):
                await write(chunk)
            del shared  # the next fragment's copy replaces this one
