"""Which uploads the synchronizer holds at once, and which it ends to make way.

An upload holds a buffer of up to its fragment's encoded size from its header to its last
message, so once its header named a live session of its learner it is admitted here, and only
here: at most one per learner and fragment and :data:`UPLOADS_PER_LEARNER` per learner
(``busy`` beyond: the learner retries, or folds the work into its next contribution), and room
for as many for every lease the registry grants. A learner that registered again ends its older
session's uploads (``superseded``); when every place is taken, the uploads of sessions no longer
live make way (``unknown_learner``). The order of these questions is decided here, once
(:meth:`UploadAdmission.consider`, then :meth:`UploadAdmission.with_live`); the drivers (the
service's ``runtime/sync/call_limits.py``, the simulator's ``sim/sync_node.py``) hold the buffers
and the streams and ask the core which sessions are live in between; they decide nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ddiloco.core.shared.messages import RejectReason, Session

UPLOADS_PER_LEARNER = 2
"""Uploads one learner may have in flight: one, and one its client gave up on that the server has
not seen end yet (a learner sends one fragment at a time)."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """An admitted upload: at most one per (learner, session, fragment) at a time."""

    learner: str
    session: Session
    fragment: int


@dataclass(frozen=True, slots=True)
class Ended:
    """An upload ended to make way, and why (what its stream is closed with)."""

    upload: InFlight
    reason: RejectReason
    detail: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the admission made of an upload's header so far."""

    ended: list[Ended]
    """Uploads ended to make way: their streams are closed with why."""
    refused: tuple[RejectReason, str] | None
    """This upload refused (``busy``), or None."""
    check: list[InFlight]
    """Every place taken: ask the core which of these uploads' sessions are live, then
    :meth:`UploadAdmission.with_live`; empty: nothing to ask."""


class UploadAdmission:
    def __init__(self, max_learners: int) -> None:
        self.total = UPLOADS_PER_LEARNER * max_learners
        """Room for every lease the registry grants: live sessions alone never fill it."""
        self.in_flight: list[InFlight] = []

    def consider(self, learner: str, session: Session, fragment: int) -> Verdict:
        """A header of ``session`` (that the core just called live) for ``fragment``: its learner's older
        sessions' uploads end; a ``busy`` refusal needs no other question; with every place taken,
        the holders whose sessions the core must be asked about."""
        ended = self.superseded(learner, session)
        refused = self.refusal(learner, fragment)
        return Verdict(ended, refused, [] if refused else self.crowded())

    def with_live(self, learner: str, fragment: int, check: list[InFlight], live: list[bool]) -> Verdict:
        """The core's answer for ``check`` (:attr:`Verdict.check`): the uploads of ended sessions make
        way; the upload is refused if it is ``busy`` now (the same upload may have come again meanwhile)."""
        return Verdict(self.not_live(check, live), self.refusal(learner, fragment), [])

    def superseded(self, learner: str, session: Session) -> list[Ended]:
        """A header of ``session``: the uploads of ``learner``'s older sessions end."""
        return self._end([u for u in self.in_flight if u.learner == learner and u.session != session],
                         RejectReason.SUPERSEDED, lambda u: f"learner {u.learner!r} registered again")

    def refusal(self, learner: str, fragment: int) -> tuple[RejectReason, str] | None:
        """Why another upload of ``learner`` for ``fragment`` is refused now (``busy``), or None."""
        mine = [u for u in self.in_flight if u.learner == learner]
        if any(u.fragment == fragment for u in mine) or len(mine) >= UPLOADS_PER_LEARNER:
            return RejectReason.BUSY, (f"learner {learner!r} has an upload of fragment {fragment} or "
                                       f"{UPLOADS_PER_LEARNER} uploads in flight: try again later")
        return None

    def crowded(self) -> list[InFlight]:
        """With every place taken, the uploads whose sessions must be checked to be live; else none."""
        return list(self.in_flight) if len(self.in_flight) >= self.total else []

    def not_live(self, uploads: list[InFlight], live: list[bool]) -> list[Ended]:
        """Of ``uploads`` (from :meth:`crowded`), those whose session the core called ended make way."""
        return self._end([u for u, ok in zip(uploads, live) if not ok], RejectReason.UNKNOWN_LEARNER,
                         lambda u: f"the session of {u.learner!r} ended during its upload")

    def admit(self, upload: InFlight) -> None:
        self.in_flight.append(upload)

    def end(self, upload: InFlight) -> None:
        """The upload finished, failed or was closed: its place is free."""
        if upload in self.in_flight:
            self.in_flight.remove(upload)

    def _end(self, uploads: list[InFlight], reason: RejectReason, detail: Callable[[InFlight], str]) -> list[Ended]:
        ended = [Ended(u, reason, detail(u)) for u in uploads if u in self.in_flight]
        for e in ended:
            self.in_flight.remove(e.upload)
        return ended
