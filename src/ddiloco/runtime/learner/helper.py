"""A learner's link helper: the process that talks to the synchronizer for its training process.

Everything that costs the interpreter time in proportion to a fragment, or holds its lock for
long — gRPC, protobuf, chunking, compressing Δ, decoding updates, retries and the update
streams — runs here, in a process of its own, so the training process's interpreter is left
to launch kernels. Started by the training process's link (``link.py``) as
``python -m ddiloco.runtime.learner.helper SOCKET_FD SLOTS_FD``. It decides nothing: for every
synchronizer shard it runs the three threads the link always had —

- *sender*: copies a contribution's payload out of its slot (a torn copy is not sent), asks the
  core whether it is still to be sent, compresses it if it came raw, uploads it, and reports how
  the call ended;
- *control*: joins and heartbeats; a join's state goes back as a shared file;
- *receiver*: the update stream of the shard's session, each update written into its
  fragment's slot once the trainer released it (a word in the slot's header), and announced;

and reports every outcome to the training process, whose core decides what follows. A rank of a
sharded (FSDP2) learner has a helper of its own (``fsdp/rank_link.py``; the spec's ``part`` and
``cuts``): its contributions carry the rank's slice, its join (rank 0) and state fetch (the other
ranks) bring the rank's slices, its stream is the one the rank names (``Msg.FOLLOW``), and each
update comes cut to the slice and is decoded here. It exits
with its trainer: the kernel kills it when the process that started it dies
(``PR_SET_PDEATHSIG``), and it leaves when the socket pair closes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import queue
import signal
import socket
import sys
import threading
from typing import Any, Callable

import numpy as np
import torch

from ddiloco.core.learner_side.shard_link import BACKOFF_START_S
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.errors import DdilocoError
from ddiloco.core.shared.messages import Contribution, FragmentUpdate, Session, StopNotice
from ddiloco.core.shared.slice_cut import cut_size, decode_cut
from ddiloco.runtime.client import CallRefused, JoinResult, SyncClient, Unreachable
from ddiloco.runtime.learner.helper_wire import Ask, HelperSpec, Msg, Pipe, PipeClosed, SendFrames, send_state
from ddiloco.runtime.learner.repeats import next_delay
from ddiloco.runtime.learner.slots import Slot, SlotArea
from ddiloco.runtime.proto import ddiloco_pb2 as pb

log = logging.getLogger("ddiloco.learner")

WAIT_S = 1.0
"""The longest any of the helper's threads sleeps without looking whether it is closing."""
RELEASE_POLL_S = 0.001
"""How soon the receiver looks again at an in slot the trainer has not released (doubling, to a tenth of WAIT_S)."""


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel sends SIGKILL when the thread that started this process dies; then check
    that it is still alive (it may have died before the call). Elsewhere the closed socket does it."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or a signal to the process group is for the trainer,
        signal.signal(sig, signal.SIG_IGN)      # which closes this helper as it stops
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(0)


