"""The control messages between a learner's training process and its link's helper process.

They are small (a fragment's bytes travel through the shared slots, ``slots.py``): tuples
``(Msg, *fields)`` on a Unix socket pair, each framed by its length and a tag. The two the
training thread sends on its steps, contributions' announces (SEND), are fixed structs
(:class:`SendFrames`: a ``struct.pack``, a fraction of a pickle's cost; the fields every
contribution of a learner shares come from the helper's spec); every other message is pickled.
An in slot's release is no message: a word in the slot's header (``slots.py``). A join's global
state, too large for a message and too rare for a slot of its own, travels as an anonymous shared
file whose descriptor follows its message (``SCM_RIGHTS``: :func:`send_state`, :func:`receive_state`).
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
import os
import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ddiloco.core.shared.messages import Contribution, GlobalState, Progress, Session
from ddiloco.core.shared.slices import SliceSpec
from ddiloco.runtime.client import ClientSpec, JoinResult
from ddiloco.runtime.learner.slots import SlotLayout, shared_file
from ddiloco.runtime.proto import ddiloco_pb2 as pb

_HEAD = struct.Struct("<IB")
"""A frame's head: the length of its body and its tag, ``PICKLED`` or the Msg its fixed struct carries."""
PICKLED = 0


class Msg(enum.IntEnum):
    # ---- training process → helper
    INIT = 1
    """``(HelperSpec)``: the first message; the helper answers READY or FATAL."""
    SEND = 2
    """``(rid, shard, Contribution without payload, fragment, slot number, raw)``: upload the out slot
    (``raw``: it holds Δ as float32, for the helper to compress)."""
    ANSWER = 3
    """``(qid, value)``: the core's answer to an ASK."""
    JOIN = 4
    """``(rid, shard, Join, timeout_s)``."""
    BEAT = 5
    """``(rid, shard, Heartbeat)``."""
    LEAVE = 6
    """``(rid, shard, Leave)``."""
    CLOSE = 8
    """``(timeout_s)``: deliver what is queued, then the leaves, then CLOSED, and exit."""
    FETCH = 9
    """``(rid, shard, Session, timeout_s)``: a sharded learner's rank > 0 fetches its slices of the state
    under the session its rank 0 opened; the reply is ADMITTED, like a join's."""
    FOLLOW = 10
    """``(shard, Session, versions)``: a rank's update stream is the session's, from ``versions`` on
    (a sharded learner's ranks say what to stream; an unsharded learner's helper asks, STREAM_VERSIONS)."""
    # ---- helper → training process
    READY = 20
    FATAL = 21
    """``(line)``: the helper cannot run (or the run cannot go on); one line for the user."""
    ASK = 22
    """``(qid, Ask, argument)``: a question only the core answers."""
    ACCEPTED = 23
    """``(rid, stop, payload bytes)``."""
    REFUSED = 24
    """``(rid, RejectReason, detail)``."""
    UNDELIVERED = 25
    """``(rid, why)``."""
    TORN = 26
    """``(rid)``: the out slot was written again before the helper read it: not sent."""
    ADMITTED = 27
    """``(rid, header bytes, GlobalState without values, byte offsets)``; the state's file follows."""
    UPDATE = 28
    """``(shard, FragmentUpdate without payload, fragment or -1, slot number, decoded)``; -1: the
    payload is in the message (it fits no slot: the core refuses it)."""
    STOP_NOTICE = 29
    """``(shard)``: the synchronizer says the budget is spent."""
    CLOSED = 30


class Ask(enum.IntEnum):
    STILL_TO_SEND = 1
    """Argument: the SEND's rid. Is the contribution still of the current session (``Learner.still_to_send``)?"""
    STREAM_VERSIONS = 2
    """Argument: a shard. The versions to resubscribe with (``Learner.stream_versions``)."""


