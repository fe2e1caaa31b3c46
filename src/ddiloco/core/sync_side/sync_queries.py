"""What the synchronizer answers about itself without changing anything: the fragments it owns,
their versions, the quorum and grace window a round would get now, when it must be ticked next,
and status snapshots (the part of :class:`~ddiloco.core.sync_side.synchronizer.Synchronizer`
that other threads and the drivers read, kept apart from the protocol's decisions)."""

from __future__ import annotations

import torch

from ddiloco.core.shared import deadlines
from ddiloco.core.shared.grace import GraceWindow, effective_quorum
from ddiloco.core.shared.messages import Rejected, Session
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.data_position import DataPositions
from ddiloco.core.sync_side.refusals import honest_total
from ddiloco.core.sync_side.registry import Registry
from ddiloco.core.sync_side.rounds import GlobalFragment, RoundPhase
from ddiloco.core.sync_side.run_state import RunPhase, RunState
from ddiloco.core.sync_side.status_snapshot import CoreView, SyncCounters, SyncStatus


class SyncQueries:
    config: ProtocolConfig
    incarnation: int
    state_bytes: int
    _fragments: dict[int, GlobalFragment]
    _registry: Registry
    _positions: DataPositions
    _counters: SyncCounters
    _run: RunState
    _grace: GraceWindow
    _last_event_s: float

    @property
    def owned(self) -> tuple[int, ...]:
        """The (global) indices of the fragments this synchronizer shard owns, in order."""
        return tuple(self._fragments)

    @property
    def phase(self) -> RunPhase:
        return self._run.phase

    def versions(self) -> tuple[int, ...]:
        return tuple(f.version for f in self._fragments.values())

    def value(self, fragment: int) -> torch.Tensor:
        """The canonical global value of a fragment (do not modify)."""
        return self._fragments[fragment].value

    def alive(self) -> list[str]:
        return self._registry.alive()

    def counted(self) -> list[str]:
        """The live learners rounds wait for (``Registry.counted``)."""
        return self._registry.counted()

    def pending_tokens(self) -> int:
        return sum(f.round.tokens for f in self._fragments.values())

    def effective_quorum(self) -> int:
        """The number of fresh contributions a round needs right now (K, or fewer live learners)."""
        return effective_quorum(self.config.quorum, len(self.counted()), strict=self.config.strict_quorum)

    def grace_length_s(self) -> float:
        """The grace window a round reaching its quorum now would get."""
        return self._grace.length_s(self._registry.fastest_step_s())

    def admission_s(self) -> float:
        """How long a joining learner's lease waits for its global state before it runs
        (:func:`~ddiloco.core.shared.deadlines.admission_window_s` is how long the drivers let the transfer take)."""
        return deadlines.admission_s(self.state_bytes, self.config)

    def data_shard(self, learner_id: str) -> int:
        """The data shard ``learner_id`` has, or would get if it joined now (assigns nothing)."""
        return self._registry.data_shard(learner_id)

    def session_problem(self, learner_id: str, session: Session, boot: str | None = None) -> Rejected | None:
        """Why ``session`` is not the live session of ``learner_id`` (None: it is): asked before a stream may hold a slot."""
        return self._registry.problem(learner_id, session, boot)

    def next_deadline(self) -> float | None:
        """Earliest time at which a :class:`Tick` has something to do, or None."""
        frags = self._fragments.values()
        times = [f.round.deadline_s for f in frags if f.round.phase is RoundPhase.GRACE]
        times += [f.ready_at_s for f in frags if f.round.phase is RoundPhase.COLLECTING and f.ready_at_s]
        for t in (self._registry.next_expiry(), self._registry.next_starvation(), self._run.deadline()):
            if t is not None:
                times.append(t)
        return min(times) if times else None

    def view(self) -> CoreView:
        return CoreView(self._run.phase, self.versions(), self._registry.alive_count(), self._run.tokens)

    def status(self, now: float | None = None) -> SyncStatus:
        """A snapshot as of ``now`` (without it: of the latest event, and each learner's rate of its last message)."""
        run = self._run
        clock = self._last_event_s if now is None else now
        idle, oldest_idle_s = self._registry.idle(clock)
        return SyncStatus(
            incarnation=self.incarnation,
            phase=run.phase,
            fragments=self.owned,
            versions=self.versions(),
            round_phases=tuple(f.round.phase for f in self._fragments.values()),
            learners=self._registry.statuses(now, self._run.progress.tokens_of, self._positions.position),
            quorum=self.config.quorum,
            effective_quorum=self.effective_quorum(),
            grace_window_s=self.grace_length_s(),
            grace_quorum_s=self._grace.quorum_s.get(),
            grace_sync_s=self._grace.sync_s.get(),
            rounds_closed=dict(self._counters.rounds_closed),
            rejections=dict(self._counters.rejections),
            tokens=run.tokens,
            token_budget=run.limits.tokens,
            tokens_left=run.tokens_left(),
            time_budget_s=run.limits.time_s,
            elapsed_s=run.elapsed_s(clock),
            time_left_s=run.time_left_s(clock),
            pending_tokens=self.pending_tokens(),
            longest_pause_s=self._counters.longest_pause_s,
            started_at_s=run.started_at_s,
            learners_forgotten=self._registry.forgotten.learners,
            progress_clipped=run.progress.clipped,
            weights_capped=self._counters.weights_capped,
            claims_clipped=dict(self._counters.claims_clipped),
            norms_clipped=self._counters.norms_clipped,
            link_starved_episodes=self._registry.starved_episodes,
            refused_steps=dict(self._counters.refusals.steps),
            refused_tokens=dict(self._counters.refusals.tokens),
            honest_refused_steps=honest_total(self._counters.refusals.steps),
            honest_refused_tokens=honest_total(self._counters.refusals.tokens),
            idle_registrations=idle,
            oldest_idle_registration_s=oldest_idle_s,
        )