def yield_to_trainer() -> None:
    """Linux: run this process's threads (those started from here on inherit it) as SCHED_BATCH, which
    the kernel never lets preempt a running thread when it wakes. The trainer's announce wakes the
    sender; on a machine without a spare core it would otherwise take the CPU from the training
    thread right inside its ``runtime.step``. With a spare core nothing changes (the helper runs
    there at once); without one, the upload waits for the trainer's time slice to end."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as err:  # not allowed here: the helper still works, as an ordinary process
            log.debug("the helper stays an ordinary process (SCHED_BATCH refused: %s)", err)


class Helper:
    """The link's threads for every shard, and the socket to the training process."""

    def __init__(self, pipe: Pipe, spec: HelperSpec, slots_fd: int) -> None:
        self.pipe = pipe
        self.spec = spec
        self.slots = SlotArea(spec.layout, slots_fd)
        self.uplink = get_codec(spec.uplink, block_size=spec.block_size)
        self.downlink = get_codec(spec.downlink, block_size=spec.block_size)
        self.closing = threading.Event()
        self._answers: dict[int, queue.Queue[Any]] = {}
        self._qids = itertools.count()
        self.shards = [ShardWorker(self, shard, c.connect(), session)
                       for shard, (c, session) in enumerate(zip(spec.clients, spec.sessions))]
        self._leaves: list[tuple[int, int, Any]] = []

    def ask(self, what: Ask, argument: Any) -> Any:
        """The core's answer (the training process's relay thread gives it); None if it closes meanwhile."""
        qid = next(self._qids)
        answer: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._answers[qid] = answer
        self.pipe.send(Msg.ASK, qid, what, argument)
        while not self.closing.is_set():
            try:
                return answer.get(timeout=WAIT_S)
            except queue.Empty:
                continue
        return None

    def serve(self) -> None:
        """Carry out the trainer's messages until it closes the link (or is gone)."""
        for shard in self.shards:
            shard.start()
        while True:
            msg = self.pipe.recv()
            kind = msg[0]
            if kind is Msg.SEND:
                self.shards[msg[2]].outbox.put(msg[1:])
            elif kind is Msg.ANSWER:
                answer = self._answers.pop(msg[1], None)
                if answer is not None:
                    answer.put(msg[2])
            elif kind in (Msg.JOIN, Msg.BEAT, Msg.FETCH):
                self.shards[msg[2]].control(msg)
            elif kind is Msg.FOLLOW:
                self.shards[msg[1]].follow(msg[2], msg[3])
            elif kind is Msg.LEAVE:
                self._leaves.append(msg[1:])
            elif kind is Msg.CLOSE:  # on a thread of its own: its sends still ask the core, through this loop
                threading.Thread(target=self.close, args=(msg[1],), name="ddiloco-close", daemon=True).start()

    def close(self, timeout_s: float) -> None:
        """Deliver what is queued, leave, say CLOSED (whatever happens on the way: the trainer waits for it)."""
        try:
            for shard in self.shards:
                shard.outbox.put(None)
            for shard in self.shards:
                shard.threads[0].join(timeout_s)
            for rid, shard, leave in self._leaves:
                worker = self.shards[shard]
                if worker.outcome(rid, lambda: worker.client.leave(leave)) is not None:
                    self.pipe.send(Msg.ACCEPTED, rid, False, 0)
        finally:
            self.closing.set()
            for shard in self.shards:
                shard.stop()
            self.pipe.send(Msg.CLOSED)
            self.pipe.sock.shutdown(socket.SHUT_RDWR)  # the serving loop ends, and with it the process


def _until_closed(body: Callable[[], None]) -> None:
    """A thread's whole run. Once the training process closed the link (or is gone), what the thread
    was about to report has no one to read it: it ends there, quietly. (An update that arrived as
    the learner closed printed a thread's traceback into the learner's log.)"""
    try:
        body()
    except PipeClosed:
        return