@dataclass(frozen=True, slots=True)
class HelperSpec:
    """Everything a helper needs to run one learner's link."""

    learner_id: str
    clients: tuple[ClientSpec, ...]
    layout: SlotLayout
    uplink: str
    downlink: str
    block_size: int
    numels: tuple[int, ...]
    decodes: tuple[bool, ...]
    """Per fragment: the helper writes an update's decoded float32 values into the in slot (else its payload)."""
    sessions: tuple[Session | None, ...]
    """Per shard, the session the learner holds (a helper started again resubscribes with it)."""
    boot: str
    """The learner's boot id, which every contribution's progress carries (``SendFrames``)."""
    parent_pid: int
    log_level: int
    part: tuple[int, int] | None = None
    """(rank, world) of one rank of a sharded (FSDP2) learner, whose helper sends and receives only
    its slices (``runtime/learner/fsdp/rank_link.py``); None for a whole learner."""
    cuts: tuple[SliceSpec, ...] = ()
    """With ``part``: the rank's slice of each fragment (``numels`` stay the whole fragments')."""

    def sent_numel(self, fragment: int) -> int:
        """How many values a contribution of ``fragment`` carries: the rank's slice, or the fragment."""
        return self.cuts[fragment].numel if self.cuts else self.numels[fragment]


class PipeClosed(Exception):
    """The other process is gone (or closed its end)."""


_SEND = struct.Struct("<qqqQ?Qqqqqqddq?qq")
"""Msg.SEND: rid, shard, fragment, slot number, raw; the contribution's session (incarnation,
number), base version, seq, tokens, steps, compute_s, step_time_s, first step; its progress
(present, tokens, steps)."""
_CARRIED = ("learner_id", "session", "fragment", "base_version", "seq", "tokens", "steps", "compute_s",
            "step_time_s", "codec", "payload", "first_step", "progress", "slice")
"""Every field of a Contribution, as ``SendFrames`` carries it (a test fails if one is added: carry it too).
``slice`` only as absent: a sharded learner's rank sends its slices pickled (a pickle per fragment and
rank is nothing beside the slice's bytes, which travel in the slot)."""


@dataclass(frozen=True, slots=True)
class SendFrames:
    """The hot control messages as fixed structs. ``learner_id``, ``codec`` and ``boot`` are what
    every contribution of one learner shares: the helper fills them in from its spec, and a
    contribution that differs (or a field out of the struct's range) is pickled instead."""

    learner_id: str
    codec: str
    boot: str

    def send(self, rid: int, shard: int, header: Contribution, fragment: int, seq: int, raw: bool) -> bytes:
        """A whole SEND frame."""
        progress = header.progress
        if (header.learner_id == self.learner_id and header.codec == self.codec and not header.payload
                and header.slice is None and (progress is None or progress.boot == self.boot)):
            session = header.session
            try:
                body = _SEND.pack(rid, shard, fragment, seq, raw, session.incarnation, session.number,
                                  header.base_version, header.seq, header.tokens, header.steps, header.compute_s,
                                  header.step_time_s, header.first_step, progress is not None,
                                  progress.tokens if progress else 0, progress.steps if progress else 0)
            except struct.error:
                pass
            else:
                return _HEAD.pack(_SEND.size, Msg.SEND) + body
        return pickled((Msg.SEND, rid, shard, header, fragment, seq, raw))

    def unpack(self, tag: int, body: bytes) -> tuple:
        """The message of a fixed-struct frame's body, as its pickled twin would read."""
        if tag != Msg.SEND:
            raise PipeClosed(f"a frame of unknown tag {tag}")
        (rid, shard, fragment, seq, raw, incarnation, number, base_version, cseq, tokens, steps, compute_s,
         step_time_s, first_step, has_progress, p_tokens, p_steps) = _SEND.unpack(body)
        header = Contribution(self.learner_id, Session(incarnation, number), fragment, base_version, cseq, tokens,
                              steps, compute_s, step_time_s, self.codec, b"", first_step,
                              Progress(self.boot, p_tokens, p_steps) if has_progress else None)
        return Msg.SEND, rid, shard, header, fragment, seq, raw


