"""The synchronizer's registry: who is registered, in which session, and whose lease runs.

A learner holds a lease while it is heard from; one whose lease expired is no longer
waited for and must register again (it may have missed updates). Registering opens a new
session; requests of an older session are refused as superseded, requests of another
synchronizer incarnation as unknown, so work measured from a state the learner no longer
holds can never reach a merge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddiloco.core.messages import RejectReason, Rejected, Session


@dataclass(slots=True)
class LearnerRecord:
    """What the synchronizer knows of one learner."""

    session: Session
    alive: bool = True
    lease_until_s: float = 0.0
    last_seen_s: float = 0.0
    step_time_s: float | None = None
    accepted: int = 0
    rejected: int = 0
    registrations: int = 0
    last_seq: dict[int, int] = field(default_factory=dict)
    """Last accepted sequence number per fragment, in the current session."""


class Registry:
    def __init__(self, incarnation: int, lease_s: float) -> None:
        self.incarnation = incarnation
        self.lease_s = lease_s
        self.records: dict[str, LearnerRecord] = {}
        self._next_session = 1

    def register(self, learner_id: str, now: float) -> LearnerRecord:
        session = Session(self.incarnation, self._next_session)
        self._next_session += 1
        rec = self.records.get(learner_id)
        if rec is None:
            rec = self.records[learner_id] = LearnerRecord(session=session)
        rec.session = session
        rec.alive = True
        rec.registrations += 1
        rec.last_seq.clear()  # a new session numbers its contributions from 0
        self.renew(rec, now)
        return rec

    def renew(self, rec: LearnerRecord, now: float) -> None:
        rec.last_seen_s = now
        rec.lease_until_s = now + self.lease_s

    def check(self, learner_id: str, session: Session) -> LearnerRecord:
        """The live record of this session, or :class:`Rejected` saying why not."""
        if session.incarnation != self.incarnation:
            raise Rejected(RejectReason.UNKNOWN_LEARNER,
                           f"session {session} belongs to another synchronizer incarnation: register again")
        rec = self.records.get(learner_id)
        if rec is None or not rec.alive:
            raise Rejected(RejectReason.UNKNOWN_LEARNER,
                           f"learner {learner_id!r} is not registered (or its lease expired)")
        if session.number < rec.session.number:
            raise Rejected(RejectReason.SUPERSEDED, f"session {session} was replaced by {rec.session}")
        if session != rec.session:
            raise Rejected(RejectReason.UNKNOWN_LEARNER, f"session {session} was never opened for {learner_id!r}")
        return rec

    def alive(self) -> list[str]:
        return sorted(name for name, rec in self.records.items() if rec.alive)

    def expire(self, now: float) -> list[str]:
        """Leases that ran out by ``now``, in name order (their learners are no longer waited for)."""
        expired = []
        for name in sorted(self.records):
            rec = self.records[name]
            if rec.alive and rec.lease_until_s <= now:
                rec.alive = False
                expired.append(name)
        return expired

    def next_expiry(self) -> float | None:
        times = [r.lease_until_s for r in self.records.values() if r.alive]
        return min(times) if times else None

    def fastest_step_s(self) -> float:
        times = [r.step_time_s for r in self.records.values() if r.alive and r.step_time_s is not None]
        return min(times) if times else 0.0

    def state_dict(self) -> dict[str, dict[str, int]]:
        return {name: {"accepted": r.accepted, "rejected": r.rejected, "registrations": r.registrations}
                for name, r in self.records.items()}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        """Counters only: leases are not restored, every learner must register again."""
        self.records = {
            name: LearnerRecord(session=Session(self.incarnation, 0), alive=False, accepted=int(v["accepted"]),
                                rejected=int(v["rejected"]), registrations=int(v.get("registrations", 0)))
            for name, v in state.items()
        }
