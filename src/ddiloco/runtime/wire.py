"""The wire between learners and the synchronizer: every conversion between the core's
messages (:mod:`ddiloco.core.shared.messages`) and protobuf (the Status call's is in
:mod:`ddiloco.runtime.status.wire_form`), the chunking of large payloads, message sizes and
channel options. Client and server both import from here, so neither
depends on the other's module and no message is written by hand twice.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np
import torch

from ddiloco.core.shared.messages import (
    Contribution,
    FragmentUpdate,
    FragmentValue,
    GlobalState,
    Heartbeat,
    Join,
    Leave,
    MergedRef,
    Progress,
    Session,
)
from ddiloco.core.shared.slices import SliceSpec
from ddiloco.runtime.proto import ddiloco_pb2 as pb

CHUNK_BYTES = 1 << 20
"""Payload bytes per streamed message: far below gRPC's 4 MiB default message limit."""
MAX_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class WireError(ValueError):
    """A message that parses as protobuf but does not make a valid core message."""


# ---- small parts ---------------------------------------------------------------------------


def session_to_pb(session: Session) -> pb.Session:
    return pb.Session(incarnation=session.incarnation, number=session.number)


def session_from_pb(msg: pb.Session) -> Session:
    return Session(int(msg.incarnation), int(msg.number))


def progress_to_pb(progress: Progress) -> pb.Progress:
    return pb.Progress(boot=progress.boot, tokens=progress.tokens, steps=progress.steps)


def progress_from_pb(msg: pb.Progress) -> Progress | None:
    return _checked(Progress, msg.boot, int(msg.tokens), int(msg.steps)) if msg.boot else None


