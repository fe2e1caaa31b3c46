"""The Status call's answer: the core's :class:`~ddiloco.core.sync_side.status_snapshot.SyncStatus`, carried
by :func:`~ddiloco.runtime.status.wire_form.status_to_pb`, plus what only the service measures
(bytes on the wire, goodput, checkpoints, wire rejections), set here.

Learners come a page at a time (``learner_offset``, ``learner_limit``; ``learners_total``
says how many there are), so a registry of thousands never makes one reply too large."""

from __future__ import annotations

import collections
import time
from dataclasses import replace
from typing import Protocol

from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.core.sync_side.status_snapshot import SyncStatus
from ddiloco.measures.wire_bytes import ByteLedger, Direction
from ddiloco.runtime.auth import PROTOCOL_VERSION
from ddiloco.runtime.layout import ModelLayout
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.status.wire_form import LEARNERS_PAGE, status_to_pb
from ddiloco.runtime.sync.boundary import Boundary
from ddiloco.runtime.sync.checkpoint_writer import CheckpointWriter
from ddiloco.runtime.sync.metrics import GoodputMeter
from ddiloco.settings.config import Config


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
    process_start_s: float


def status_reply(service: Measured, core: SyncStatus, now: float, learner_offset: int = 0,
                 learner_limit: int = 0) -> pb.StatusReply:
    """``core`` (one page of its learners) through :func:`status_to_pb`, and what the service measures."""
    boundary = service.boundary
    limit = min(learner_limit or LEARNERS_PAGE, LEARNERS_PAGE)
    page = tuple(replace(rec, rejected=rec.rejected + boundary.learner_rejected.get(rec.learner_id, 0))
                 for rec in core.learners[learner_offset:learner_offset + limit])
    rejections = dict(collections.Counter(core.rejections) + boundary.rejections)
    reply = status_to_pb(replace(core, learners=page, rejections=rejections), now)
    wall_now = time.monotonic()
    writer, ledger = service.writer, service.ledger
    last_ckpt = writer.last_good_s
    reply.MergeFrom(pb.StatusReply(
        protocol_version=PROTOCOL_VERSION,
        uptime_s=wall_now - service.process_start_s,
        bytes_up=ledger.total(Direction.UP),
        bytes_down=ledger.total(Direction.DOWN),
        checkpoints=writer.checkpoints,
        checkpoint_failures=writer.failures,
        last_checkpoint_error=writer.last_error,
        learners_total=len(core.learners),
        last_checkpoint_s_ago=-1.0 if last_ckpt is None else wall_now - last_ckpt,
        mode=service.config.run.mode,
        shard=service.shard,
        shards=service.protocol.shards,
    ))
    reply.goodput, reply.model_uptime, _ = service.goodput.measured(wall_now)
    up, down = ledger.by(0, Direction.UP), ledger.by(0, Direction.DOWN)
    for learner in reply.learners:
        learner.bytes_up, learner.bytes_down = up.get(learner.id, 0), down.get(learner.id, 0)
    up, down = ledger.by(1, Direction.UP), ledger.by(1, Direction.DOWN)
    for fragment in reply.fragments:
        fragment.numel = service.layout.plan.fragments[fragment.id].numel
        fragment.bytes_up, fragment.bytes_down = up.get(fragment.id, 0), down.get(fragment.id, 0)
    return reply