class ShardWorker:
    """The threads that talk to one synchronizer shard."""

    def __init__(self, helper: Helper, shard: int, client: SyncClient, session: Session | None) -> None:
        self.helper = helper
        self.shard = shard
        self.client = client
        self.outbox: queue.Queue[tuple | None] = queue.Queue()
        self._control: queue.Queue[tuple] = queue.Queue()
        self._session = session
        self._session_changed = threading.Event()
        self._stream: Any = None
        self._follow: tuple[Session, list[int]] | None = None
        """A rank's stream (``Msg.FOLLOW``): its session, and the versions it holds, moved on by each update."""
        name = f"{helper.spec.learner_id}-{shard}"
        self.threads = [threading.Thread(target=_until_closed, args=(body,), name=f"ddiloco-{role}-{name}", daemon=True)
                        for role, body in (("send", self._sender), ("ctl", self._control_loop),
                                           ("recv", self._receiver))]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def control(self, msg: tuple) -> None:
        self._control.put(msg)

    def follow(self, session: Session, versions: list[int]) -> None:
        """A rank's update stream: ``session``'s, from ``versions`` on (a new subscription)."""
        self._follow = (session, list(versions))
        self._new_session(session)

    def outcome(self, rid: int, call: Callable[[], Any]) -> Any:
        """Make one call; report refused / undelivered (the caller reports accepted). The reply or None."""
        try:
            return call()
        except Unreachable as err:
            self.helper.pipe.send(Msg.UNDELIVERED, rid, str(err))
        except CallRefused as err:
            self.helper.pipe.send(Msg.REFUSED, rid, err.reason, err.detail)
        return None

    # ---- sender ----------------------------------------------------------------------------

    def _sender(self) -> None:
        helper = self.helper
        while True:
            item = self.outbox.get()
            if item is None:
                return
            rid, _, header, fragment, seq, raw = item
            data = helper.slots.read(Slot.OUT, fragment, seq)
            if data is None:
                helper.pipe.send(Msg.TORN, rid)
                continue
            if not helper.ask(Ask.STILL_TO_SEND, rid):
                continue
            payload = self._payload(header, data, raw)
            if payload is None:
                return
            contribution = dataclasses.replace(header, payload=payload)
            reply = self.outcome(rid, lambda: self.client.contribute(contribution))
            if reply is not None:
                helper.pipe.send(Msg.ACCEPTED, rid, reply.stop, len(payload))

    def _payload(self, header: Contribution, data: bytes, raw: bool) -> bytes | None:
        """The bytes to upload: Δ compressed here if it came raw; None (and the run fails) if Δ was not finite."""
        codec = self.helper.uplink
        numel = self.helper.spec.sent_numel(header.fragment)
        try:
            if raw:
                return codec.encode(torch.frombuffer(bytearray(data), dtype=torch.float32))
            if codec.non_finite(np.frombuffer(data, dtype=np.uint8), numel):
                raise ValueError(f"{codec.name} cannot encode non-finite values")
        except ValueError as err:
            self.helper.pipe.send(Msg.FATAL, f"fragment {header.fragment}: Δ is not finite ({err}): the model "
                                             "diverged")
            return None
        return data

    # ---- control ---------------------------------------------------------------------------

    def _control_loop(self) -> None:
        helper = self.helper
        while not helper.closing.is_set():
            try:
                msg = self._control.get(timeout=WAIT_S)
            except queue.Empty:
                continue
            kind, rid, _, message = msg[:4]
            if kind is Msg.JOIN:
                self._join(rid, message, msg[4])
            elif kind is Msg.FETCH:
                self._fetch(rid, message, msg[4])
            else:
                reply = self.outcome(rid, lambda: self.client.heartbeat(message))
                if reply is not None:
                    helper.pipe.send(Msg.ACCEPTED, rid, reply.stop, 0)

    def _join(self, rid: int, join: Any, timeout_s: float) -> None:
        result: JoinResult | None = self.outcome(rid, lambda: self.client.join(join, timeout_s,
                                                                                 part=self.helper.spec.part))
        if result is None:
            return
        send_state(self.helper.pipe, rid, result)
        if self.helper.spec.part is None:  # a rank's stream is the one it names (FOLLOW)
            self._new_session(result.state.session)

    def _fetch(self, rid: int, session: Session, timeout_s: float) -> None:
        """A rank's slices of the state, under its rank 0's ``session``; ADMITTED like a join's state."""
        spec = self.helper.spec
        state = self.outcome(rid, lambda: self.client.fetch_state(timeout_s, learner_id=spec.learner_id,
                                                                  session=session, part=spec.part))
        if state is not None:
            send_state(self.helper.pipe, rid, JoinResult(pb.JoinHeader(), state))

    def _new_session(self, session: Session | None) -> None:
        self._session = session
        self._session_changed.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()  # subscribe again for the new session

    # ---- receiver --------------------------------------------------------------------------

    def _receiver(self) -> None:
        helper = self.helper
        delay = BACKOFF_START_S
        while not helper.closing.is_set():
            session = self._session
            self._session_changed.clear()
            held = self._stream_versions(session)
            if held is None:  # no session, or the state its join brought is not adopted yet
                self._session_changed.wait(BACKOFF_START_S)
                continue
            try:
                stream = self.client.updates(helper.spec.learner_id, held, session, helper.spec.part)
                self._stream = stream
                for update in stream:
                    delay = BACKOFF_START_S
                    if isinstance(update, StopNotice):
                        helper.pipe.send(Msg.STOP_NOTICE, self.shard)
                    elif not self._deliver(update, held):
                        return
                self._session_changed.wait(BACKOFF_START_S)  # closed by the synchronizer: subscribe again
            except (Unreachable, CallRefused):
                # Not a decision: a broken stream is re-made; whether the session is still ours
                # the core learns from its heartbeats.
                if self._session_changed.wait(delay):
                    delay = BACKOFF_START_S
                else:
                    delay = next_delay(delay)
            finally:
                self._stream = None

    def _stream_versions(self, session: Session | None) -> list[int] | None:
        """The versions to subscribe from: a rank's, as it named them and its stream moved them on;
        a whole learner's, its core's (asked). None: nothing to stream yet."""
        if session is None:
            return None
        if self.helper.spec.part is None:
            return self.helper.ask(Ask.STREAM_VERSIONS, self.shard)
        follow = self._follow
        return follow[1] if follow is not None and follow[0] == session else None

    def _deliver(self, update: FragmentUpdate, held: list[int]) -> bool:
        """Write the update into its fragment's slot once the trainer released it, and announce it
        (decoded here where the spec says so). False if the helper closes meanwhile."""
        helper, spec, p = self.helper, self.helper.spec, update.fragment
        fits = (0 <= p < len(spec.numels) and update.codec == helper.downlink.name
                and len(update.payload) == self._payload_size(p))
        if not fits:  # the core refuses it, with the reason
            helper.pipe.send(Msg.UPDATE, self.shard, update, -1, 0, False)
            return True
        wait_s = RELEASE_POLL_S
        while not helper.slots.free(Slot.IN, p):  # rare: the trainer applies an update at its next step
            if helper.closing.wait(wait_s):
                return False
            wait_s = min(2 * wait_s, WAIT_S / 10)
        if spec.cuts:
            data = decode_cut(helper.downlink, update.payload, spec.numels[p], spec.cuts[p]).numpy()
        elif spec.decodes[p]:
            data = helper.downlink.decode(update.payload, spec.numels[p]).numpy()
        else:
            data = np.frombuffer(update.payload, dtype=np.uint8)
        seq = helper.slots.write(Slot.IN, p, data)
        held[p] = max(held[p], update.version)  # a stream made again resumes after it
        helper.pipe.send(Msg.UPDATE, self.shard, dataclasses.replace(update, payload=b""), p, seq, spec.decodes[p])
        return True

    def _payload_size(self, p: int) -> int:
        """The bytes an update of fragment p carries: its cut to the rank's slice, or the whole payload."""
        spec = self.helper.spec
        if spec.cuts:
            return cut_size(self.helper.downlink, spec.numels[p], spec.cuts[p])
        return self.helper.downlink.encoded_size(spec.numels[p])

    def stop(self) -> None:
        self._session_changed.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        self.client.close()


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    pipe = Pipe(sock)
    try:
        kind, spec = pipe.recv()
    except PipeClosed:
        return 0
    assert kind is Msg.INIT
    die_with_parent(spec.parent_pid)
    pipe.frames = SendFrames(spec.learner_id, spec.uplink, spec.boot)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s {spec.learner_id} link %(levelname)s %(message)s")
    torch.set_num_threads(1)  # the trainer's cores are the trainer's
    yield_to_trainer()
    try:
        helper = Helper(pipe, spec, int(argv[1]))
    except (DdilocoError, OSError) as err:
        pipe.send(Msg.FATAL, f"the learner's link helper cannot start: {err}")
        return 2
    pipe.send(Msg.READY)
    try:
        helper.serve()
    except PipeClosed:  # the training process is gone: nothing to report to
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
