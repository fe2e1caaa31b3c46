"""When a learner sends each fragment, what a contribution counts, and what it waits for.

Per fragment the learner keeps the tokens, steps and compute seconds since it last sent that
fragment, the sequence number of its next contribution, the step at which it is next due
(the plan's offsets, then H after each send, or H after its round began: ``align_sends``),
and whether a sent contribution still awaits its update. This is the bookkeeping half of
:class:`~ddiloco.core.learner_side.learner_core.Learner`, which decides when to call it.

Steps are counted from the learner process's start (what is due when, in-flight sends); the
``first_step`` a contribution carries is numbered across restarts by the learner's data stream
instead: ``first_batch`` (where this process's data resumed) plus the step (``core/sync_side/data_position.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from ddiloco.core.shared.fragments import FragmentPlan
from ddiloco.core.shared.messages import Contribution


@dataclass(slots=True)
class Counters:
    """What the next contribution of a fragment carries."""

    tokens: int = 0
    steps: int = 0
    compute_s: float = 0.0
    first_step: int = 1


@dataclass(slots=True)
class _InFlight:
    """A fragment sent and not yet updated: it is not sent again until then (see :meth:`SendSchedule.held`),
    and a waiting learner waits for it."""

    sent_at_step: int
    sent_at_s: float
    hold_s: float
    """How long the next send of the fragment waits for this update (:meth:`SendSchedule.held`)."""
    wait_until_s: float | None = None
    """Set when the learner starts waiting for this fragment's update: until when (inf: no limit)."""
    waited: bool = False
    """The learner waited ``wait_until_s`` out and trains on; the next send of the fragment still
    waits for the update (:meth:`SendSchedule.held`)."""


def _first_due(offset: int, period: int) -> int:
    """The first step s >= 1 with s % period == offset (the plan's schedule)."""
    return offset if offset >= 1 else period


