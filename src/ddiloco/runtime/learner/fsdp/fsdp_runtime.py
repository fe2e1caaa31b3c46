"""A learner bigger than one device: an FSDP2 job whose every rank streams its own slice.

``LearnerRuntime(model, ...)`` comes here when the model's parameters are FSDP2 shards
(``torch.distributed.fsdp.fully_shard``). Each rank runs its own learner core
(:class:`~ddiloco.core.learner_side.learner_core.Learner`) over its local shards only: its anchors, Δ and merges
are its slice of each fragment (``core/shared/slices.py``), so no rank holds more than its shard plus its
slice's anchor. Each rank uploads its slices itself (``rank_link.RankLink``); the synchronizer
admits a contribution once all its slices are in (``core/sync_side/slice_assembly.py``). Each rank also
receives only its own slices: of the state (rank 0 in its join, the others by a fetch under rank 0's
session) and of every update (its own stream, cut by the synchronizer; ``core/shared/slice_cut.py``).
Rank 0 speaks for the learner otherwise: it registers, heartbeats and leaves.

The W cores must make the same decisions at the same step, or their slices would stop matching.
So nothing reaches a core between two steps: after every step the ranks exchange, over the job's
CPU group, a few numbers — what each one's calls came to, how far each one's held updates reach
(``held_updates.py``), rank 0's join header, the stop — and every rank applies the same things in
one order to its core: the updates every rank holds, each rank its own slice of them. A join's
slices are fetched at moments apart, so their versions may differ: every rank moves its slice to
the newest of them with the updates its stream brings, then all adopt the same versions. A
contribution counts as accepted once every rank's slice was; refused if any was (the synchronizer's
verdict on the whole comes to the rank whose slice completed it); undelivered if any went undelivered
(its steps go into the next one, whose slices end the incomplete set at the synchronizer).

Every core is told one time, rank 0's clock at the last exchange: the cores decide by time (how long
a send waits for its update, heartbeats, join retries, synchronous DiLoCo's waits), and clocks read
apart would let them part at a boundary. So a wait (``protocol.blocking``, ``protocol.max_wait_s``)
ends at the same exchange on every rank. Not supported yet (refused in one line): a sharded synchronizer.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.core.learner_side.learner_phase import LoopMove, UpdateResult
from ddiloco.core.shared.actions import Fail, LearnerAction, SendJoin, SendLeave
from ddiloco.core.shared.deadlines import call_deadline_s, client_join_link, join_state_bytes
from ddiloco.core.shared.errors import ConfigError, DdilocoError, ParameterError
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, FragmentValue, GlobalState, Join
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.shared.slices import SliceSpec
from ddiloco.runtime.client import JoinResult, SyncClient
from ddiloco.runtime.layout import plan_from_layout
from ddiloco.runtime.learner.connect import connect_all, on_loopback, probe_with_backoff
from ddiloco.runtime.learner.fsdp.held_updates import HeldUpdates, catch_up
from ddiloco.runtime.learner.fsdp.rank_link import Answer, Outcome, RankLink
from ddiloco.runtime.learner.fsdp.rank_params import rank_params
from ddiloco.runtime.learner.ranks import cpu_group
from ddiloco.runtime.learner.stats import RuntimeStats

log = logging.getLogger("ddiloco.learner")

WAIT_POLL_S = 0.005
"""While the cores wait (synchronous DiLoCo's update, ``protocol.max_wait_s``), how often the ranks
exchange again: each exchange is one collective of a few numbers."""


class FsdpLearnerRuntime:
    """One learner of a run, spread over the ranks of an FSDP2 job (the API of ``LearnerRuntime``)."""

    def __init__(self, model: nn.Module, connect: str | SyncClient | Sequence[str | SyncClient] | None,
                 learner_id: str, *, token: str | None = None, secret: str | None = None, tls_ca: str | None = None,
                 join_timeout_s: float | None = None, tokens_per_step: int = 0,
                 on_data_position: Callable[[int], None] | None = None) -> None:
        if not learner_id:
            raise ConfigError("a learner needs a non-empty id")
        if token is not None and secret is not None:
            raise ConfigError("give a learner the run's shared token or its own secret, not both")
        if connect is None:
            raise ConfigError("every rank of a sharded learner needs the synchronizer's address")
        self.model = model
        self.learner_id = learner_id
        self._group = cpu_group()
        params, sharded = rank_params(model, self._group)
        self.rank, self.world = params.rank, params.world
        self.is_leader = self.rank == 0
        box = [uuid.uuid4().hex[:12], time.monotonic()]
        dist.broadcast_object_list(box, src=0, group=self._group)
        self.boot = box[0]  # one learner, one boot: rank 0's
        self._now: float = box[1]
        """The time every core is told: rank 0's clock at the last exchange. The cores decide by time
        (how long a send waits for its update, when to heartbeat or join again), and W clocks read
        at W moments, or on W hosts, would let them decide apart at a boundary: one rank's slice
        sent, its sibling's held."""
        clients = connect_all(connect, token=secret or token, tls_ca=tls_ca,
                              learner_id=learner_id if secret is not None else None)
        if len(clients) != 1:
            raise ConfigError(f"a sharded learner connects to one synchronizer, got {len(clients)} addresses (a "
                              "sharded synchronizer is not supported with FSDP2 learners yet)")
        probe = probe_with_backoff(clients[0], learner_id, timeout_s=join_timeout_s)
        self.plan = plan_from_layout(probe.header, dict(model.named_parameters()))
        params.check_fragments(self.plan, sharded)
        protocol = ProtocolConfig(**probe.protocol)
        if protocol.shards != 1:
            raise ConfigError("a sharded learner does not support protocol.shards > 1 yet")
        self._specs = params.slices(self.plan)
        self._numel = [f.numel for f in self.plan.fragments]
        self._downlink = protocol.downlink()
        self._join_timeout_s = call_deadline_s(join_state_bytes(self.plan, protocol, 0), client_join_link(protocol))
        self.core = Learner(learner_id, protocol, params.local_plan(self.plan), params.local, boot=self.boot,
                            tokens_per_step=tokens_per_step * self.world, bind=False, on_loopback=on_loopback(clients))
        self._shards = [(n, p, params.local[n].data_ptr()) for n, p in model.named_parameters() if n in sharded]
        clients[0].close()  # the rank's link helper makes its own: no gRPC channel stays in the training process
        self.link = RankLink(clients[0].spec, self.core, self._specs, self._numel, rank=self.rank, world=self.world)
        self._held = HeldUpdates(len(self._specs))
        self._pending: dict[tuple[int, int, Any], dict[int, Outcome]] = {}
        self._wants_join = False
        self._failure: str | None = None
        self._steps = 0
        self._joins = 0
        self._overhead_s = 0.0
        self._closed = False
        self._take(self.core.start(self._now))
        deadline = None if not join_timeout_s else self._now + join_timeout_s
        while not self.core.joined:  # decided by the exchange: every rank leaves this loop at the same round
            self._exchange()
            if not self.core.joined:
                if deadline is not None and self._now > deadline:
                    raise DdilocoError(f"{learner_id!r} could not join the synchronizer in {join_timeout_s:g}s")
                time.sleep(0.05)
        self._data_position = self.core.next_batch
        if on_data_position is not None:
            on_data_position(self._data_position)
        self._last_step_end = time.perf_counter()

    # ---- the training thread's API ---------------------------------------------------------

    @property
    def should_stop(self) -> bool:
        return self.core.should_stop

    @property
    def data_position(self) -> int:
        return self._data_position

    @property
    def versions(self) -> list[int]:
        return list(self.core.versions)

    @property
    def stats(self) -> RuntimeStats:
        """What this rank did so far (its own uploads; the updates every rank applied)."""
        updates = self.core.updates
        return RuntimeStats(steps=self._steps, contributions_sent=self.link.sent, contributions_dropped=self.core.dropped,
                            answers_lost=self.core.answers_lost,
                            steps_unsent=self.core.steps_unsent,
                            rejected=dict(self.link.rejected), updates_applied=updates.get(UpdateResult.APPLIED, 0),
                            updates_ignored=updates.get(UpdateResult.IGNORED, 0), gaps=updates.get(UpdateResult.GAP, 0),
                            joins=self._joins, unreachable=self.link.unreachable, bytes_up=self.link.bytes_up,
                            step_overhead_s=self._overhead_s)

    @property
    def backlog(self) -> int:
        """Uploads of this rank waiting for its sender thread."""
        return self.link.backlog

    @property
    def slices(self) -> list[SliceSpec]:
        """This rank's slice of each fragment."""
        return list(self._specs)

    @property
    def bytes_up(self) -> int:
        """Payload bytes this rank uploaded (its slices)."""
        return self.link.bytes_up

    @property
    def bytes_down(self) -> int:
        """Payload bytes this rank received (its slices of states and updates)."""
        return self.link.bytes_down

    @property
    def contributions_sent(self) -> int:
        """Slices this rank uploaded (and had answered)."""
        return self.link.sent

    def step(self, tokens: int, duration_s: float | None = None) -> None:
        """Account one finished inner step of ``tokens`` tokens (this rank's batch), then exchange with the
        other ranks what came back (every rank calls it after the same step: it is collective)."""
        entered = time.perf_counter()
        if duration_s is None:
            duration_s = entered - self._last_step_end
        self._check_shards()
        self._steps += 1
        self._take(self.core.record_step(tokens * self.world, duration_s, self._now))
        self._exchange()
        while self.core.between_steps(self._now) is LoopMove.WAIT:  # the same answer on every rank: one core, one clock
            time.sleep(WAIT_POLL_S)
            self._exchange()
        self._last_step_end = time.perf_counter()
        self._overhead_s += self._last_step_end - entered

    def close(self, *, flush: bool = True) -> None:
        """Send what is left (``flush``: every rank its slices), then rank 0 leaves (collective)."""
        if self._closed:
            return
        self._closed = True
        actions = self.core.close(self._now) if flush and self._failure is None else []
        self.link.dispatch([a for a in actions if not isinstance(a, SendLeave)])
        self.link.drain()
        dist.barrier(group=self._group)  # every slice answered before the learner leaves
        self.link.dispatch([a for a in actions if isinstance(a, SendLeave)])
        self.link.drain()
        self.link.close()

    def __enter__(self) -> "FsdpLearnerRuntime":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(flush=exc_type is None)

    # ---- between two steps -----------------------------------------------------------------

    def _check_shards(self) -> None:
        for name, p, ptr in self._shards:
            if p.to_local().data_ptr() != ptr:
                raise ParameterError(f"parameter {name!r}'s shard moved to other memory after the learner started "
                                     "(model.to() or a new fully_shard?)")

    def _take(self, actions: list[LearnerAction]) -> None:
        """Carry out a core's actions: uploads to the link; a join and a failure wait for the next exchange."""
        for action in actions:
            if isinstance(action, SendJoin):
                self._wants_join = self._wants_join or self.is_leader
            elif isinstance(action, Fail):
                self._failure = self._failure or action.detail
        self.link.dispatch(actions)

    def _exchange(self) -> None:
        """Every rank hands every core the same news, in the same order (see the module's docstring)."""
        admission: JoinResult | Outcome | None = None
        if self.is_leader and self._wants_join:
            self._wants_join = False
            admission = self.link.join(self._join_request(), self._join_timeout_s)
        outcomes, updates, stop = self.link.take()
        self._held.add(updates)
        self._failure = self._failure or self.link.broken
        joined = admission if isinstance(admission, JoinResult) else None
        header = None if joined is None else (joined.state.session, joined.state.incarnation,
                                              joined.state.data_position, bool(joined.header.stop))
        news = (outcomes, self._failure, stop, admission if isinstance(admission, Outcome) else None, header,
                self._reach(), time.monotonic() if self.is_leader else None)
        everyone = self._gather(news)
        _, _, _, join_outcome, header, _, now = everyone[0]
        self._now = now
        if header is not None:
            self._join_all(None if joined is None else joined.state, header, now)
        elif join_outcome is not None:
            self._settle_one(join_outcome, now)
        self._settle([e[0] for e in everyone], now)
        if header is None:
            self._apply_updates([e[5] for e in everyone], now)
        if any(e[2] for e in everyone):
            self._take(self.core.on_stop(now))
        failures = [(r, e[1]) for r, e in enumerate(everyone) if e[1]]
        if failures:
            raise DdilocoError(f"rank {failures[0][0]}: {failures[0][1]}")
        self._take(self.core.tick(now))

    def _gather(self, news: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, news, group=self._group)
        return everyone

    def _join_request(self) -> Join:
        return Join(self.learner_id, self.boot, self.core.tokens_per_step)

    def _reach(self) -> list[tuple[int, bool]] | None:
        """How far this rank's held updates reach, per fragment (None before the first session)."""
        session = self.core.session_of(0) if self.core.joined else None
        return None if session is None else self._held.reach(self.core.versions, session.incarnation)

    def _apply_updates(self, reaches: list[list[tuple[int, bool]] | None], now: float) -> None:
        """Apply, per fragment, the updates every rank holds; a gap any rank has is every rank's."""
        if any(r is None for r in reaches):
            return
        session = self.core.session_of(0)
        for p in range(len(self._specs)):
            agreed = min(r[p][0] for r in reaches)  # type: ignore[index]
            for r in self._held.take(p, self.core.versions[p], agreed):
                self._take(self.core.on_update(r.update, now, values=r.values))
                r.done()
            if any(r[p][1] for r in reaches) and session is not None:  # type: ignore[index]
                missed = FragmentUpdate(p, self.core.versions[p] + 2, self._downlink.name, b"", session.incarnation)
                self._take(self.core.on_update(missed, now))  # the core decides the rejoin, as for a gap of its own

    def _join_all(self, mine: GlobalState | None, header: tuple, now: float) -> None:
        """Rank 0 joined (``mine``: its slices; ``header``: what it learned): every other rank fetches its
        own slices under that session, every rank follows its stream from what it fetched, and when the
        streams have brought every rank to the newest version any fetched, all adopt those versions.
        A fetch refused or undelivered, a gap, or the join's deadline passing: the join went undelivered
        for every core, which tries again."""
        session, incarnation, data_position, stop = header
        if not self.is_leader:
            mine = self.link.fetch(session, self._join_timeout_s)
        if mine is not None:
            self._held.clear()
            self.link.follow(session, mine.versions())
        fetched = None if mine is None else list(mine.versions())
        everyone = self._gather(fetched)
        deadline = time.monotonic() + self._join_timeout_s
        while all(f is not None for f in everyone):
            target = [max(f[p] for f in everyone) for p in range(len(self._specs))]
            self._held.add(self.link.take_updates())
            self._held.own()
            reach = self._held.reach(fetched, incarnation) if fetched is not None else []
            ready = all(r >= t for (r, _), t in zip(reach, target))
            gap = any(g for _, g in reach)
            verdict = self._gather((ready, gap, time.monotonic() > deadline))
            if all(v[0] for v in verdict):
                self._adopt(mine, target, header, now)
                return
            if any(v[1] or v[2] for v in verdict):
                break
            time.sleep(0.02)
        self._settle_one(Outcome(self._join_request(), Answer.UNDELIVERED), now)

    def _adopt(self, mine: GlobalState, target: list[int], header: tuple, now: float) -> None:
        """Every rank adopts its slices moved to the ``target`` versions (the same on every rank)."""
        session, incarnation, data_position, stop = header
        fragments = []
        for frag in mine.fragments:
            updates = self._held.take(frag.fragment, frag.version, target[frag.fragment])
            fragments.append(FragmentValue(frag.fragment, target[frag.fragment],
                                           catch_up(frag.values, updates)))
        if not self.core.links[0].joining:
            self.core.links[0].start_join()  # every rank takes the registration rank 0 made
        state = GlobalState(tuple(fragments), incarnation=incarnation, session=session, data_position=data_position)
        self._take(self.core.on_admitted(state, now, stop=stop))
        self._joins += 1
        log.info("rank %d adopted the global state at versions %s", self.rank, list(self.core.versions))

    def _settle(self, per_rank: list[list[Outcome]], now: float) -> None:
        """Apply a contribution's outcome once every rank's slice has one; others (rank 0's) at once."""
        done = []
        for rank, outcomes in enumerate(per_rank):
            for outcome in outcomes:
                c = outcome.request
                if not isinstance(c, Contribution):
                    self._settle_one(outcome, now)
                    continue
                key = (c.fragment, c.seq, c.session)
                slot = self._pending.setdefault(key, {})
                slot[rank] = outcome
                if len(slot) == self.world:
                    done.append(key)
        for key in done:
            slot = self._pending.pop(key)
            answers = [slot[r] for r in range(self.world)]
            refused = [o for o in answers if o.answer is Answer.REFUSED]
            undelivered = [o for o in answers if o.answer is Answer.UNDELIVERED]
            first = answers[0]
            if refused:
                self._settle_one(Outcome(first.request, Answer.REFUSED, refused[0].reason), now)
            elif undelivered:
                self._settle_one(Outcome(first.request, Answer.UNDELIVERED), now)
            else:
                self._settle_one(Outcome(first.request, Answer.ACCEPTED, stop=any(o.stop for o in answers)), now)

    def _settle_one(self, outcome: Outcome, now: float) -> None:
        core = self.core
        if outcome.answer is Answer.ACCEPTED:
            self._take(core.on_accepted(outcome.request, now, stop=outcome.stop))
        elif outcome.answer is Answer.REFUSED:
            assert outcome.reason is not None
            self._take(core.on_refused(outcome.request, outcome.reason, now))
        else:
            self._take(core.on_undelivered(outcome.request, now))
