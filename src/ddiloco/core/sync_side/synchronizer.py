"""The synchronizer as an I/O-free state machine.

Drivers feed it events through one entry point, ``handle(event, now)`` — a learner's
:class:`~ddiloco.core.shared.messages.Join`, ``Heartbeat``, ``Contribution`` or ``Leave``, a
:class:`~ddiloco.core.shared.actions.Tick` when ``next_deadline()`` comes — and carry out the
actions it returns (:mod:`ddiloco.core.shared.actions`): a reply to every request (admitted,
accepted or refused with a reason), broadcasts of new fragment values, records of closed
rounds, the stop of the run, checkpoints. It never reads a clock, sleeps or touches a
socket, and it reports what it knows through :meth:`Synchronizer.status`.

Everything that is a protocol decision lives here: validation and refusals, leases and
sessions, quorum and grace window, merge and outer step, the budget, the stop and the
final drain, and when to checkpoint. A request is validated whole before anything changes:
a refused one leaves every counter, lease and round as it was (only the refusal is counted).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from ddiloco.core.shared import deadlines
from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    Broadcast,
    Checkpoint,
    CloseReason,
    Finished,
    LearnersForgotten,
    LeaseExpired,
    LinkStarved,
    LogRound,
    MergedContribution,
    Refused,
    RoundClosed,
    StateDelivered,
    StopLearners,
    SyncAction,
    SyncEvent,
    SyncTimeObserved,
    Tick,
)
from ddiloco.core.shared.grace import GraceWindow
from ddiloco.core.shared.messages import (
    Contribution,
    FragmentValue,
    GlobalState,
    Heartbeat,
    Join,
    Leave,
    MergedRef,
    Rejected,
    RejectReason,
    Request,
)
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.shared.staleness import StalenessBound, staleness_weight
from ddiloco.core.sync_side.accumulate import BufferPool, RoundAccumulator
from ddiloco.core.sync_side.checkpoint_state import CheckpointState
from ddiloco.core.sync_side.claims import ClaimLimits, ClipReason, check_contribution
from ddiloco.core.sync_side.data_position import DataPositions, reached_by
from ddiloco.core.sync_side.learner_record import LearnerRecord
from ddiloco.core.sync_side.merge import MergeRuleName, merge_rule, token_weight
from ddiloco.core.sync_side.norm_bound import NormBound
from ddiloco.core.sync_side.outer import NesterovSGD
from ddiloco.core.sync_side.registry import Registry
from ddiloco.core.sync_side.rounds import GlobalFragment, Pending, RoundMove, RoundPhase
from ddiloco.core.sync_side.run_state import RunLimits, RunPhase, RunState
from ddiloco.core.sync_side.slice_assembly import SliceAssembler
from ddiloco.core.sync_side.status_snapshot import SyncCounters
from ddiloco.core.sync_side.sync_queries import SyncQueries


class Synchronizer(CheckpointState, SyncQueries):
    """Collects contributions per fragment, merges at quorum + grace, applies the outer step."""

    def __init__(
        self,
        config: ProtocolConfig,
        initial_values: Sequence[torch.Tensor],
        embedding_fragments: Sequence[int] = (),
        *,
        limits: RunLimits = RunLimits(),
        incarnation: int = 0,
        shard: int = 0,
        session_salt: int = 0,
    ) -> None:
        config.validate()
        limits.validate()
        self.config = config
        self.incarnation = incarnation
        self._uplink = config.uplink()
        self._downlink = config.downlink()
        self._outer = NesterovSGD(lr=config.outer_lr, momentum=config.outer_momentum)
        self._grace = GraceWindow(overlap_steps=config.overlap, gamma=config.grace_gamma, max_s=config.grace_max_s)
        if not 0 <= shard < config.shards:
            raise ValueError(f"shard {shard} of {config.shards}")
        self.shard = shard
        embeds = set(embedding_fragments)
        # A shard holds only the fragments it owns (p mod shards = shard), by their global index.
        self._fragments: dict[int, GlobalFragment] = {}
        self._buffers = BufferPool()
        for i in range(len(initial_values)):
            if config.shard_of(i) == shard:
                v = initial_values[i]  # a lazy sequence reads only the fragments this shard owns
                value = v.detach().to(torch.float32).flatten().clone()
                self._fragments[i] = GlobalFragment(
                    value=value, is_embedding=i in embeds, norm_bound=NormBound(float(torch.linalg.vector_norm(value))),
                    accumulator=RoundAccumulator(v.numel(), self._uplink,
                                                 merge_rule(MergeRuleName.MEAN if i in embeds else config.merge),
                                                 self._buffers),
                )
        self.state_bytes = deadlines.state_bytes_of(f.value.numel() for f in self._fragments.values())
        """The fp32 size of the fragments this synchronizer owns (what a join transfers)."""
        self._registry = Registry(incarnation, config.lease_s, period=config.period, salt=session_salt,
                                  max_learners=limits.max_learners, data_shards=limits.learners,
                                  forget_after_s=config.forget_after_s,
                                  kept_s=config.staleness_max * config.period * config.min_step_s)
        self._positions = DataPositions(self.owned)
        self._slices = SliceAssembler()
        """Sharded learners' contributions whose slices are not all in yet (``core/sync_side/slice_assembly.py``)."""
        self._claims = ClaimLimits(config.min_step_s, config.max_tokens_per_step)
        self._staleness = StalenessBound.of(config)
        self._run = RunState.new(limits, self._claims)
        self._counters = SyncCounters()
        self._last_event_s = 0.0
        """When the latest event came: the clock of a status asked for without a time."""

    # ---- the one entry point ---------------------------------------------------------------

    def handle(self, event: SyncEvent, now: float) -> list[SyncAction]:
        """Take one event at time ``now``; return what the driver must do, replies first."""
        self._last_event_s = max(self._last_event_s, now)
        if isinstance(event, Tick):
            actions = self._tick(now)
        elif isinstance(event, SyncTimeObserved):
            self._grace.observe_sync(event.seconds)
            return []
        elif isinstance(event, StateDelivered):
            self._registry.delivered(event.learner_id, event.session, event.ok, now)
            return []
        else:
            actions = self._request(event, now)
        after = self._after(now)
        if after and actions and self._stopping and isinstance(actions[0], (Accepted, Admitted)) and not actions[0].stop:
            actions[0] = replace(actions[0], stop=True)  # this very request spent the budget
        return actions + after

    def _request(self, request: Request, now: float) -> list[SyncAction]:
        handlers = {Join: self._join, Heartbeat: self._heartbeat, Contribution: self._contribute, Leave: self._leave}
        handler = handlers.get(type(request))
        if isinstance(request, Contribution) and request.slice is not None:
            handler = self._contribute_slice
        if handler is None:
            raise TypeError(f"not a synchronizer event: {request!r}")
        try:
            return handler(request, now)  # type: ignore[operator]
        except Rejected as err:
            self._counters.refused(request, err)
            self._registry.refused(request, err)
            return [Refused(request.learner_id, request, err.reason, err.detail)]

    # ---- requests ------------------------------------------------------------------------

    def _join(self, join: Join, now: float) -> list[SyncAction]:
        if self._run.phase is RunPhase.FINISHED:
            raise Rejected(RejectReason.FINISHED, "the run is over")
        evicted = self._registry.make_room(join, now)
        rec = self._registry.register(join, now, admission_s=self.admission_s(),
                                      window_s=deadlines.admission_window_s(self.state_bytes, self.config),
                                      tokens_per_step=self._claims.tokens_per_step(join.tokens_per_step))
        self._run.start(now)
        # The values travel separately, a fragment at a time (``fragment_value``): the reply names
        # the versions the learner will be sent at the least.
        state = GlobalState(tuple(FragmentValue(i, f.version, None) for i, f in self._fragments.items()),
                            incarnation=self.incarnation, session=rec.session,
                            data_position=self._positions.position(join.learner_id))
        return [Admitted(join.learner_id, state, stop=self._stopping, data_shard=rec.data_shard),
                *([LeaseExpired(evicted, now)] if evicted else [])]

    # Progress is cumulative per boot, so it is counted only from messages that are accepted:
    # a refused one's tokens come again with the learner's next accepted message, and a
    # message from no registered session can never move the budget.

    def _report(self, rec: LearnerRecord, learner_id: str, request: Heartbeat | Leave | Contribution,
                now: float) -> None:
        if request.progress is not None:
            self._run.progress.report(learner_id, request.progress, now=now, since_s=rec.session_started_s,
                                      tokens_per_step=rec.tokens_per_step)

    def _heartbeat(self, beat: Heartbeat, now: float) -> list[SyncAction]:
        rec = self._registry.check(beat.learner_id, beat.session, beat.progress.boot)
        self._report(rec, beat.learner_id, beat, now)
        self._registry.renew(rec, now)
        return [Accepted(beat.learner_id, beat, stop=self._stopping)]

    def _leave(self, leave: Leave, now: float) -> list[SyncAction]:
        rec = self._registry.check(leave.learner_id, leave.session, leave.progress.boot)
        self._report(rec, leave.learner_id, leave, now)
        rec.lease_until_s = now  # stop waiting for it now rather than when its lease runs out
        return [Accepted(leave.learner_id, leave, stop=self._stopping), *self._tick(now)]

    def _contribute(self, c: Contribution, now: float) -> list[SyncAction]:
        if self._run.phase is RunPhase.FINISHED:
            raise Rejected(RejectReason.FINISHED, "the run is over")
        rec = self._registry.check(c.learner_id, c.session, None if c.progress is None else c.progress.boot)
        norm, pending, plausible, clipped = self._validate(c, rec, now)
        self._registry.repeats(rec, c)  # honest work, refused only once no member's check refuses it
        frag = self._fragments[c.fragment]
        frag.landed(c.learner_id, c.base_version, self._staleness, now)
        key = (c.learner_id, c.session)
        clip = frag.norm_bound.admit(key, c.seq, norm, self.config.delta_norm_ratio_max)
        # Valid whole: from here on nothing refuses it.
        self._counters.norms_clipped += int(clip < 1.0)
        self._report(rec, c.learner_id, c, now)
        self._counters.claims_clipped.update(str(reason) for reason in clipped)
        self._registry.accepted(rec, plausible, now)
        self._registry.renew(rec, now)
        merged = pending.contribution
        late = staleness_weight(frag.version - merged.base_version, self.config.staleness_max)
        frag.accumulator.add(key, c.payload, token_weight(merged.tokens, merged.steps) * late, norm, clip)
        frag.round.add(key, pending)
        return [Accepted(c.learner_id, c, stop=self._stopping), *self._maybe_close(c.fragment, now)]

    def _contribute_slice(self, c: Contribution, now: float) -> list[SyncAction]:
        """One rank's slice of a sharded learner's contribution, checked as far as it can be alone (the
        session, the fragment, its sequence number and base version), then held by the assembler
        (``core/sync_side/slice_assembly.py``) until its siblings are in; the whole goes through
        ``_contribute`` once, so a sharded learner is admitted, counted and weighed as one learner. The
        slice that completed it gets the verdict on the whole, the others were accepted."""
        if self._run.phase is RunPhase.FINISHED:
            raise Rejected(RejectReason.FINISHED, "the run is over")
        rec = self._registry.check(c.learner_id, c.session, None if c.progress is None else c.progress.boot)
        frag = self._fragment(c)
        if c.seq <= rec.last_seq.get(c.fragment, -1):
            raise Rejected(RejectReason.DUPLICATE, f"seq {c.seq} of fragment {c.fragment} was taken already")
        frag.check_version(c.base_version, self._staleness, now, c.learner_id)
        whole, ended = self._slices.add(c, frag.value.numel(), self._uplink)
        self._slices_lost(ended)
        if whole is None:
            self._registry.renew(rec, now)
            return [Accepted(c.learner_id, c, stop=self._stopping)]
        return [Accepted(c.learner_id, c, stop=self._stopping), *self._contribute(whole, now)[1:]]

    def _slices_lost(self, lost: list[Contribution]) -> None:
        """Sets of slices that will never be complete: their work counted as refused (``slice_incomplete``)."""
        for c in lost:
            err = Rejected(RejectReason.SLICE_INCOMPLETE, "a rank's slice never came")
            self._counters.refused(c, err)
            self._registry.refused(c, err)

    def _fragment(self, c: Contribution) -> GlobalFragment:
        frag = self._fragments.get(c.fragment)
        if frag is None:
            raise Rejected(RejectReason.UNKNOWN_FRAGMENT, f"fragment {c.fragment} is not one of this synchronizer's "
                                                          f"{list(self._fragments)} (shard {self.shard} of "
                                                          f"{self.config.shards})")
        return frag

    def _validate(self, c: Contribution, rec: LearnerRecord,
                  now: float) -> tuple[float, Pending, Contribution, tuple[ClipReason, ...]]:
        """Every check a contribution must pass but the norm bound (which learns from the norm it is
        shown, ``core/sync_side/norm_bound.py``), changing nothing: returns ‖Δ‖, what the round will hold,
        and ``c`` with its claimed times clipped and what was clipped (nothing else sees the claims)."""
        frag = self._fragment(c)
        frag.check(c, self._uplink, self._staleness, now)
        plausible, clipped = check_contribution(
            c, self._claims, since_s=rec.claims_origin_s(), now=now, tokens_per_step=rec.tokens_per_step,
            last_seq=rec.last_seq.get(c.fragment, -1), steps_before=rec.steps_accepted.get(c.fragment, 0),
            compute_before=rec.compute_accepted.get(c.fragment, 0.0), period=self.config.period)
        return frag.accumulator.measure(c.payload), frag.round.merged(plausible, now), plausible, clipped

    # ---- time, rounds, the end of the run --------------------------------------------------

    @property
    def _stopping(self) -> bool:
        return self._run.phase in (RunPhase.STOPPING, RunPhase.FINISHED)

    def _tick(self, now: float) -> list[SyncAction]:
        actions: list[SyncAction] = [LeaseExpired(name, now) for name in self._registry.expire(now)]
        expired = bool(actions)
        actions += [LinkStarved(name, for_s) for name, for_s in self._registry.newly_starved(now)]
        forgotten = self._registry.forget(now, also=self._run.progress.forget)
        self._slices.forget(set(forgotten))
        actions += [LearnersForgotten(forgotten)] if forgotten else []
        for index, frag in self._fragments.items():
            if frag.round.phase is RoundPhase.GRACE and frag.round.deadline_s <= now:
                move = frag.round.grace_ended(set(self.counted()), frag.version)
                if move is not RoundMove.WAIT:
                    reason = CloseReason.GRACE if move is RoundMove.QUORUM else CloseReason.ALL_LIVE
                    actions += self._close(index, now, reason)
            elif frag.round.phase is RoundPhase.COLLECTING and (expired or 0 < frag.ready_at_s <= now):
                actions += self._maybe_close(index, now)  # fewer live learners, or the spacing ended
        return actions

    def _after(self, now: float) -> list[SyncAction]:
        """What follows any event: the stop, the final drain, a checkpoint."""
        run = self._run
        actions: list[SyncAction] = []
        if run.budget_spent(now):
            run.phase = RunPhase.STOPPING
            run.stopped_at_s = now
            actions.append(StopLearners(tuple(self.alive())))
        if run.drain_due(now, len(self.counted())):
            for index, frag in self._fragments.items():
                if frag.round.pending:
                    actions += self._close(index, now, CloseReason.DRAIN)
            run.phase = RunPhase.FINISHED
            actions.append(Finished(now))
            if run.limits.checkpoints:
                actions.append(self._checkpoint(now))
        elif run.checkpoint_due(now):
            actions.append(self._checkpoint(now))
        return actions

    def _checkpoint(self, now: float) -> Checkpoint:
        self._run.rounds_since_checkpoint = 0
        self._run.last_checkpoint_s = now
        return Checkpoint(self.checkpoint_meta(now))

    def _maybe_close(self, index: int, now: float) -> list[SyncAction]:
        frag = self._fragments[index]
        rnd = frag.round
        if self.config.strict_quorum:
            # Synchronous DiLoCo: wait for K contributions, whoever is alive, then merge at once.
            return self._close(index, now, CloseReason.QUORUM) if len(rnd.contributors()) >= self.config.quorum else []
        if now < frag.ready_at_s and self.alive() and self._run.phase is RunPhase.RUNNING:
            return []  # too soon after the previous round: this one waits (``space_rounds``)
        frag.ready_at_s = 0.0
        alive = set(self.counted())
        move = rnd.move(alive, frag.version, self.effective_quorum())
        if move is RoundMove.CLOSE:
            return self._close(index, now, CloseReason.ALL_LIVE)
        if move is RoundMove.WAIT:
            return []
        if move is RoundMove.QUORUM:
            first = rnd.first_fresh_arrival_s(frag.version)
            self._grace.observe_quorum(now - (now if first is None else first))
        grace = self.grace_length_s()
        if grace <= 0.0:
            return self._close(index, now, CloseReason.NO_GRACE if move is RoundMove.QUORUM else CloseReason.ALL_LIVE)
        rnd.open_grace(now, grace, self.effective_quorum(), len(alive))
        return []

    def _close(self, index: int, now: float, reason: CloseReason) -> list[SyncAction]:
        frag = self._fragments[index]
        rnd = frag.round
        entries = [rnd.pending[key] for key in sorted(rnd.pending, key=lambda k: (k[0], k[1].number))]
        first_fresh = rnd.first_fresh_arrival_s(frag.version)
        round_age_s = 0.0 if first_fresh is None else now - first_fresh
        self._counters.weights_capped += frag.accumulator.cap_weights(self.config.max_weight_ratio)
        payload, coherence = frag.close(self._outer, self._downlink, plain=reason is CloseReason.DRAIN)
        frag.superseded.superseded(frag.version - 1, now, self._staleness.seconds)
        in_grace = rnd.phase is RoundPhase.GRACE
        record = RoundClosed(
            fragment=index,
            version=frag.version,
            merged=tuple(
                MergedContribution(p.contribution.learner_id, p.contribution.session.number, p.contribution.seq,
                                   p.contribution.tokens, p.contribution.steps, p.contribution.compute_s,
                                   p.contribution.first_step, p.contribution.base_version, p.arrived_s)
                for p in entries
            ),
            quorum_required=rnd.quorum_required if in_grace else self.effective_quorum(),
            reason=reason,
            grace_s=rnd.grace_s,
            opened_at_s=rnd.opened_at_s,
            closed_at_s=now,
            incarnation=self.incarnation,
            alive=rnd.alive_at_quorum if in_grace and reason is not CloseReason.ALL_LIVE else len(self.counted()),
            coherence=coherence,
        )
        self._positions.merged(index, record.merged)
        self._registry.merged(record.merged, index)
        self._slices_lost(self._slices.expire(index))
        rnd.clear()
        if self.config.space_rounds and not self.config.strict_quorum:
            overlap = self.config.overlap
            frag.ready_at_s = now + max(0, self.config.period - overlap) * self._registry.fastest_step_s()
        self._counters.merged(str(reason), now, running=self._run.phase is RunPhase.RUNNING)
        self._run.rounds_since_checkpoint += 1
        merged = tuple(MergedRef(m.learner_id, m.session, m.seq) for m in record.merged)
        update = frag.update_message(payload, self._downlink, self.incarnation, index, round_age_s, merged)
        return [record, LogRound(update, plain=reason is CloseReason.DRAIN, reached=reached_by(record.merged)),
                Broadcast(update, tuple(self.alive()))]
