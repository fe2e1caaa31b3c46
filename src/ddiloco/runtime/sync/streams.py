"""Learners' update streams: the synchronizer pushes every new fragment value as it is made.

Each learner holds one server stream (``Updates``), a sharded learner one per rank, each cut
to that rank's slice (``slice_parts.py``); a broadcast is serialized once per distinct cut and
queued to every recipient's stream, and a stop notice goes the same way. What is replayed to
a learner that resubscribes, and when a stream is too slow, is the protocol's rule
(:mod:`ddiloco.core.sync_side.replay`, followed by the virtual cluster too).

A session's stream opens when its state starts to go out (``open_for``), before the first
fragment is copied, and the learner's ``Updates`` call takes it over: every update made after
the copies reaches the learner in order, however long the transfer took. Opened only when the
call came, it depended on the replay log, which keeps a few updates per fragment: a join over
a slow link to a fast-merging synchronizer found a gap at its first update, joined again, and
did so in a loop (five rejoins on one shard in a chaos run on a 5 Mbit/s link).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ddiloco.core.shared.messages import FragmentUpdate, Session, StopNotice
from ddiloco.core.sync_side.replay import ReplayLog, too_slow
from ddiloco.runtime.sync.slice_parts import Part
from ddiloco.runtime.wire import update_chunks

log = logging.getLogger("ddiloco.sync")

CLOSE = object()
"""What a stream's queue carries, besides (fragment, chunks, delivery) and stop notices, to end it."""


@dataclass(slots=True)
class Delivery:
    """One update on its way into its recipients' streams: ``on_sent`` runs once the last of
    them has written it, or dropped it with its stream (ξ_sync ends there: core/shared/grace.py)."""

    on_sent: Callable[[], None]
    pending: int = 0

    def done(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.on_sent()


@dataclass(slots=True)
class Subscriber:
    part: Part | None = None
    """The rank of a sharded learner this stream serves (its updates cut to its slice), or None: whole."""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    backlog: int = 0
    awaiting: Session | None = None
    """The session whose ``Updates`` call has not taken this stream over yet (None once it has).
    Its updates wait here without holding up their deliveries: a slow transfer does not stretch
    the time an update takes to reach the learners that follow (ξ_sync)."""


Cut = Callable[[FragmentUpdate, Part], FragmentUpdate]


class UpdateStreams:
    def __init__(self, fragments: int, replay_bytes: int, cut: Cut | None = None) -> None:
        self._subscribers: dict[str, dict[int, Subscriber]] = {}
        """Per learner, its streams by rank (0 for an unsharded learner)."""
        self._replay: ReplayLog[FragmentUpdate] = ReplayLog(fragments, replay_bytes)
        self._cut = cut

    def open_for(self, learner: str, session: Session, part: Part | None = None) -> None:
        """``session``'s state starts to go out: its stream begins here (replacing the rank's old one)."""
        self._replace(learner, Subscriber(part, awaiting=session))

    def subscribe(self, learner: str, session: Session, part: Part | None = None) -> tuple[Subscriber, bool]:
        """``learner``'s ``Updates`` call for ``session``: the stream its state opened, if it is still
        waiting (True: nothing to replay), else a new one replacing the rank's old one (False)."""
        rank = 0 if part is None else part[0]
        waiting = self._subscribers.get(learner, {}).get(rank)
        if waiting is not None and waiting.awaiting == session and waiting.part == part:
            waiting.awaiting = None
            return waiting, True
        return self._replace(learner, Subscriber(part)), False

    def _replace(self, learner: str, sub: Subscriber) -> Subscriber:
        ranks = self._subscribers.setdefault(learner, {})
        rank = 0 if sub.part is None else sub.part[0]
        previous = ranks.get(rank)
        if previous is not None:
            previous.queue.put_nowait(CLOSE)
        ranks[rank] = sub
        return sub

    def unsubscribe(self, learner: str, sub: Subscriber) -> None:
        """``sub``'s stream has ended: what it had not written is dropped."""
        ranks = self._subscribers.get(learner, {})
        rank = 0 if sub.part is None else sub.part[0]
        if ranks.get(rank) is sub:
            del ranks[rank]
            if not ranks:
                del self._subscribers[learner]
        while not sub.queue.empty():
            item = sub.queue.get_nowait()
            if isinstance(item, tuple) and item[2] is not None:
                item[2].done()

    def replay(self, have_versions: list[int], part: Part | None = None) -> Iterator[tuple[int, list[bytes]]]:
        """Recent updates newer than what a resubscribing learner holds, per fragment in order (cut to ``part``)."""
        for p, update in self._replay.since(have_versions):
            if part is not None:
                assert self._cut is not None
                update = self._cut(update, part)
            yield p, update_chunks(update)

    def publish(self, update: FragmentUpdate, recipients: tuple[str, ...],
                on_sent: Callable[[], None] | None = None) -> None:
        """Queue ``update`` to each recipient's stream; ``on_sent`` runs once every stream it
        was queued to has written it (never, if no recipient listens)."""
        cuts: dict[Part | None, list[bytes]] = {None: update_chunks(update)}  # serialized once per distinct cut
        self._replay.record(update.fragment, update.version, update, len(update.payload))
        delivery = Delivery(on_sent) if on_sent is not None else None
        for name in recipients:
            subs = list(self._subscribers.get(name, {}).values())  # not listening: it replays or rejoins later
            if any(too_slow(sub.backlog) for sub in subs):
                log.warning("learner %s: update stream too slow, closing it", name)
                self.close(name)
                continue
            for sub in subs:
                if sub.part not in cuts:
                    assert self._cut is not None and sub.part is not None
                    cuts[sub.part] = update_chunks(self._cut(update, sub.part))
                sub.backlog += 1
                counted = delivery if sub.awaiting is None else None
                sub.queue.put_nowait((update.fragment, cuts[sub.part], counted))
                if counted is not None:
                    counted.pending += 1

    def stop(self, recipients: tuple[str, ...] | None = None) -> None:
        """Tell learners (all subscribed ones by default) that the run's budget is spent."""
        names = list(self._subscribers) if recipients is None else recipients
        for name in names:
            for sub in self._subscribers.get(name, {}).values():
                sub.queue.put_nowait(StopNotice())

    def close(self, learner: str) -> None:
        """Close every stream of ``learner`` (all its ranks')."""
        for sub in self._subscribers.pop(learner, {}).values():
            sub.queue.put_nowait(CLOSE)

    def close_all(self) -> None:
        for name in list(self._subscribers):
            self.close(name)
