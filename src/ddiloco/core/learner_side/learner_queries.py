"""What a learner answers about itself without changing anything: whether it holds a state,
its progress and sessions, what its training loop does next, which session a request was
made in, when it must be ticked, its anchors and codecs (the part of
:class:`~ddiloco.core.learner_side.learner_core.Learner` that the drivers read, kept apart
from its reactions to the network)."""

from __future__ import annotations

import torch

from ddiloco.core.learner_side.flat import FlatFragment
from ddiloco.core.learner_side.learner_phase import LearnerPhase, LoopMove
from ddiloco.core.learner_side.send_schedule import SendSchedule
from ddiloco.core.learner_side.shard_link import ShardLink
from ddiloco.core.shared.actions import Send
from ddiloco.core.shared.codecs import Codec
from ddiloco.core.shared.messages import Contribution, Progress, Request, Session
from ddiloco.core.shared.protocol_config import ProtocolConfig


class LearnerQueries:
    config: ProtocolConfig
    boot: str
    phase: LearnerPhase
    links: list[ShardLink]
    versions: list[int]
    schedule: SendSchedule
    step: int
    _tokens_total: int
    _flat: list[FlatFragment]
    _uplink: Codec
    _downlink: Codec

    @property
    def joined(self) -> bool:
        """Holds a global state (it may be rejoining)."""
        return min(self.versions) >= 0

    @property
    def should_stop(self) -> bool:
        return self.phase in (LearnerPhase.STOPPING, LearnerPhase.STOPPED, LearnerPhase.FAILED)

    @property
    def progress(self) -> Progress:
        return Progress(self.boot, self._tokens_total, self.step)

    @property
    def session(self) -> Session | None:
        """The session at the first (or only) shard."""
        return self.links[0].session

    def session_of(self, fragment: int) -> Session | None:
        return self.links[self.config.shard_of(fragment)].session

    def rejoining(self) -> bool:
        """Some shard is being joined again (its fragments are not sent meanwhile)."""
        return any(link.joining for link in self.links)

    def between_steps(self, now: float) -> LoopMove:
        """What the training loop does before its next inner step (both drivers ask this).

        It waits before the first global state and while synchronous DiLoCo waits for the update
        of a fragment it sent (``protocol.max_wait_s``); it trains on while it rejoins a shard.
        """
        if self.phase is LearnerPhase.STOPPING:
            return LoopMove.CLOSE
        if self.phase in (LearnerPhase.STOPPED, LearnerPhase.FAILED):
            return LoopMove.END
        if self.phase is LearnerPhase.IDLE or not self.joined or self.schedule.waiting(now):
            return LoopMove.WAIT
        return LoopMove.STEP

    def stream_versions(self, shard: int) -> list[int] | None:
        """What the learner announces when its update stream from ``shard`` is made again, so that
        the synchronizer replays what it missed (``core/sync_side/replay.py``): the versions it holds. None
        while it has no state or no session there: its join brings the state, nothing to replay."""
        if self.links[shard].session is None or not self.joined:
            return None
        return list(self.versions)

    def is_current(self, request: Request | Send) -> bool:
        """Was this request made in the current session of its shard? (Older work is dropped.)"""
        shard = self._shard_of(request)
        return shard is not None and self._session_of_request(request) == self.links[shard].session

    def _session_of_request(self, request: Request | Send) -> Session | None:
        return request.header.session if isinstance(request, Send) else getattr(request, "session", None)

    def _shard_of(self, request: Request | Send) -> int | None:
        """Which shard a request was for: by fragment, or by the session it carries."""
        if isinstance(request, Send):
            return request.shard
        if isinstance(request, Contribution):
            return self.config.shard_of(request.fragment)
        session = getattr(request, "session", None)
        return next((i for i, link in enumerate(self.links) if link.session == session), None)

    def next_deadline(self) -> float | None:
        """When ``tick`` has something to do: a heartbeat, a join retry, the end of a wait."""
        times = [t for link in self.links for t in (link.heartbeat_due_s, link.join_retry_s) if t is not None]
        times += self.schedule.wait_deadlines()
        return min(times) if times else None

    @property
    def next_batch(self) -> int:
        """The batch of its data stream the next inner step trains (fixed by the first join's ``data_position``)."""
        return self.schedule.first_batch + self.step

    def anchor(self, fragment: int) -> torch.Tensor:
        """The global value this learner last adopted for ``fragment`` (do not modify)."""
        return self._flat[fragment].anchor

    def decodes_updates(self, fragment: int) -> bool:
        """Does the core apply ``fragment``'s updates straight from their payload (one fused pass),
        so that a driver gains nothing by decoding them ahead?"""
        return self._flat[fragment].fused_down

    def encodes_contributions(self, fragment: int) -> bool:
        """Does the core make ``fragment``'s uplink payload itself (one fused pass; a driver sends it as it is)?"""
        return self._flat[fragment].fused_up

    @property
    def codecs(self) -> tuple[Codec, Codec]:
        """The uplink and downlink codecs the core encodes and decodes with (their block size)."""
        return self._uplink, self._downlink