def _checked(build: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return build(*args, **kwargs)
    except ValueError as err:
        raise WireError(str(err)) from None


# ---- requests ------------------------------------------------------------------------------


def join_to_pb(join: Join, *, probe: bool = False) -> pb.JoinRequest:
    return pb.JoinRequest(learner_id=join.learner_id, boot=join.boot, probe=probe, tokens_per_step=join.tokens_per_step)


def join_from_pb(msg: pb.JoinRequest) -> Join:
    return _checked(Join, msg.learner_id, msg.boot, int(msg.tokens_per_step))


def heartbeat_to_pb(beat: Heartbeat) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(learner_id=beat.learner_id, session=session_to_pb(beat.session),
                               progress=progress_to_pb(beat.progress))


def heartbeat_from_pb(msg: pb.HeartbeatRequest) -> Heartbeat:
    progress = progress_from_pb(msg.progress)
    if progress is None:
        raise WireError("heartbeat without progress")
    return _checked(Heartbeat, msg.learner_id, _checked(session_from_pb, msg.session), progress)


def leave_to_pb(leave: Leave) -> pb.LeaveRequest:
    return pb.LeaveRequest(learner_id=leave.learner_id, session=session_to_pb(leave.session),
                           progress=progress_to_pb(leave.progress))


def leave_from_pb(msg: pb.LeaveRequest) -> Leave:
    progress = progress_from_pb(msg.progress)
    if progress is None:
        raise WireError("leave without progress")
    return _checked(Leave, msg.learner_id, _checked(session_from_pb, msg.session), progress)


def contribution_header(c: Contribution) -> pb.ContributionHeader:
    header = pb.ContributionHeader(
        learner_id=c.learner_id, fragment=c.fragment, base_version=c.base_version, seq=c.seq,
        tokens=c.tokens, steps=c.steps, compute_s=c.compute_s, step_time_s=c.step_time_s,
        codec=c.codec, payload_bytes=len(c.payload), first_step=c.first_step, session=session_to_pb(c.session),
    )
    if c.progress is not None:
        header.progress.CopyFrom(progress_to_pb(c.progress))
    if c.slice is not None:
        header.slice.CopyFrom(pb.Slice(rank=c.slice.rank, world=c.slice.world,
                                       starts=[a for a, _ in c.slice.ranges], lengths=[n for _, n in c.slice.ranges]))
    return header


def slice_from_pb(header: pb.ContributionHeader) -> SliceSpec | None:
    if not header.HasField("slice"):
        return None
    msg = header.slice
    if len(msg.starts) != len(msg.lengths):
        raise WireError(f"a slice of {len(msg.starts)} starts and {len(msg.lengths)} lengths")
    return _checked(SliceSpec, int(msg.rank), int(msg.world), tuple(zip(map(int, msg.starts), map(int, msg.lengths))))


def contribution_from_pb(header: pb.ContributionHeader, payload: bytes) -> Contribution:
    return _checked(
        Contribution,
        learner_id=header.learner_id,
        session=_checked(session_from_pb, header.session),
        fragment=int(header.fragment),
        base_version=int(header.base_version),
        seq=int(header.seq),
        tokens=int(header.tokens),
        steps=int(header.steps),
        compute_s=float(header.compute_s),
        step_time_s=float(header.step_time_s),
        codec=header.codec,
        payload=payload,
        first_step=int(header.first_step),
        progress=progress_from_pb(header.progress),
        slice=slice_from_pb(header),
    )


def contribution_chunks(c: Contribution) -> Iterator[pb.ContributionChunk]:
    """A contribution as a stream of chunks (the header rides in the first one)."""
    view = memoryview(c.payload)
    for offset in range(0, max(len(view), 1), CHUNK_BYTES):
        chunk = pb.ContributionChunk(offset=offset, data=bytes(view[offset : offset + CHUNK_BYTES]))
        if offset == 0:
            chunk.header.CopyFrom(contribution_header(c))
        yield chunk


# ---- the downlink --------------------------------------------------------------------------


def update_chunks(update: FragmentUpdate) -> list[bytes]:
    """A compressed outer update as serialized Update messages, ready for every stream."""
    data = memoryview(update.payload)
    total = len(data)
    merged = [pb.MergedRef(learner_id=m.learner_id, session=m.session, seq=m.seq) for m in update.merged]
    return [
        pb.Update(fragment=update.fragment, version=update.version, codec=update.codec, offset=offset,
                  total_bytes=total, incarnation=update.incarnation, round_age_s=update.round_age_s,
                  merged=merged if offset == 0 else (),
                  data=bytes(data[offset : offset + CHUNK_BYTES])).SerializeToString()
        for offset in range(0, max(total, 1), CHUNK_BYTES)
    ]


class UpdateAssembler:
    """Rebuilds :class:`FragmentUpdate` values from a stream of Update chunks."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._current: tuple[int, int, int] | None = None
        self._merged: tuple[MergedRef, ...] = ()

    def add(self, msg: pb.Update) -> FragmentUpdate | None:
        key = (msg.fragment, msg.version, msg.incarnation)
        if msg.offset == 0:
            self._parts, self._current = [], key
            self._merged = tuple(MergedRef(m.learner_id, int(m.session), int(m.seq)) for m in msg.merged)
        elif self._current != key or msg.offset != sum(map(len, self._parts)):
            self._parts, self._current = [], None  # a broken sequence: drop it (the learner will see a gap)
            return None
        self._parts.append(msg.data)
        if sum(map(len, self._parts)) < msg.total_bytes:
            return None
        payload = b"".join(self._parts)
        self._parts, self._current = [], None
        return FragmentUpdate(msg.fragment, msg.version, msg.codec, payload, int(msg.incarnation), msg.round_age_s,
                              self._merged)


def state_chunks(state: GlobalState) -> Iterable[pb.StateChunk]:
    for frag in state.fragments:
        yield from fragment_chunks(frag)


def fragment_chunks(frag: FragmentValue) -> Iterable[pb.StateChunk]:
    """One fragment's fp32 value in chunks, each copied out of the value as it is sent."""
    assert frag.values is not None
    values = frag.values.detach().to(torch.float32).contiguous().numpy()
    data = memoryview(values.astype("<f4", copy=False)).cast("B")
    total = len(data)
    for offset in range(0, max(total, 1), CHUNK_BYTES):
        yield pb.StateChunk(fragment=frag.fragment, version=frag.version, offset=offset, total_bytes=total,
                            data=bytes(data[offset : offset + CHUNK_BYTES]))


class StateAssembler:
    """Rebuilds fp32 fragment values from StateChunks (each fragment's chunks in order).

    A sharded synchronizer sends only the fragments it owns; which ones a learner must receive
    is checked by its core when it adopts them."""

    def __init__(self) -> None:
        self._parts: dict[int, list[bytes]] = {}
        self._meta: dict[int, tuple[int, int]] = {}

    def add(self, chunk: pb.StateChunk) -> None:
        parts = self._parts.setdefault(chunk.fragment, [])
        if chunk.offset != sum(map(len, parts)):
            raise WireError(f"state chunk of fragment {chunk.fragment} out of order")
        parts.append(chunk.data)
        self._meta[chunk.fragment] = (chunk.version, chunk.total_bytes)

    def state(self, *, incarnation: int = 0, session: Session | None = None, data_position: int = 0) -> GlobalState:
        """The fragments' values, each copied chunk by chunk into its tensor while its chunks are let
        go: a join holds the state once, plus one fragment's values. (Each fragment's chunks joined
        and then copied held the state about twice, the chunks and the values, until the last fragment.)"""
        values = []
        for p in sorted(self._parts):
            version, total = self._meta[p]
            parts = self._parts.pop(p)
            received = sum(map(len, parts))
            if received != total or total % 4:
                raise WireError(f"state of fragment {p} incomplete ({received} of {total} bytes)")
            array = np.empty(total // 4, dtype=np.float32)
            at = 0
            parts.reverse()  # popped from the end, in order
            while parts:
                chunk = np.frombuffer(parts.pop(), dtype="<f4")
                array[at:at + chunk.size] = chunk
                at += chunk.size
            values.append(FragmentValue(p, version, torch.from_numpy(array)))
        return GlobalState(tuple(values), incarnation=incarnation, session=session, data_position=data_position)
