"""The control messages between a learner's training process and its link's helper process.

They are small (a fragment's bytes travel through the shared slots, ``slots.py``): pickled
tuples ``(Msg, *fields)``, each framed by its length on a Unix socket pair. A join's global
state, too large for a message and too rare for a slot of its own, travels as an anonymous
shared file whose descriptor follows its message (``SCM_RIGHTS``).
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

from ddiloco.core.messages import GlobalState, Session
from ddiloco.runtime.client import ClientSpec, JoinResult
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.learner.slots import SlotLayout

_LENGTH = struct.Struct("<I")


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
    RELEASE = 7
    """``(fragment)``: the trainer is done with the in slot; the helper may write it again."""
    CLOSE = 8
    """``(timeout_s)``: deliver what is queued, then the leaves, then CLOSED, and exit."""
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
    holding: tuple[int, ...]
    """Fragments whose in slot the trainer has not released yet (not to be written before it does)."""
    parent_pid: int
    log_level: int


class PipeClosed(Exception):
    """The other process is gone (or closed its end)."""


class Pipe:
    """One end of the socket pair; ``send`` may be called from any thread, ``recv`` from one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, *msg: Any, fd: int | None = None) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self.sock.sendall(_LENGTH.pack(len(data)) + data)
                if fd is not None:
                    socket.send_fds(self.sock, [b"F"], [fd])
        except OSError as err:
            raise PipeClosed(str(err)) from None

    def recv(self) -> tuple:
        (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        return pickle.loads(self._exactly(length))

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
    """A join's reply as the helper sent it (``helper.send_state``): the values are views of the
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
