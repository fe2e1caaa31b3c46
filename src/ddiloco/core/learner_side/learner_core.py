"""The learner's side of the protocol as an I/O-free state machine.

The training loop stays the user's: after each inner step the driver calls
:meth:`Learner.record_step`, which returns the contributions that fell due (to be
compressed and sent in the background), and it hands the machine everything that comes
back — the synchronizer's replies, the updates it broadcasts, the calls that could not be
delivered — between two steps. The machine answers with actions
(:mod:`ddiloco.core.shared.actions`): send this, register again, renew the lease, leave, give up.
Every reaction to the network lives here, once: what a refusal means, when a missed
version calls for the full state, which undelivered work is folded into the next
contribution and which is dropped because it was measured from a state the learner no
longer holds, how often to heartbeat, when to wait for the synchronizer.

Per fragment it keeps the anchor a_p (the last global value it adopted) with its version,
and the tokens, steps and compute seconds accumulated since the fragment was last sent.
With a sharded synchronizer (``protocol.shards``) it keeps a session per shard
(:mod:`ddiloco.core.learner_side.shard_link`): losing its state at one shard, it joins that shard again
and keeps exchanging the fragments of the others.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping

import torch

from ddiloco.core.learner_side.flat import FlatFragment
from ddiloco.core.learner_side.learner_phase import FATAL, REJOIN_ON, TRY_AGAIN, LearnerPhase, UpdateResult
from ddiloco.core.learner_side.learner_queries import LearnerQueries
from ddiloco.core.learner_side.link_watch import LinkWatch
from ddiloco.core.learner_side.send_schedule import SendSchedule
from ddiloco.core.learner_side.shard_link import ShardLink
from ddiloco.core.shared.actions import Fail, LearnerAction, Send, SendHeartbeat, SendJoin, SendLeave
from ddiloco.core.shared.deadlines import HOLD_LEASES
from ddiloco.core.shared.fragments import FragmentPlan
from ddiloco.core.shared.grace import MovingAverage
from ddiloco.core.shared.messages import (
    MAX_TOKENS_PER_STEP,
    Contribution,
    FragmentUpdate,
    GlobalState,
    Heartbeat,
    Join,
    Leave,
    RejectReason,
    Request,
)
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.shared.staleness import period_that_fits, staleness_limit


class Learner(LearnerQueries):
    """One learner's protocol state; binds the model's parameters, fragment by fragment, to one
    flat buffer each (``core/learner_side/flat.py``): the parameters become views into it, not copies."""

    def __init__(self, learner_id: str, config: ProtocolConfig, plan: FragmentPlan,
                 named_parameters: Mapping[str, torch.Tensor], *, boot: str = "boot", tokens_per_step: int = 0,
                 bind: bool = True, on_loopback: bool = False) -> None:
        """``bind``: lay out each fragment's parameters in one flat buffer (False: FSDP2 shards, FSDP owns them).
        ``on_loopback``: the synchronizer is on this host (a slow round trip is then CPU time, never the link's)."""
        config.validate()
        if not learner_id:
            raise ValueError("a learner needs a non-empty id")
        if not 0 <= tokens_per_step <= MAX_TOKENS_PER_STEP:
            raise ValueError(f"tokens_per_step must be in [0, {MAX_TOKENS_PER_STEP}], got {tokens_per_step}")
        self.learner_id = learner_id
        self.boot = boot
        self.tokens_per_step = tokens_per_step
        """What one inner step trains at most (all ranks), declared when joining; 0 = not declared."""
        self.config = config
        self.plan = plan
        self.phase = LearnerPhase.IDLE
        self.links = [ShardLink() for _ in range(config.shards)]
        self._uplink = config.uplink()
        self._downlink = config.downlink()
        self._flat = [FlatFragment(f.index, f.param_names, [named_parameters[n] for n in f.param_names],
                                   self._uplink, self._downlink, bind=bind) for f in plan.fragments]
        self.versions: list[int] = [-1] * len(plan.fragments)
        """-1 until the learner adopts the global state; it may not contribute before."""
        self._anchored_at = [0] * len(plan.fragments)
        """Per fragment, the step its anchor last moved (a rejoin keeps ≤ staleness_max periods since)."""
        self.schedule = SendSchedule(plan, HOLD_LEASES * config.lease_s, config.heartbeat_interval_s)
        self.step = 0
        self.step_time = MovingAverage()
        self._tokens_total = 0
        self.updates: Counter[UpdateResult] = Counter()
        self.dropped = 0
        """Contributions dropped because their session ended before they were delivered."""
        self.answers_lost = 0
        """Contributions whose call got no answer, merged all the same (the update said so)."""
        self.steps_unsent = 0
        """Steps of fragments not flushed at the end, their last contribution still awaiting its update
        (summed over those fragments: a step counts once per fragment it was not sent for)."""
        self.watch = LinkWatch(plan.period, len(plan.fragments), config.lease_s, config.heartbeat_interval_s,
                               on_loopback=on_loopback)
        """Whether its link carries its work (starved, behind)."""
        self.kept: tuple[int, ...] = ()
        """The fragments whose progress the latest admission kept (the synchronizer held our value)."""
        self.failure: Fail | None = None
        self.run_over = False
        """The synchronizer said the run is finished: nothing queued is worth sending any more."""

    # ---- sending ------------------------------------------------------------------------

    def still_to_send(self, send: Send) -> bool:
        """A queued contribution is about to go out: is it still of the current session? If not
        (the learner joined again meanwhile, or it failed) it is dropped, and counted: it was
        measured from a state the learner no longer holds, or cannot go. Nothing goes out once the
        run is over: on a slow link a queue of uploads would otherwise each be refused in turn."""
        if self.run_over and self.phase is not LearnerPhase.FAILED:
            return False
        if self.phase is not LearnerPhase.FAILED and self.is_current(send):
            return True
        self.dropped += 1
        return False

    # ---- joining -------------------------------------------------------------------------

    def start(self, now: float) -> list[LearnerAction]:
        if self.phase is not LearnerPhase.IDLE:
            raise RuntimeError(f"learner already started ({self.phase})")
        self.phase = LearnerPhase.JOINING
        return [action for shard in range(len(self.links)) for action in self._join(shard)]

    def _join(self, shard: int) -> list[LearnerAction]:
        self.links[shard].start_join()
        return [SendJoin(Join(self.learner_id, self.boot, self.tokens_per_step), shard)]

    def on_admitted(self, state: GlobalState, now: float, *, stop: bool = False, shard: int = 0) -> list[LearnerAction]:
        """A synchronizer shard registered us (a new session there): per fragment it sent, keep our
        progress where it holds the value we hold (a synchronizer that restarted from its round
        log) and the progress is short, mix it in like an update where it is newer, adopt it
        otherwise (``FlatFragment.take``)."""
        link = self.links[shard]
        if state.session is None or self.phase in (LearnerPhase.STOPPED, LearnerPhase.FAILED):
            return []
        if not link.joining and not link.newer(state.session):
            return []  # an answer to an older (duplicated or retried) join
        first = not self.joined
        self._adopt(state, shard, now)
        if self.config.blocking and self.joined:  # everyone waits on everyone: send in their phase
            self.schedule.in_phase_with(self.versions, self.step)
        link.admitted(state.session, now, state.data_position)
        if first and self.joined:  # this process's first state: its data resumes where it reached the model
            self.schedule.resume_at(min(lk.data_position for lk in self.links))
        if self.phase is LearnerPhase.JOINING and all(lk.session is not None for lk in self.links):
            self.phase = LearnerPhase.TRAINING
        return self.watch.answered(shard, now, self.step) + (self.on_stop(now) if stop else [])

    def _adopt(self, state: GlobalState, shard: int, now: float) -> None:
        owned = [f.index for f in self.plan.fragments if self.config.shard_of(f.index) == shard]
        if sorted(f.fragment for f in state.fragments) != owned:
            raise ValueError(f"shard {shard} sent fragments {[f.fragment for f in state.fragments]}, "
                             f"expected {owned}")
        self.kept = ()
        for frag in state.fragments:
            p = frag.fragment
            values = frag.values.to(torch.float32).flatten()
            if values.numel() != self.plan.fragments[p].numel:
                raise ValueError(f"fragment {p}: {values.numel()} values, expected {self.plan.fragments[p].numel}")
            short = self.step - self._anchored_at[p] <= self.config.staleness_max * self.plan.period
            kept = self._flat[p].take(values, self.versions[p], frag.version, keepable=short, alpha=self.config.alpha)
            if kept:
                self.kept += (p,)
                self.watch.kept(p)
            else:
                self._anchored_at[p] = self.step  # the anchor moved
            self.versions[p] = frag.version
            self.watch.arrived(self.step, now)
            self.schedule.restart(p, self.step, keep_counters=kept)

    # ---- training ------------------------------------------------------------------------

    def record_step(self, tokens: int, duration_s: float, now: float) -> list[Send]:
        """Account one finished inner step; return the contributions now due (in fragment order)."""
        if self.phase in (LearnerPhase.STOPPED, LearnerPhase.FAILED) or (self.phase is LearnerPhase.STOPPING
                                                                          and not self.joined):
            return []  # a step the loop finished after the run ended for this learner: nothing to send
        if not self.joined or self.phase is LearnerPhase.IDLE:
            raise RuntimeError(f"learner stepped while {self.phase} (joined: {self.joined})")
        if not 1 <= tokens <= (self.tokens_per_step or MAX_TOKENS_PER_STEP):
            raise ValueError(f"a step trains 1..{self.tokens_per_step or MAX_TOKENS_PER_STEP} tokens, got {tokens}"
                             + (" (the tokens per step this learner declared)" if self.tokens_per_step else ""))
        self.step += 1
        self._tokens_total += tokens
        self.step_time.add(duration_s)
        self.schedule.count(tokens, duration_s)
        # Nothing is sent to a shard being joined again: those steps start from anchors about to
        # be replaced.
        sends = [self._contribution(p, now) for p in self.schedule.due(self.step, now) if self._may_send(p)]
        if self.config.blocking or self.config.max_wait_s > 0:  # fragments sent τ steps ago (0: blocking)
            self.schedule.start_waits(self.step, now, after_steps=0 if self.config.blocking else self.config.overlap,
                                      limit_s=float("inf") if self.config.blocking else self.config.max_wait_s)
        return sends

    def _may_send(self, p: int) -> bool:
        link = self.links[self.config.shard_of(p)]
        return link.session is not None and not link.joining

    def _contribution(self, p: int, now: float) -> Send:
        shard = self.config.shard_of(p)
        session = self.links[shard].session
        assert session is not None
        delta = self._flat[p].take_delta()  # before any accounting: it checks the parameters are still bound
        counters, seq = self.schedule.take(p, self.step, now)
        self.watch.sent(p, counters.steps)
        header = Contribution(
            learner_id=self.learner_id,
            session=session,
            fragment=p,
            base_version=self.versions[p],
            seq=seq,
            tokens=counters.tokens,
            steps=counters.steps,
            compute_s=counters.compute_s,
            step_time_s=self.step_time.get(),
            codec=self._uplink.name,
            payload=b"",
            first_step=counters.first_step,
            progress=self.progress,
        )
        if isinstance(delta, torch.Tensor):
            return Send(header, delta, self._uplink, shard)
        return Send(header, None, self._uplink, shard, encoded=delta)

    def close(self, now: float) -> list[LearnerAction]:
        """End of training: send every fragment with unsent steps, due or not, then leave every shard.

        Not a fragment whose last contribution awaits its update (``SendSchedule.held``): measured
        from the same anchor, the flush would carry that contribution's progress a second time. Its
        last steps stay out of the model (``steps_unsent``); a far learner's flush at 8x the round
        trip of the others merged 62-69 steps' progress twice into the final model (+0.10 eval loss)."""
        if self.phase in (LearnerPhase.STOPPED, LearnerPhase.FAILED):
            return []
        flushed = [p for p, c in enumerate(self.schedule.counters) if c.steps > 0 and self._may_send(p)]
        held = [p for p in flushed if self.schedule.held(p, now)]
        self.steps_unsent = sum(self.schedule.counters[p].steps for p in held)
        actions: list[LearnerAction] = [self._contribution(p, now) for p in flushed if p not in held]
        for shard, link in enumerate(self.links):
            if link.session is not None and not link.joining:
                actions.append(SendLeave(Leave(self.learner_id, link.session, self.progress), shard))
            link.quiet()
        self.phase = LearnerPhase.STOPPED
        return actions

    # ---- what comes back -----------------------------------------------------------------

    def on_update(self, update: FragmentUpdate, now: float, *,
                  values: torch.Tensor | None = None) -> list[LearnerAction]:
        """Merge a new global value: anchor ← Θ, θ ← α·θ + (1−α)·Θ.

        ``values``: the update's payload already decoded by the driver (off the training
        thread, into memory an accelerator copies from without waiting); decoded here if None
        (in the same pass as the merge where ``decodes_updates``).
        """
        result = self._apply(update, values, now)
        self.updates[result] += 1
        shard = self.config.shard_of(update.fragment)
        if result is UpdateResult.GAP and self.phase is LearnerPhase.TRAINING and not self.links[shard].joining:
            return self._join(shard)  # missed a version: fetch that shard's state again
        return []

    def _apply(self, update: FragmentUpdate, values: torch.Tensor | None, now: float) -> UpdateResult:
        p = update.fragment
        if not 0 <= p < len(self._flat) or update.codec != self._downlink.name:
            raise ValueError(f"update for fragment {p} with codec {update.codec!r} does not fit this learner")
        session = self.session_of(p)
        if session is None or update.incarnation != session.incarnation:
            return UpdateResult.IGNORED
        if update.version <= self.versions[p]:
            return UpdateResult.IGNORED
        if update.version != self.versions[p] + 1:
            return UpdateResult.GAP
        self._flat[p].apply(update.payload, values, self.config.alpha)
        self.versions[p] = update.version
        self._anchored_at[p] = self.step
        mine = [m.seq for m in update.merged if m.learner_id == self.learner_id and m.session == session.number]
        self.answers_lost += self.schedule.updated(p, mine)
        step_s = self.step_time.get()
        if self.config.align_sends and step_s > 0:
            self.schedule.align(p, self.step, int(update.round_age_s / step_s))  # steps since the round began
        self.schedule.landed(p)
        return UpdateResult.APPLIED

    def on_accepted(self, request: Request, now: float, *, stop: bool = False, shard: int = 0) -> list[LearnerAction]:
        if isinstance(request, Contribution):
            self.watch.arrived(self.step, now)
            self.schedule.answered(request.fragment, request.seq)
        return self.watch.answered(shard, now, self.step) + (self.on_stop(now) if stop else [])

    def on_refused(self, request: Request, reason: RejectReason, now: float, *, shard: int = 0) -> list[LearnerAction]:
        """React to a refusal, by reason (the table is ``REJOIN_ON`` / ``FATAL``)."""
        return self.watch.answered(shard, now, self.step) + self._refused(request, RejectReason(reason), now, shard)

    def _refused(self, request: Request, reason: RejectReason, now: float, shard: int) -> list[LearnerAction]:
        if reason in FATAL:
            self.phase = LearnerPhase.FAILED
            why = (f"another process registered as learner {self.learner_id!r} after this one, which stops "
                   "(is an older copy of it still running?)" if reason is RejectReason.REPLACED else
                   f"the synchronizer refused {type(request).__name__}: {reason}")
            self.failure = Fail(reason, why)
            for link in self.links:
                link.quiet()
            return [self.failure]
        if reason is RejectReason.FINISHED:
            self.phase = LearnerPhase.STOPPED
            self.run_over = True
            for link in self.links:
                link.quiet()
            return []
        if isinstance(request, Join):
            if self.links[shard].joining:
                self.links[shard].retry_later(now)
            return []
        if not self.is_current(request):
            return []  # about a session we already left
        if isinstance(request, Contribution):
            self.schedule.answered(request.fragment, request.seq)
            if reason is RejectReason.REPEATED:
                if (self.schedule.repeated(request.fragment, self.step, now) or self.links[shard].joining
                        or self.phase is not LearnerPhase.TRAINING):
                    return []
                return self._join(shard)  # its update was lost: the state brings it
            self.schedule.landed(request.fragment)
            if reason in TRY_AGAIN:
                self.schedule.fold(request)
                return []
        if self._stale_on_its_link(request, reason):
            held = self.versions[request.fragment]
            limit = staleness_limit(self.config.staleness_max, self.config.staleness_reach)
            return self.watch.refused_stale(request.fragment, request.base_version, held,
                                            period_that_fits(self.plan.period, held - request.base_version, limit))
        target = self._shard_of(request)
        if ((reason in REJOIN_ON or self._impossible_duplicate(request, reason)) and target is not None
                and self.phase is LearnerPhase.TRAINING and not self.links[target].joining):
            return self._join(target)
        return []  # an old duplicate, or a contribution the synchronizer found unusable: dropped

    def _stale_on_its_link(self, request: Request, reason: RejectReason) -> bool:
        """Refused as stale although updates of its fragment reached us since it was sent: the
        learner follows the global model as closely as its link allows, and its round trip spans
        more rounds than the staleness bound. A new registration would not help (the state comes
        over the same link, as late) and would turn every contribution into a full state download
        — a rejoin loop. Only a learner whose updates stopped coming registers again."""
        return (reason is RejectReason.STALE and isinstance(request, Contribution)
                and self.versions[request.fragment] > request.base_version)

    def _impossible_duplicate(self, request: Request, reason: RejectReason) -> bool:
        """The synchronizer holds our newest sequence number for a fragment, or a later one: a
        contribution we never had accepted, sent by someone speaking for us. A new session
        (sequence numbers from 0, a number they do not know) shuts them out."""
        return (reason is RejectReason.DUPLICATE and isinstance(request, Contribution)
                and request.seq == self.schedule.seq[request.fragment] - 1)

    def on_undelivered(self, request: Request, now: float, *, shard: int = 0) -> list[LearnerAction]:
        """A call got no answer (synchronizer down, network): retry, fold or drop (heartbeats and
        leaves: the next heartbeat or the lease takes care of it); an outage is said once."""
        folded = None
        if isinstance(request, Join) and self.links[shard].joining:
            self.links[shard].retry_later(now)
        elif isinstance(request, Contribution) and self.is_current(request) and self.phase is not LearnerPhase.STOPPED:
            self.schedule.fold(request)
            folded = request.fragment
        elif isinstance(request, Contribution):
            self.dropped += 1  # measured from a state we no longer hold
        return self.watch.unanswered(shard, now, joined=self.joined, folded=folded)

    def on_stop(self, now: float) -> list[LearnerAction]:
        """The synchronizer says the budget is spent: the driver closes at the next step boundary."""
        if self.phase in (LearnerPhase.TRAINING, LearnerPhase.JOINING, LearnerPhase.IDLE):
            self.phase = LearnerPhase.STOPPING
        return []

    def tick(self, now: float) -> list[LearnerAction]:
        """Time passed: heartbeat when due, retry a join when due, end waits that ran out.

        Afterwards ``next_deadline()`` is later than ``now`` (or None).
        """
        self.schedule.expire_waits(now)
        actions = self.watch.outages(now) if self.phase in (LearnerPhase.TRAINING, LearnerPhase.JOINING) else []
        actions += self.watch.check(self.step, now, training=self.phase is LearnerPhase.TRAINING,
                                    rejoining=self.rejoining())
        interval = self.config.heartbeat_interval_s
        for shard, link in enumerate(self.links):
            if link.joining and link.join_retry_s is not None and now >= link.join_retry_s:
                actions += self._join(shard)
            if link.heartbeat_due(now, interval) and link.session is not None and not link.joining:
                if self.phase in (LearnerPhase.TRAINING, LearnerPhase.STOPPING):
                    actions.append(SendHeartbeat(Heartbeat(self.learner_id, link.session, self.progress), shard))
        return actions
