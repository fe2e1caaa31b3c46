"""The Status call's answer: the core's :class:`~ddiloco.core.sync_status.SyncStatus` plus
what only the service measures (bytes on the wire, goodput, checkpoints, wire rejections).

Learners come a page at a time (``learner_offset``, ``learner_limit``; ``learners_total``
says how many there are), so a registry of thousands never makes one reply too large."""

from __future__ import annotations

import collections
import time
from typing import Protocol

from ddiloco.config import Config
from ddiloco.core.config import ProtocolConfig
from ddiloco.core.run import RunPhase
from ddiloco.core.sync_status import SyncStatus
from ddiloco.measures import ByteLedger, Direction
from ddiloco.runtime.auth import PROTOCOL_VERSION
from ddiloco.runtime.sync.boundary import Boundary
from ddiloco.runtime.sync.checkpoint_writer import CheckpointWriter
from ddiloco.runtime.layout import ModelLayout
from ddiloco.runtime.sync.metrics import GoodputMeter
from ddiloco.runtime.proto import ddiloco_pb2 as pb


class Measured(Protocol):
    """What the service measures itself, beside its core's status."""

    config: Config
    protocol: ProtocolConfig
    shard: int
    layout: ModelLayout
    ledger: ByteLedger
    boundary: Boundary
    goodput: GoodputMeter
    writer: CheckpointWriter
    first_join_s: float | None
    process_start_s: float


LEARNERS_PAGE = 1000
"""Learners per Status reply when the caller asks for no page size (and the most it may ask for)."""


def status_reply(service: Measured, core: SyncStatus, now: float, learner_offset: int = 0,
                 learner_limit: int = 0) -> pb.StatusReply:
    wall_now = time.monotonic()
    writer = service.writer
    last_ckpt = writer.last_good_s
    reply = pb.StatusReply(
        incarnation=core.incarnation,
        protocol_version=PROTOCOL_VERSION,
        uptime_s=wall_now - service.process_start_s,
        quorum=core.quorum,
        effective_quorum=core.effective_quorum,
        grace_window_s=core.grace_window_s,
        grace_quorum_s=core.grace_quorum_s,
        grace_sync_s=core.grace_sync_s,
        bytes_up=service.ledger.total(Direction.UP),
        bytes_down=service.ledger.total(Direction.DOWN),
        tokens=core.tokens,
        token_budget=core.token_budget,
        tokens_left=core.tokens_left,
        time_budget_s=core.time_budget_s,
        elapsed_s=core.elapsed_s,
        time_left_s=core.time_left_s,
        finished=core.phase is RunPhase.FINISHED,
        checkpoints=writer.checkpoints,
        checkpoint_failures=writer.failures,
        last_checkpoint_error=writer.last_error,
        learners_total=len(core.learners),
        learners_forgotten=core.learners_forgotten,
        progress_clipped=core.progress_clipped,
        weights_capped=core.weights_capped,
        link_starved_episodes=core.link_starved_episodes,
        last_checkpoint_s_ago=-1.0 if last_ckpt is None else wall_now - last_ckpt,
        mode=service.config.run.mode,
        longest_pause_s=core.longest_pause_s,
        phase=str(core.phase),
        pending_tokens=core.pending_tokens,
        round_phases=[str(p) for p in core.round_phases],
        shard=service.shard,
        shards=service.protocol.shards,
    )
    first = service.first_join_s
    if first is not None:
        end = wall_now
        reply.goodput = service.goodput.goodput(end - first)
        reply.model_uptime = service.goodput.uptime(first, end)
    up_by_learner, down_by_learner = service.ledger.by(0, Direction.UP), service.ledger.by(0, Direction.DOWN)
    limit = min(learner_limit or LEARNERS_PAGE, LEARNERS_PAGE)
    for rec in core.learners[learner_offset:learner_offset + limit]:
        name = rec.learner_id
        reply.learners.append(pb.LearnerStatus(
            id=name,
            alive=rec.alive,
            last_seen_s_ago=now - rec.last_seen_s if rec.last_seen_s else -1.0,
            accepted=rec.accepted,
            rejected=rec.rejected + service.boundary.learner_rejected.get(name, 0),
            registrations=rec.registrations,
            tokens=rec.tokens,
            bytes_up=up_by_learner.get(name, 0),
            bytes_down=down_by_learner.get(name, 0),
            step_time_s=rec.step_time_s or 0.0,
            accepted_per_min=rec.accepted_per_min,
            link_starved=rec.link_starved,
            joining=rec.joining,
            data_position=rec.data_position,
        ))
    up_by_frag, down_by_frag = service.ledger.by(1, Direction.UP), service.ledger.by(1, Direction.DOWN)
    for index, version in zip(core.fragments, core.versions):
        reply.fragments.append(pb.FragmentStatus(
            id=index, version=version, numel=service.layout.plan.fragments[index].numel,
            bytes_up=up_by_frag.get(index, 0), bytes_down=down_by_frag.get(index, 0),
        ))
    for key, count in sorted(core.rounds_closed.items()):
        reply.rounds_closed.append(pb.CountEntry(key=key, count=count))
    for key, count in sorted(core.claims_clipped.items()):
        reply.claims_clipped.append(pb.CountEntry(key=key, count=count))
    rejections = collections.Counter(core.rejections) + service.boundary.rejections
    for key, count in sorted(rejections.items()):
        reply.rejections.append(pb.CountEntry(key=key, count=count))
    return reply
