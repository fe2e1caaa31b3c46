"""The synchronizer's registry: who is registered, in which session, and whose lease runs.

A learner holds a lease while it is heard from; one whose lease expired is no longer
waited for and must register again (it may have missed updates). Registering opens a new
session; requests of an older session are refused as superseded, requests of another
synchronizer incarnation as unknown, so work measured from a state the learner no longer
holds can never reach a merge.

A learner id belongs to one process at a time. When a later process (another *boot*)
registers under an id, the earlier one is *replaced*: its requests, and any join it tries
again, are refused as ``replaced`` so that it stops instead of taking the id back (an
orphaned worker and its restart would otherwise swap the id back and forth for ever).

Session numbers grow with every registration but carry 20 unguessable low bits (from the
driver's secret salt), and refusals never name another learner's session: speaking for a
learner takes more than watching the refusals.

The registry is bounded: at most ``max_learners`` leases at once (further joins are refused
as ``registry_full``), and learners dead for ``forget_after_s`` are forgotten (their counts
are kept as totals), so neither a burst of registrations nor a long run grows it without end.
While the synchronizer sends a (re)joining learner the global state, its lease does not
run: on a slow link the state can take longer than a lease, and a learner whose lease ran
out during its own join would register again for ever. The driver reports when the state
is delivered (``Synchronizer.handle(StateDelivered)``); the lease starts then.
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable, Iterable

from ddiloco.core.shared.actions import MergedContribution
from ddiloco.core.shared.deadlines import starved_after_s
from ddiloco.core.shared.messages import Contribution, Join, Rejected, RejectReason, Request, Session
from ddiloco.core.sync_side.learner_record import Forgotten, LearnerRecord
from ddiloco.core.sync_side.refusals import Refusals
from ddiloco.core.sync_side.status_snapshot import LearnerStatus

SESSION_TAG_BITS = 20
"""Low bits of a session number that are unguessable; the bits above count registrations."""


class Registry:
    def __init__(self, incarnation: int, lease_s: float, *, period: int = 1, salt: int = 0, max_learners: int = 0,
                 data_shards: int = 0, forget_after_s: float = 0.0, kept_s: float = 0.0) -> None:
        self.incarnation = incarnation
        self.kept_s = kept_s
        """The wall time the most progress a learner keeps across a registration takes at the fastest
        plausible step (``staleness_max`` periods at ``min_step_s``): a restored boot's head start."""
        self.lease_s = lease_s
        self.data_shards = data_shards
        self.period = period
        self.starved_episodes = 0
        self.max_learners = max_learners
        self.forget_after_s = forget_after_s
        self.records: dict[str, LearnerRecord] = {}
        self.forgotten = Forgotten()
        self._salt = salt.to_bytes(16, "little", signed=False) if salt >= 0 else b""
        self._next_session = 1

    def _new_session(self) -> Session:
        counter = self._next_session
        self._next_session += 1
        digest = hashlib.blake2b(counter.to_bytes(8, "little"), key=self._salt, digest_size=8).digest()
        return Session(self.incarnation, (counter << SESSION_TAG_BITS) | (int.from_bytes(digest, "little") >> (64 - SESSION_TAG_BITS)))

    # ---- registration --------------------------------------------------------------------

    def register(self, join: Join, now: float, *, admission_s: float, window_s: float,
                 tokens_per_step: int) -> LearnerRecord:
        """Open a new session for ``join``: it is admitting for ``admission_s`` (its state on the
        way) and lives ``window_s`` without its state arriving (``deadlines.admission_window_s``).

        :class:`Rejected` when its boot was replaced by a later one, or the registry is full.
        """
        rec = self.records.get(join.learner_id)
        if rec is not None and join.boot in rec.retired_boots:
            raise Rejected(RejectReason.REPLACED, f"a later process registered as {join.learner_id!r}: "
                                                  "this one must stop")
        if (rec is None or not rec.alive) and self.max_learners and self.alive_count() >= self.max_learners:
            raise Rejected(RejectReason.REGISTRY_FULL, f"{self.max_learners} learners hold a lease already "
                                                       "(at most four times run.learners)")
        session = self._new_session()
        same_boot = rec is not None and rec.boot == join.boot and rec.claims_since_s is not None
        restored = rec is not None and rec.boot == join.boot and rec.claims_since_s is None  # a checkpoint's boot
        if rec is None:
            rec = self.records[join.learner_id] = LearnerRecord(session=session,
                                                                 data_shard=self.data_shard(join.learner_id))
        elif rec.boot and rec.boot != join.boot:
            rec.retired_boots.append(rec.boot)
        rec.session = session
        rec.boot = join.boot
        rec.alive = True
        rec.starved = False
        rec.heard = False
        rec.dead_since_s = None
        rec.registrations += 1
        rec.tokens_per_step = tokens_per_step
        rec.session_started_s = now
        rec.last_seq.clear()  # a new session numbers its contributions from 0
        rec.merged_through.clear()
        rec.accepted_at.clear()
        if not same_boot:  # another process, or the first registration here: its claims start now
            rec.claims_head_s = self.kept_s if restored else 0.0  # it may keep what the previous incarnation held
            rec.claims_since_s = now
            rec.steps_accepted.clear()
            rec.compute_accepted.clear()
        rec.admitting_until_s = now + admission_s
        rec.last_seen_s = now
        rec.lease_until_s = now + window_s
        return rec

    def data_shard(self, learner_id: str) -> int:
        """A learner's part of the data: kept once given; a new id gets its trailing number if it
        names a shard (``learner-3``), else the first shard nobody listed holds, else round robin."""
        rec = self.records.get(learner_id)
        if rec is not None:
            return rec.data_shard
        m = self.data_shards
        if not m:
            return 0
        match = re.search(r"(\d+)$", learner_id)
        if match and int(match.group(1)) < m:
            return int(match.group(1))
        held = {r.data_shard for r in self.records.values()}
        return next((i for i in range(m) if i not in held), len(self.records) % m)

    def delivered(self, learner_id: str, session: Session, ok: bool, now: float) -> None:
        """The state sent for ``session`` arrived (``ok``) or the transfer failed: the lease runs from now."""
        rec = self.records.get(learner_id)
        if rec is None or rec.session != session or rec.admitting_until_s is None:
            return
        rec.admitting_until_s = None
        if rec.claims_since_s == rec.session_started_s:  # the boot's first session: its work starts now
            rec.claims_since_s = now
        rec.session_started_s = now
        rec.lease_until_s = now + (self.lease_s if ok else 0.0)

    def make_room(self, join: Join, now: float) -> str | None:
        """When ``join`` needs a lease and every lease is held: a learner whose work was accepted here
        before (one of the run's, restarting) takes the lease of the oldest *idle* registration, one
        never heard from since its join and of an id with no accepted work: it ends now, and its
        name is returned. A stranger waits for a lease to end (``registry_full``): a flood of joins
        abandoned once the state arrived holds every lease for a lease each, and without this an
        honest learner restarting meanwhile could not get back in (issue 53)."""
        rec = self.records.get(join.learner_id)
        if (not self.max_learners or rec is None or rec.alive or not rec.accepted
                or join.boot in rec.retired_boots or self.alive_count() < self.max_learners):
            return None
        idle = [(r.session_started_s, name) for name, r in self.records.items() if self._idle(r)]
        if not idle:
            return None
        _, name = min(idle)
        self._end_lease(self.records[name], now)
        return name

    @staticmethod
    def _idle(rec: LearnerRecord) -> bool:
        return rec.alive and not rec.heard and not rec.accepted

    def idle(self, now: float) -> tuple[int, float]:
        """Registrations holding a lease without being heard from since their join (never trained
        here): how many, and the age of the oldest (0 if none)."""
        since = [rec.session_started_s for rec in self.records.values() if self._idle(rec)]
        return len(since), (now - min(since) if since else 0.0)

    def renew(self, rec: LearnerRecord, now: float) -> None:
        rec.heard = True
        rec.last_seen_s = now
        rec.lease_until_s = max(rec.lease_until_s, now + self.lease_s)

    def check(self, learner_id: str, session: Session, boot: str | None = None) -> LearnerRecord:
        """The live record of this session, or :class:`Rejected` saying why not.

        ``boot``: the process that sent the request, when it says (a later boot holding the
        id makes the refusal ``replaced``)."""
        if session.incarnation != self.incarnation:
            raise Rejected(RejectReason.UNKNOWN_LEARNER,
                           f"session {session} belongs to another synchronizer incarnation: register again")
        rec = self.records.get(learner_id)
        if rec is None or not rec.alive:
            raise Rejected(RejectReason.UNKNOWN_LEARNER,
                           f"learner {learner_id!r} is not registered (or its lease expired)")
        if session.number < rec.session.number:
            if boot is not None and boot != rec.boot:
                raise Rejected(RejectReason.REPLACED, f"a later process registered as {learner_id!r}: "
                                                      "this one must stop")
            raise Rejected(RejectReason.SUPERSEDED, f"session {session} was replaced by a later registration")
        if session != rec.session:
            raise Rejected(RejectReason.UNKNOWN_LEARNER, f"session {session} was never opened for {learner_id!r}")
        return rec

    def problem(self, learner_id: str, session: Session, boot: str | None = None) -> Rejected | None:
        """What :meth:`check` would raise, or None."""
        try:
            self.check(learner_id, session, boot)
        except Rejected as err:
            return err
        return None

    def refused(self, request: Request, err: Rejected) -> None:
        """A request of a listed learner refused: counted, a contribution's lost work in its ledger."""
        rec = self.records.get(request.learner_id)
        if rec is None:
            return
        rec.rejected += 1
        if isinstance(request, Contribution):
            rec.refusals.add(err.reason, *err.work_lost(request))

    def merged(self, merged: Iterable[MergedContribution], fragment: int) -> None:
        """A round merged these: each current session's newest merged work of ``fragment``."""
        for m in merged:
            rec = self.records.get(m.learner_id)
            if rec is not None and rec.session.number == m.session:
                rec.merged_through[fragment] = (m.base_version, m.first_step + m.steps - 1)

    @staticmethod
    def repeats(rec: LearnerRecord, c: Contribution) -> None:
        """:class:`Rejected` (``repeated``) if ``c`` is measured from no later an anchor than the
        session's newest merged contribution of its fragment: it carries that work again."""
        base, last_merged = rec.merged_through.get(c.fragment, (-1, 0))
        if c.base_version > base:
            return
        new_steps = max(0, min(c.steps, c.first_step + c.steps - 1 - last_merged))
        raise Rejected(RejectReason.REPEATED, f"Δ of fragment {c.fragment} measured from version {c.base_version}, "
                       f"no later than the one merged before it (from version {base}): it carries that work again",
                       lost=(new_steps, c.tokens * new_steps // max(1, c.steps)))

    def accepted(self, rec: LearnerRecord, c: Contribution, now: float) -> None:
        """Record ``c`` (its times already clipped to what is plausible) as accepted at ``now``."""
        fragment = c.fragment
        rec.last_seq[fragment] = c.seq
        rec.steps_accepted[fragment] = rec.steps_accepted.get(fragment, 0) + c.steps
        rec.compute_accepted[fragment] = rec.compute_accepted.get(fragment, 0.0) + c.compute_s
        if c.step_time_s:  # 0: not measured yet, nothing to learn
            rec.step_time_s = c.step_time_s
        rec.accepted_at[fragment] = now
        rec.accept_times.append(now)
        rec.accepted += 1
        rec.starved = False

    # ---- link starvation -------------------------------------------------------------------

    def _starves_at(self, rec: LearnerRecord) -> float:
        return rec.last_progress_s() + starved_after_s(self.lease_s, self.period, rec.step_time_s or self.fastest_step_s())

    def _may_starve(self, rec: LearnerRecord) -> bool:
        return rec.alive and not rec.starved and rec.admitting_until_s is None

    def newly_starved(self, now: float) -> list[tuple[str, float]]:
        """Live learners whose work stopped reaching the synchronizer by ``now``, with for how long."""
        out = []
        for name in sorted(self.records):
            rec = self.records[name]
            if self._may_starve(rec) and now >= self._starves_at(rec):
                rec.starved = True
                self.starved_episodes += 1
                out.append((name, now - rec.last_progress_s()))
        return out

    def next_starvation(self) -> float | None:
        times = [self._starves_at(r) for r in self.records.values() if self._may_starve(r)]
        return min(times) if times else None

    # ---- leases and forgetting -------------------------------------------------------------

    def alive(self) -> list[str]:
        return sorted(name for name, rec in self.records.items() if rec.alive)

    def counted(self) -> list[str]:
        """The live learners a round waits for and the quorum counts: every live one but the idle
        registrations (no run's learner, and never heard from since their join: a flood's). Counted,
        a flood's registrations raised the quorum above the learners that train and kept every round
        from closing early with all of them in (issue 53)."""
        return sorted(name for name, rec in self.records.items() if rec.alive and not self._idle(rec))

    def alive_count(self) -> int:
        return sum(1 for rec in self.records.values() if rec.alive)

    def expire(self, now: float) -> list[str]:
        """Leases that ran out by ``now``, in name order (their learners are no longer waited for)."""
        expired = []
        for name in sorted(self.records):
            rec = self.records[name]
            if rec.alive and rec.lease_until_s <= now:
                self._end_lease(rec, now)
                expired.append(name)
        return expired

    @staticmethod
    def _end_lease(rec: LearnerRecord, now: float) -> None:
        rec.alive = False
        rec.lease_until_s = min(rec.lease_until_s, now)
        rec.dead_since_s = now
        rec.admitting_until_s = None

    def forget(self, now: float, also: Callable[[str], None]) -> tuple[str, ...]:
        """Learners dead for ``forget_after_s`` (or, beyond twice ``max_learners`` records, the oldest
        dead, those that never trained here first: a flood's strangers go before the run's learners, who
        keep their place in :meth:`make_room`): dropped from the registry (and, by ``also``, elsewhere),
        their counts kept in :attr:`forgotten`."""
        dead = sorted((rec.accepted > 0, rec.dead_since_s, name) for name, rec in self.records.items()
                      if not rec.alive and rec.dead_since_s is not None)
        limit = 2 * self.max_learners if self.max_learners else 0
        excess = len(self.records) - limit if limit else 0
        names = [name for i, (_, since, name) in enumerate(dead)
                 if i < excess or (self.forget_after_s and now - since >= self.forget_after_s)]
        f = self.forgotten
        for name in names:
            rec = self.records.pop(name)
            also(name)
            f = Forgotten(f.learners + 1, f.accepted + rec.accepted, f.rejected + rec.rejected,
                          f.registrations + rec.registrations)
        self.forgotten = f
        return tuple(names)

    def next_expiry(self) -> float | None:
        times = [r.lease_until_s for r in self.records.values() if r.alive]
        return min(times) if times else None

    def fastest_step_s(self) -> float:
        times = [r.step_time_s for r in self.records.values() if r.alive and r.step_time_s is not None]
        return min(times) if times else 0.0

    def statuses(self, now: float | None, tokens_of: Callable[[str], int],
                 position_of: Callable[[str], int]) -> tuple[LearnerStatus, ...]:
        """Every listed learner, by name; rates as of ``now`` (of each one's last message without it)."""
        return tuple(
            LearnerStatus(name, r.alive, r.last_seen_s, r.accepted, r.rejected, r.registrations, r.step_time_s,
                          tokens_of(name), r.accepted_per_min(r.last_seen_s if now is None else now), r.starved,
                          r.admitting_until_s is not None, position_of(name), dict(r.refusals.count),
                          dict(r.refusals.steps), dict(r.refusals.tokens))
            for name, r in sorted(self.records.items())
        )

    def state_dict(self) -> dict[str, dict]:
        return {name: {"accepted": r.accepted, "rejected": r.rejected, "registrations": r.registrations,
                       "retired_boots": list(r.retired_boots) + ([r.boot] if r.boot else []),
                       "data_shard": r.data_shard, "refusals": r.refusals.state_dict()}
                for name, r in self.records.items()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Counters and replaced boots only: leases are not restored, every learner must register again.

        The boot that held an id at the checkpoint may register again (a frozen learner, or one
        that lost only its connection); the ones it had replaced may not."""
        self.records = {}
        for name, v in state.items():
            rec = LearnerRecord(session=Session(self.incarnation, 0), alive=False, accepted=int(v["accepted"]),
                                rejected=int(v["rejected"]), registrations=int(v.get("registrations", 0)),
                                data_shard=int(v.get("data_shard", 0)),
                                refusals=Refusals.from_state(v.get("refusals")))
            boots = [str(b) for b in v.get("retired_boots", [])]
            rec.retired_boots.extend(boots[:-1])
            rec.boot = boots[-1] if boots else ""
            self.records[name] = rec