class SendSchedule:
    def __init__(self, plan: FragmentPlan, hold_s: float, recheck_s: float) -> None:
        self.period = plan.period
        self.hold_s = hold_s
        """How long a send waits for the update of the fragment's last one (``deadlines.HOLD_LEASES``)."""
        self.recheck_s = recheck_s
        """How long it waits once more after a ``repeated`` refusal (:meth:`repeated`)."""
        self._repeated: set[int] = set()
        """Fragments a ``repeated`` refusal answered since their last update."""
        self.counters = [Counters() for _ in plan.fragments]
        self.seq = [0] * len(plan.fragments)
        self._position = [_first_due(f.offset, plan.period) for f in plan.fragments]
        """Each fragment's step in a period (1..H): the order in which every learner sends them."""
        self.next_due = list(self._position)
        self._in_flight: dict[int, _InFlight] = {}
        self._unanswered: dict[int, int] = {}
        """Per fragment, the sequence number of a contribution whose call has not ended yet."""
        self._folded: dict[int, list[tuple[int, Counters]]] = {}
        """Per fragment, contributions folded into the next one since its last update: each one's
        sequence number and what it carried (:meth:`fold`, :meth:`updated`)."""
        self.first_batch = 0
        """The batch of the learner's data stream its first step trained (``resume_at``)."""

    def resume_at(self, batch: int) -> None:
        """Before the first step: this process's data resumes at ``batch`` (contributions number their steps from it)."""
        if any(c.steps for c in self.counters):
            raise RuntimeError("a learner's data resumes before its first step, not after")
        self.first_batch = batch
        for c in self.counters:
            c.first_step = batch + 1

    def restart(self, p: int, step: int, *, keep_counters: bool = False) -> None:
        """A global value was adopted for ``p`` (a new session): sequence numbers from 0, and count
        from the next step unless ``keep_counters`` (the learner kept its progress on ``p``)."""
        if not keep_counters:
            self.counters[p] = Counters(first_step=self.first_batch + step + 1)
        self.seq[p] = 0
        self._in_flight.pop(p, None)
        self._unanswered.pop(p, None)
        self._folded.pop(p, None)
        self._repeated.discard(p)

    def count(self, tokens: int, duration_s: float) -> None:
        """One inner step, for every fragment."""
        for c in self.counters:
            c.tokens += tokens
            c.steps += 1
            c.compute_s += duration_s

    def due(self, step: int, now: float) -> list[int]:
        """Fragments due at ``step`` and not held back."""
        return [p for p, due in enumerate(self.next_due) if due <= step and not self.held(p, now)]

    def held(self, p: int, now: float) -> bool:
        """Fragment p's last contribution has had no update yet: a Δ sent now would be measured
        from the same anchor and carry that contribution's progress a second time once it is
        merged. The send waits for the update (training does not), for up to :attr:`hold_s`:
        steps of a few milliseconds outrun any round trip, and a bound counted in steps (two
        periods) let a learner alone merge its progress twice and diverge. An update later than
        that was lost; the send that follows finds out (``repeated``). (A bound measured from the
        recent waits for updates was too short: in a run of several learners the next update of a
        fragment is often another learner's round, sooner than the one that merges this learner's
        work, and a sharded chaos run earned 5-23 ``repeated`` refusals.) It always waits while the
        call itself is unanswered: on a link whose round trip spans many periods, sends would
        otherwise queue behind each other without bound, each to be refused as stale; held, the
        next one folds in their steps."""
        if p in self._unanswered:
            return True
        flight = self._in_flight.get(p)
        return flight is not None and now - flight.sent_at_s < flight.hold_s

    def updated(self, p: int, merged: Collection[int] = ()) -> int:
        """An update of p came, merging this session's contributions ``merged`` (sequence numbers):
        a ``repeated`` refusal before it is forgotten. A folded contribution among them reached the
        model, only its answer was lost: its counters leave the next contribution, whose Δ (now
        measured from this update) no longer carries its work. Returns how many such there were."""
        self._repeated.discard(p)
        found = 0
        for seq, carried in self._folded.pop(p, []):
            if seq in merged:
                found += 1
                c = self.counters[p]
                c.tokens = max(0, c.tokens - carried.tokens)
                c.steps = max(0, c.steps - carried.steps)
                c.compute_s = max(0.0, c.compute_s - carried.compute_s)
                c.first_step = max(c.first_step, carried.first_step + carried.steps)
        return found

    def repeated(self, p: int, step: int, now: float) -> bool:
        """The synchronizer merged p's last work, and refused the send after it as ``repeated``: the
        update was made before the refusal, so only its way down the update stream is left. Wait for
        it once more, ``recheck_s`` from ``now`` (True). The second such refusal with no update in
        between (False): the update was lost, and only the state brings it."""
        if p in self._repeated:
            return False
        self._repeated.add(p)
        self._in_flight[p] = _InFlight(sent_at_step=step, sent_at_s=now, hold_s=self.recheck_s)
        return True

    def answered(self, p: int, seq: int) -> None:
        """The call that carried contribution ``seq`` of fragment p ended (accepted, refused or undelivered)."""
        if self._unanswered.get(p) == seq:
            del self._unanswered[p]

    def take(self, p: int, step: int, now: float) -> tuple[Counters, int]:
        """Fragment p goes out at ``step`` (at ``now``): its counters and sequence number, and a fresh start."""
        counters, seq = self.counters[p], self.seq[p]
        self.seq[p] += 1
        self.counters[p] = Counters(first_step=self.first_batch + step + 1)
        self.next_due[p] = step + self.period
        self._in_flight[p] = _InFlight(sent_at_step=step, sent_at_s=now, hold_s=self.hold_s)
        self._unanswered[p] = seq
        return counters, seq

    def fold(self, c: Contribution) -> None:
        """A contribution whose call got no answer: its counters go into the fragment's next one
        (its Δ needs no keeping: the next Δ is measured from the same anchor and contains it).

        No answer does not mean no arrival: the answer may be what was lost, after the
        synchronizer accepted it. So the next send waits for the update as after any send
        (:meth:`held`). If the update merged it, its counters leave the next contribution
        (:meth:`updated`); if the update did not, the next Δ, measured from the update, still
        holds its work. Sent at once, the next Δ would carry merged work again and be refused
        (``repeated``), with the steps since."""
        counters = self.counters[c.fragment]
        counters.tokens += c.tokens
        counters.steps += c.steps
        counters.compute_s += c.compute_s
        counters.first_step = min(counters.first_step, c.first_step)
        self.answered(c.fragment, c.seq)
        self._folded.setdefault(c.fragment, []).append((c.seq, Counters(c.tokens, c.steps, c.compute_s, c.first_step)))

    def landed(self, p: int) -> None:
        """Fragment p's contribution was answered (an update came, or a refusal): no longer in flight."""
        self._in_flight.pop(p, None)

    def in_phase_with(self, versions: Sequence[int], step: int) -> None:
        """A learner that waits for each fragment it sends (synchronous DiLoCo) adopted a state in
        the middle of a period (after a restart or a rejoin): send in the order everyone else does,
        starting with the fragment the others wait on.

        Every learner sends the fragments in the order of their steps in a period and blocks until
        the one it sent is merged, and every round needs everyone (a strict quorum). So the
        fragment the others wait on is the first, in that order, of those with the lowest version.
        Counting from its own step 0, a restarted learner would send another fragment first and
        wait on that one: each side would wait for the other for good. With every version equal
        (the start, or between two periods) the plan's own schedule is already in phase."""
        if len(set(versions)) <= 1:
            return
        first = min(range(len(versions)), key=lambda p: (versions[p], self._position[p]))
        for p in range(len(versions)):
            self.next_due[p] = step + 1 + (self._position[p] - self._position[first]) % self.period

    def align(self, p: int, step: int, steps_since_round_began: int) -> None:
        """The next contribution of p is due H steps after its round began. A learner that missed
        the round (out of phase) skips its own slot: its steps go into the next round's
        contribution, sent in phase with everyone else's.

        The synchronizer measures a round's age from the first contribution's *arrival* to the
        update's departure; it leaves out that contribution's way there and the update's way
        back. A learner whose own send of p is answered by this update knows the round began,
        in its steps, no later than that send: without this bound every period grows by the
        round trip (on a 5 Mbit/s link about two steps in twelve, and that share of the work
        never reached the global model)."""
        flight = self._in_flight.pop(p, None)
        if flight is not None:
            steps_since_round_began = max(steps_since_round_began, step - flight.sent_at_step)
        self.next_due[p] = step + max(1, self.period - steps_since_round_began)

    # ---- waiting for updates (synchronous DiLoCo, protocol.max_wait_s) ---------------------

    def start_waits(self, step: int, now: float, *, after_steps: int, limit_s: float) -> None:
        """Fragments sent ``after_steps`` steps ago without an update: wait for them until ``now + limit_s``."""
        for flight in self._in_flight.values():
            if flight.wait_until_s is None and not flight.waited and step - flight.sent_at_step >= after_steps:
                flight.wait_until_s = now + limit_s
        self.expire_waits(now)

    def expire_waits(self, now: float) -> None:
        """Waited long enough for an update that did not come: train on."""
        for flight in self._in_flight.values():
            if flight.wait_until_s is not None and now >= flight.wait_until_s:
                flight.wait_until_s, flight.waited = None, True

    def waiting(self, now: float) -> bool:
        return any(f.wait_until_s is not None and now < f.wait_until_s for f in self._in_flight.values())

    def wait_deadlines(self) -> list[float]:
        return [f.wait_until_s for f in self._in_flight.values()
                if f.wait_until_s is not None and f.wait_until_s != float("inf")]
