"""ξ_sync ends when the last recipient's stream has written an update (``runtime/sync/streams.py``)."""

from __future__ import annotations

import asyncio

from ddiloco.core.shared.messages import FragmentUpdate, Session
from ddiloco.runtime.sync.streams import CLOSE, UpdateStreams

UPDATE = FragmentUpdate(fragment=0, version=1, codec="fp32", payload=bytes(16))
SESSION = Session(7, 1)


def subscribe(streams: UpdateStreams, name: str):
    sub, opened_by_state = streams.subscribe(name, SESSION)
    assert not opened_by_state
    return sub


def written(sub) -> None:
    """What the service's stream handler does with one queued update once it has written it."""
    _, _, delivery = sub.queue.get_nowait()
    delivery.done()


def test_an_update_counts_as_sent_once_every_listening_stream_has_written_it() -> None:
    async def run() -> list[str]:
        streams, sent = UpdateStreams(1, 1 << 20), []
        a, b = subscribe(streams, "a"), subscribe(streams, "b")
        streams.publish(UPDATE, ("a", "b", "not-listening"), lambda: sent.append("sent"))
        written(a)
        assert sent == []  # b has not written it yet
        written(b)
        return sent

    assert asyncio.run(run()) == ["sent"]


def test_a_stream_that_ends_drops_what_it_had_not_written() -> None:
    async def run() -> list[str]:
        streams, sent = UpdateStreams(1, 1 << 20), []
        a, b = subscribe(streams, "a"), subscribe(streams, "b")
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
        sub = subscribe(streams, "a")  # subscribed after: it replays the update, not counted
        assert sub.queue.empty() or sub.queue.get_nowait() is CLOSE
        return sent

    assert asyncio.run(run()) == []


def test_a_stream_its_state_opened_keeps_updates_for_its_session_without_holding_up_delivery() -> None:
    async def run() -> tuple[list[str], list]:
        streams, sent = UpdateStreams(1, 1 << 20), []
        streams.open_for("a", SESSION)
        streams.publish(UPDATE, ("a",), lambda: sent.append("sent"))
        assert subscribe(streams, "b")  # another learner's stream is its own
        other, opened_by_state = streams.subscribe("a", Session(7, 0))  # an older session: a new stream
        assert not opened_by_state and other.queue.empty()
        streams.open_for("a", SESSION)
        streams.publish(UPDATE, ("a",), lambda: sent.append("sent"))
        sub, opened_by_state = streams.subscribe("a", SESSION)
        assert opened_by_state
        return sent, [sub.queue.get_nowait()[2] for _ in range(sub.queue.qsize())]

    sent, deliveries = asyncio.run(run())
    assert sent == [] and deliveries == [None]  # kept for "a", not waited on by ξ_sync