def pickled(msg: tuple) -> bytes:
    """A whole frame holding ``msg`` pickled."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEAD.pack(len(data), PICKLED) + data


class Pipe:
    """One end of the socket pair; ``send`` may be called from any thread, ``recv`` from one.
    ``frames``: how to read the fixed-struct messages (the helper's end)."""

    def __init__(self, sock: socket.socket, frames: SendFrames | None = None) -> None:
        self.sock = sock
        self.frames = frames
        self._send_lock = threading.Lock()

    def send(self, *msg: Any, fd: int | None = None) -> None:
        self.send_frames(pickled(msg), fd=fd)

    def send_frames(self, data: bytes, *, fd: int | None = None) -> None:
        """Whole frames, back to back, in one system call (``fd`` after them)."""
        try:
            with self._send_lock:
                self.sock.sendall(data)
                if fd is not None:
                    socket.send_fds(self.sock, [b"F"], [fd])
        except OSError as err:
            raise PipeClosed(str(err)) from None

    def recv(self) -> tuple:
        length, tag = _HEAD.unpack(self._exactly(_HEAD.size))
        body = self._exactly(length)
        if tag == PICKLED:
            return pickle.loads(body)
        if self.frames is None:
            raise PipeClosed(f"a fixed-struct message ({tag}) on a pipe that reads none")
        return self.frames.unpack(tag, body)

    def recv_fd(self) -> int:
        try:
            _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        except OSError as err:
            raise PipeClosed(str(err)) from None
        if not fds:
            raise PipeClosed("a message announced a file and none came")
        return fds[0]

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except socket.timeout:
                raise
            except OSError as err:
                raise PipeClosed(str(err)) from None
            if k == 0:
                raise PipeClosed("closed")
            got += k
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def receive_state(header: bytes, skeleton: GlobalState, offsets: list[int], size: int, fd: int) -> JoinResult:
    """A join's reply as the helper sent it (:func:`send_state`): the values are views of the
    shared file, mapped here and closed once the last view is gone (no copy)."""
    try:
        region = mmap.mmap(fd, size) if size else None
    finally:
        os.close(fd)
    ends = offsets[1:] + [size]
    fragments = tuple(dataclasses.replace(frag, values=torch.from_numpy(
        np.frombuffer(region, dtype=np.float32, count=(end - at) // 4, offset=at)) if region is not None
        else torch.empty(0)) for frag, at, end in zip(skeleton.fragments, offsets, ends))
    return JoinResult(pb.JoinHeader.FromString(header), dataclasses.replace(skeleton, fragments=fragments))


def send_state(pipe: Pipe, rid: int, result: JoinResult) -> None:
    """A join's reply: the header and the state's layout as a message, its values (float32, back to
    back) as an anonymous shared file that the trainer maps."""
    state = result.state
    offsets, at = [], 0
    for frag in state.fragments:
        offsets.append(at)
        at += 4 * (frag.values.numel() if frag.values is not None else 0)
    fd = shared_file(at, "ddiloco-state")
    try:
        if at:
            with mmap.mmap(fd, at) as region:
                out = np.frombuffer(region, dtype=np.uint8)
                for frag, offset in zip(state.fragments, offsets):
                    values = frag.values.to(torch.float32).contiguous().reshape(-1).numpy()
                    out[offset:offset + values.nbytes] = values.view(np.uint8)
                del out
        skeleton = GlobalState(tuple(dataclasses.replace(f, values=None) for f in state.fragments),
                               state.incarnation, state.session, state.data_position)
        pipe.send(Msg.ADMITTED, rid, result.header.SerializeToString(), skeleton, offsets, at, fd=fd)
    finally:
        os.close(fd)
