"""The synchronizer process of the virtual cluster: carries out the core's actions, keeps its
checkpoints and round log, and crashes and restarts from them when the adversary says so.

A crash loses what a real crash loses: the pending rounds and the registry's leases. No
merged round is lost: as in the real service, every merged round is in the log before its
update leaves (the virtual disk is durable at once), and a restart replays the log after the
latest checkpoint. The restarted process is a new *incarnation* (a number no earlier one
used); learners find out from its refusals and join again, keeping their progress.

Uploads are admitted as the real service admits them (``core/sync_side/upload_admission.py``),
with the same questions to the core in the same order: a stalled upload's header
(:class:`~ddiloco.sim.events.UploadHeader`) holds its place until its deadline, then ends
``timed_out``, and an upload that finds no place is refused ``busy``. An upload that arrives whole
holds its place for no virtual time, so only stalls make these refusals; both are counted as the
real service's wire counts them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from ddiloco.core.shared.actions import (
    Accepted,
    Admitted,
    Broadcast,
    Checkpoint,
    Finished,
    LogRound,
    Refused,
    RoundClosed,
    StateDelivered,
    StopLearners,
    SyncAction,
    SyncTimeObserved,
    Tick,
)
from ddiloco.core.shared.deadlines import state_bytes_of, upload_pace_s
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Join, RejectReason, Request, StopNotice
from ddiloco.core.sync_side.replay import ReplayLog, replay_budget
from ddiloco.core.sync_side.synchronizer import Synchronizer
from ddiloco.core.sync_side.upload_admission import Ended, InFlight, UploadAdmission
from ddiloco.sim.events import ReplyArrives, StateArrives, SyncTick, UploadCut
from ddiloco.sim.host import NodeHost
from ddiloco.sim.invariants import InvariantViolation
from ddiloco.sim.network import HEADER_BYTES

Caller = tuple[int, int, int]
"""Who waits for an answer: learner index, its process's boot, the call's id."""


class SyncNode:
    def __init__(self, build: Callable[[int], Synchronizer], seed: int, shard: int = 0, *, max_learners: int) -> None:
        self._build = build
        self.shard = shard
        self._max_learners = max_learners
        # Incarnations are random ids, as in the real service: nothing may rely on their order.
        self._ids = np.random.default_rng(np.random.SeedSequence([seed, 0x1CA7, shard]))
        self.incarnation = self._new_incarnation()
        self.core = build(self.incarnation)
        self.replay: ReplayLog[FragmentUpdate]
        self.uploads: UploadAdmission
        self._stalled: dict[InFlight, tuple[Caller, Contribution]]
        """Stalled uploads holding a place, and whom each one's end answers."""
        self._fresh_process()
        self.up = True
        self.checkpoint: dict[str, Any] | None = None
        self.log: list[LogRound] = []
        """Merged rounds the checkpoint does not hold yet (the real service's round log)."""
        self.tick_at: float | None = None
        self.crashes = 0
        self.finished = False
        self.wire_rejections: Counter[str] = Counter()
        """Refusals of the admission (the real service's wire counts), across incarnations."""

    def _fresh_process(self) -> None:
        """What a process holds in memory only: its replay buffer, its uploads and their streams."""
        self.replay = ReplayLog(max(self.core.owned, default=-1) + 1, replay_budget(self.core.state_bytes))
        self.uploads, self._stalled = UploadAdmission(self._max_learners), {}

    def _new_incarnation(self) -> int:
        return int(self._ids.integers(1, 2**48))

    def start(self, host: NodeHost) -> None:
        if host.checker:
            host.checker.on_start(self.incarnation, self.core.owned, [self.core.value(p) for p in self.core.owned],
                                     self.core.versions(), None)

    # ---- events ------------------------------------------------------------------------

    def on_request(self, host: NodeHost, m: int, boot: int, call_id: int, request: Request) -> None:
        if not self.up:
            return  # nobody listening: the caller's deadline will tell it
        if isinstance(request, Contribution) and not self._admitted(host, (m, boot, call_id), request):
            return
        self.execute(host, self.core.handle(request, host.queue.now), reply_to=(m, boot, call_id))

    # ---- uploads: admitted, stalled, cut ------------------------------------------------

    def on_upload_header(self, host: NodeHost, m: int, boot: int, call_id: int, request: Contribution) -> None:
        """A stalled upload's header: admitted, it holds its place until its deadline cuts it."""
        caller = (m, boot, call_id)
        if not self.up or not self._admitted(host, caller, request, header_only=True):
            return
        upload = InFlight(request.learner_id, request.session, request.fragment)
        self.uploads.admit(upload)
        self._stalled[upload] = (caller, request)
        deadline_s = upload_pace_s(HEADER_BYTES, len(request.payload), self.core.config)
        host.queue.at(host.queue.now + deadline_s, UploadCut(self.shard, self.incarnation, upload))

    def on_upload_cut(self, host: NodeHost, incarnation: int, upload: InFlight) -> None:
        if incarnation != self.incarnation or not self.up or upload not in self._stalled:
            return
        self.uploads.end(upload)
        self._end(host, [Ended(upload, RejectReason.TIMED_OUT, "the upload's body stalled past its deadline")])

    def _admitted(self, host: NodeHost, caller: Caller, c: Contribution, *, header_only: bool = False) -> bool:
        """May an upload take a place, asked as the real service asks (its session of the core first,
        then the admission)? False: refused, and its caller answered."""
        if (problem := self.core.session_problem(c.learner_id, c.session)) is not None:
            if not header_only:
                return True  # a whole upload: the core refuses it itself, and counts it, with its body
            self._reply(host, caller, c, problem.reason, problem.detail)  # a header: refused on the wire
            return False
        verdict = self.uploads.consider(c.learner_id, c.session, c.fragment)
        self._end(host, verdict.ended)
        if verdict.check:
            live = [self.core.session_problem(u.learner, u.session) is None for u in verdict.check]
            verdict = self.uploads.with_live(c.learner_id, c.fragment, verdict.check, live)
            self._end(host, verdict.ended)
        if verdict.refused is not None:
            self._reply(host, caller, c, *verdict.refused)
            return False
        return True

    def _end(self, host: NodeHost, ended: list[Ended]) -> None:
        """Stalled uploads ended to make way or cut: each one's caller is answered with why."""
        for e in ended:
            caller, c = self._stalled.pop(e.upload)
            self._reply(host, caller, c, e.reason, e.detail)

    def _reply(self, host: NodeHost, caller: Caller, c: Contribution, reason: RejectReason, detail: str) -> None:
        self.wire_rejections[str(reason)] += 1
        m, boot, call_id = caller
        host.push(ReplyArrives(m, boot, call_id, Refused(c.learner_id, c, reason, detail), self.shard), -1, 0)

    def on_stranger_join(self, host: NodeHost, join: Join, delivered: bool) -> None:
        """A join of the adversary's flood: its reply goes nowhere, and its caller goes away once the
        state arrived (``delivered``: its lease runs, and it is never heard from) or before."""
        if not self.up:
            return
        now = host.queue.now
        actions = self.core.handle(join, now)
        if isinstance(actions[0], Admitted):
            session = actions[0].state.session
            assert session is not None
            actions += self.core.handle(StateDelivered(join.learner_id, session, delivered), now)
        self.execute(host, actions[1:])

    def on_delivered(self, host: NodeHost, incarnation: int, m: int, boot: int, admitted: Admitted,
                     arrived: bool) -> None:
        """The state of ``admitted`` reached learner ``m`` (a live process of the same boot) or it did not."""
        if incarnation != self.incarnation or not self.up:
            return
        ok = arrived and host.process_up(m, boot)
        assert admitted.state.session is not None
        self.execute(host, self.core.handle(StateDelivered(admitted.learner_id, admitted.state.session, ok),
                                               host.queue.now))

    def replay_to(self, host: NodeHost, name: str, held: list[int]) -> None:
        """A learner's stream is back (its partition ended): send what it missed (``core/sync_side/replay.py``)."""
        if self.up:
            for p, update in self.replay.since(held):
                host.push_to(name, p, len(update.payload), update)

    def on_tick(self, host: NodeHost, incarnation: int) -> None:
        if incarnation != self.incarnation or not self.up:
            return
        self.tick_at = None
        now = host.queue.now
        actions = self.core.handle(Tick(), now)
        deadline = self.core.next_deadline()
        if deadline is not None and deadline <= now:
            raise InvariantViolation(f"the synchronizer asks to be woken at {deadline!r} after its tick at {now!r}: "
                                     "time would stand still")
        self.execute(host, actions)

    def execute(self, host: NodeHost, actions: list[SyncAction],
                reply_to: tuple[int, int, int] | None = None) -> None:
        now = host.queue.now
        for action in actions:
            if isinstance(action, (Admitted, Accepted, Refused)):
                assert reply_to is not None
                if isinstance(action, Admitted):  # the whole state leaves at once over the virtual network
                    action = replace(action, state=self.core.state_for(action.state))
                m, boot, call_id = reply_to
                size = (state_bytes_of(f.values.numel() for f in action.state.fragments)
                        if isinstance(action, Admitted) else 0)
                arrival = host.push(ReplyArrives(m, boot, call_id, action, self.shard), -1, size)
                if isinstance(action, Admitted):
                    # The transfer ends when the state arrives, or fails when the caller gives up
                    # (its join's deadline counts the state: the learner node's). Past the core's
                    # admission window the session has expired and the report changes nothing.
                    at = arrival if arrival is not None else now + host.call_deadline_s(size)
                    host.queue.at(at, StateArrives(self.shard, self.incarnation, m, boot, action, arrival is not None))
                if isinstance(action, Accepted) and isinstance(action.request, Contribution) and host.checker:
                    host.checker.on_accepted(action.request, self.incarnation)
            elif isinstance(action, Broadcast):
                update = action.update
                self.replay.record(update.fragment, update.version, update, len(update.payload))
                left = [host.left_at(name) for name in action.recipients
                        if host.push_to(name, update.fragment, len(update.payload), update) is not None]
                if left:  # ξ_sync (core/shared/grace.py): until the update has left for its last recipient
                    self.core.handle(SyncTimeObserved(max(left) - now), now)
            elif isinstance(action, StopLearners):
                for name in action.recipients:
                    host.push_to(name, -1, 0, StopNotice())
            elif isinstance(action, RoundClosed):
                host.on_round(action, self.core.value(action.fragment))
            elif isinstance(action, LogRound):
                self.log.append(action)
            elif isinstance(action, Checkpoint):
                self.checkpoint = {**action.state, "fragments": [self.core.fragment_state(p) for p in self.core.owned]}
                self.log.clear()  # everything merged so far is in the checkpoint
            elif isinstance(action, Finished):
                self.finished = True
        self.schedule_tick(host)

    def schedule_tick(self, host: NodeHost) -> None:
        deadline = self.core.next_deadline()
        if deadline is not None and (self.tick_at is None or deadline < self.tick_at):
            self.tick_at = deadline
            host.queue.at(deadline, SyncTick(self.shard, self.incarnation))

    # ---- crash and restart -------------------------------------------------------------

    def crash(self, host: NodeHost) -> None:
        if not self.up or self.finished:
            return
        self.up = False
        self.crashes += 1
        if host.checker:
            host.checker.on_crash(self.incarnation, self.core.pending_tokens())

    def _checkpoint_versions(self) -> list[int]:
        if self.checkpoint is None:
            return [0] * len(self.core.owned)
        return [f["version"] for f in self.checkpoint["fragments"]]

    def restart(self, host: NodeHost) -> None:
        if self.up:
            return
        self.incarnation = self._new_incarnation()
        self.core = self._build(self.incarnation)
        self._fresh_process()
        if self.checkpoint is not None:
            self.core.load_state_dict(self.checkpoint)
        for record in self.log:
            self.core.replay_round(record.update, plain=record.plain, reached=record.reached)
        self.up = True
        self.tick_at = None
        if host.checker:
            restored = [max((r.update.version for r in self.log if r.update.fragment == p), default=version)
                        for p, version in zip(self.core.owned, self._checkpoint_versions())]
            host.checker.on_start(self.incarnation, self.core.owned, [self.core.value(p) for p in self.core.owned],
                                     self.core.versions(), restored)
        self.schedule_tick(host)

