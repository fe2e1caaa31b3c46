"""ξ_sync ends when the last recipient's stream has written an update (``runtime/sync/streams.py``)."""

from __future__ import annotations

import asyncio

from ddiloco.core.shared.messages import FragmentUpdate
from ddiloco.runtime.sync.streams import CLOSE, UpdateStreams

UPDATE = FragmentUpdate(fragment=0, version=1, codec="fp32", payload=bytes(16))


def written(sub) -> None:
    """What the service's stream handler does with one queued update once it has written it."""
    _, _, delivery = sub.queue.get_nowait()
    delivery.done()


def test_an_update_counts_as_sent_once_every_listening_stream_has_written_it() -> None:
    async def run() -> list[str]:
        streams, sent = UpdateStreams(1, 1 << 20), []
        a, b = streams.subscribe("a"), streams.subscribe("b")
        streams.publish(UPDATE, ("a", "b", "not-listening"), lambda: sent.append("sent"))
        written(a)
        assert sent == []  # b has not written it yet
        written(b)
        return sent

    assert asyncio.run(run()) == ["sent"]


def test_a_stream_that_ends_drops_what_it_had_not_written() -> None:
    async def run() -> list[str]:
        streams, sent = UpdateStreams(1, 1 << 20), []
        a, b = streams.subscribe("a"), streams.subscribe("b")
        streams.publish(UPDATE, ("a", "b"), lambda: sent.append("sent"))
        written(a)
        streams.close("b")
        streams.unsubscribe("b", b)  # the handler's ``finally`` when its stream ends
        assert b.queue.empty()
        return sent

    assert asyncio.run(run()) == ["sent"]


def test_no_listener_no_observation() -> None:
    async def run() -> list[str]:
        streams, sent = UpdateStreams(1, 1 << 20), []
        streams.publish(UPDATE, ("a",), lambda: sent.append("sent"))
        sub = streams.subscribe("a")  # subscribed after: it replays the update, not counted
        assert sub.queue.empty() or sub.queue.get_nowait() is CLOSE
        return sent

    assert asyncio.run(run()) == []
