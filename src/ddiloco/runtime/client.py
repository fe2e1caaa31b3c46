"""A blocking client of the synchronizer service (learners, ``ddiloco status``, the launcher).

Every call has a deadline (``core/shared/deadlines.py``: the answer within ``CLIENT_ANSWER_S``, plus
what the call carries at the rate a learner expects of its link). Failures come back as three kinds of exception, because a
learner reacts to each differently:

- :class:`CallRefused`: the synchronizer answered and rejected the message, with the core's
  :class:`~ddiloco.core.shared.messages.RejectReason` (what it means for a learner is the learner
  core's decision, ``core/learner_side/learner_core.py``, a refused secret included);
- :class:`AuthenticationError`, a :class:`CallRefused` (``unauthenticated``) that command-line
  callers print as one line;
- :class:`Unreachable`: no answer (down, restarting, network) — retry later.

How a failed call reads (its reason, a refused credential) is :mod:`ddiloco.runtime.call_errors`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc

from ddiloco import __version__
from ddiloco.core.learner_side.shard_link import BACKOFF_MAX_S, BACKOFF_START_S
from ddiloco.core.shared.deadlines import CLIENT_ANSWER_S, CLIENT_FETCH_S, CLIENT_UPLOAD_LINK, call_deadline_s
from ddiloco.core.shared.errors import ConfigError, DdilocoError
from ddiloco.core.shared.messages import (
    Contribution,
    FragmentUpdate,
    GlobalState,
    Heartbeat,
    Join,
    Leave,
    RejectReason,
    Session,
    StopNotice,
)
from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.runtime import wire
from ddiloco.runtime.auth import PROTOCOL_VERSION, Address, channel_credentials, client_metadata
from ddiloco.runtime.call_errors import Unreachable, credentials_refused, refusal_reason, unreachable
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.proto import ddiloco_pb2_grpc as pb_grpc
from ddiloco.runtime.status.wire_form import status_to_dict
from ddiloco.runtime.wire import KEEPALIVE_OPTIONS, MAX_MESSAGE_BYTES
from ddiloco.settings.config_sources import unknown_keys

log = logging.getLogger("ddiloco.learner")

CHANNEL_OPTIONS = KEEPALIVE_OPTIONS + [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC reconnects a channel on the core's own backoff, so a learner calls back no faster
    # (and gives up waiting no sooner) than its core's retries.
    ("grpc.initial_reconnect_backoff_ms", round(1000 * BACKOFF_START_S)),
    ("grpc.min_reconnect_backoff_ms", round(1000 * BACKOFF_START_S)),
    ("grpc.max_reconnect_backoff_ms", round(1000 * BACKOFF_MAX_S)),
    # A connection of its own: from the process-wide pool, a channel made to replace one whose
    # connection stopped carrying bytes would get that same connection back (``SyncClient.heartbeat``).
    ("grpc.use_local_subchannel_pool", 1),
]


class CallRefused(Exception):
    """The synchronizer rejected the message, for ``reason``."""

    def __init__(self, reason: RejectReason, detail: str, code: grpc.StatusCode) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.code = code


class AuthenticationError(CallRefused, DdilocoError):
    """Refused as ``unauthenticated``: a wrong token or secret; retrying cannot help."""


@dataclass(frozen=True, slots=True)
class JoinResult:
    """What a (re)joining learner receives: the run's layout and the full global state."""

    header: pb.JoinHeader
    state: GlobalState

    @property
    def protocol(self) -> dict[str, Any]:
        """The run's ProtocolConfig fields as the synchronizer sent them (version skew: ConfigError)."""
        fields = json.loads(self.header.protocol_json)
        _refuse_version_skew(ProtocolConfig.unknown_keys(fields), "protocol")
        return fields

    @property
    def run_config(self) -> dict[str, Any]:
        """The synchronizer's whole configuration, by section (version skew: ConfigError)."""
        sections = json.loads(self.header.run_json)
        _refuse_version_skew(unknown_keys(sections), "configuration")
        return sections


def _refuse_version_skew(unknown: list[str], what: str) -> None:
    """Settings this learner does not know mean a newer synchronizer (the wire protocol matched, or
    the join would have been refused): one line saying so, not a TypeError from a constructor."""
    if unknown:
        raise ConfigError(
            f"version skew: the synchronizer runs a newer ddiloco than this learner's {__version__} (both speak "
            f"wire protocol {PROTOCOL_VERSION}); its {what} has settings this learner does not know: "
            f"{', '.join(unknown)}. Run the same ddiloco version on the synchronizer and the learners")


def _translate(err: grpc.RpcError, address: str) -> Exception:
    if line := credentials_refused(address, err):
        return AuthenticationError(RejectReason.UNAUTHENTICATED, line, err.code())
    text = refusal_reason(err)
    if text is None:
        return unreachable(address, err)
    return CallRefused(RejectReason.parse(text), err.details() or text, err.code())


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """What makes a :class:`SyncClient`: another process (a learner's link helper) makes its own from it."""

    address: str
    token: str | None = None
    tls_ca: str | None = None
    learner_id: str | None = None

    def connect(self) -> "SyncClient":
        return SyncClient(self.address, token=self.token, tls_ca=self.tls_ca, learner_id=self.learner_id)


class SyncClient:
    """One channel to a synchronizer; thread-safe (gRPC channels are). A channel whose connection
    stops carrying bytes is replaced by a new one (:meth:`heartbeat`)."""

    def __init__(self, address: Address | str, *, token: str | None = None, tls_ca: str | None = None,
                 learner_id: str | None = None, answer_s: float = CLIENT_ANSWER_S) -> None:
        """``token``: the shared token, or with ``learner_id`` that learner's own secret (per-learner credentials).
        ``answer_s``: how long a call that carries nothing waits for its answer."""
        self.address = str(address)
        self.spec = ClientSpec(self.address, token, tls_ca, learner_id)
        self.answer_s = answer_s
        self.metadata = client_metadata(token, learner_id)
        self.reconnects = 0
        """Channels replaced because their connection stopped carrying bytes."""
        self._credentials = channel_credentials(tls_ca)
        self._closed = False
        self._heard_at = time.monotonic()
        self._reconnecting = threading.Lock()
        self._open()

    def _open(self) -> None:
        if self._credentials is None:
            self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(self.address, self._credentials, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SynchronizerStub(self.channel)

    def close(self) -> None:
        self._closed = True
        self.channel.close()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def heard(self) -> None:
        """Something came back on the channel: an answer, or a message of a stream."""
        self._heard_at = time.monotonic()

    def _reconnect(self, silent_s: float) -> None:
        """A new channel (a new connection); calls in flight on the old one end unreachable."""
        with self._reconnecting:
            if self._closed:
                return
            old = self.channel
            self._open()
            self.reconnects += 1
            old.close()
        log.warning("the synchronizer at %s sent nothing back for %.0f s, not even a heartbeat's answer: "
                    "its connection is replaced by a new one", self.address, silent_s)

    def _gone(self, stub: Any) -> Unreachable | None:
        """What a call on ``stub`` that gRPC refused as made on a closed channel means: the learner
        closed meanwhile (a slow upload outlived close) or the channel was replaced (:meth:`heartbeat`),
        so the call is unreachable; None for any other cause (a bug, raised as it is)."""
        if self._closed or stub is not self.stub:
            return Unreachable(f"{self.address}: the channel is closed")
        return None

    @contextlib.contextmanager
    def _streamed(self, stub: Any) -> Iterator[None]:
        """A streamed reply read on ``stub``: gRPC's refusals translated, a reply that does not
        assemble unreachable, a channel closed meanwhile as :meth:`_gone` says."""
        try:
            yield
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None
        except wire.WireError as err:
            raise Unreachable(f"{self.address}: {err}") from None
        except ValueError:
            if (gone := self._gone(stub)) is None:
                raise
            raise gone from None

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        stub = self.stub
        try:
            reply = getattr(stub, method)(request, timeout=timeout_s or self.answer_s, metadata=self.metadata)
        except grpc.RpcError as err:
            translated = _translate(err, self.address)
            if isinstance(translated, CallRefused):
                self.heard()
            raise translated from None
        except ValueError:
            if (gone := self._gone(stub)) is None:
                raise
            raise gone from None
        self.heard()
        return reply

    # ---- calls -----------------------------------------------------------------------------

    def join(self, join: Join, timeout_s: float = CLIENT_ANSWER_S, *, probe: bool = False,
             part: tuple[int, int] | None = None) -> JoinResult:
        """Register and download the full global state (``probe``: only the header, no registration;
        ``part``: (rank, world) of a sharded learner's rank 0, the state cut to that rank's slices).

        ``timeout_s``: a learner gives its join the deadline of the state it brings back
        (``core/shared/deadlines.py``, ``client_join_link``); the default is a call that carries nothing."""
        header: pb.JoinHeader | None = None
        assembler: wire.StateAssembler | None = None
        request = wire.join_to_pb(join, probe=probe)
        if part is not None:
            request.part.CopyFrom(pb.RankSlice(rank=part[0], world=part[1]))
        stub = self.stub
        with self._streamed(stub):
            for reply in stub.Join(request, timeout=timeout_s, metadata=self.metadata):
                if reply.HasField("header"):
                    header = reply.header
                    assembler = wire.StateAssembler()
                elif assembler is not None:
                    assembler.add(reply.chunk)
        self.heard()
        if header is None or assembler is None:
            raise Unreachable(f"{self.address}: join answered without a header")
        if probe:
            return JoinResult(header, GlobalState((), incarnation=header.incarnation))
        try:
            state = assembler.state(incarnation=header.incarnation, session=wire.session_from_pb(header.session),
                                    data_position=header.data_position)
        except wire.WireError as err:
            raise Unreachable(f"{self.address}: {err}") from None
        return JoinResult(header, state)

    def probe(self, learner_id: str) -> JoinResult:
        """The run's layout and configuration, without registering (a learner that is still loading)."""
        return self.join(Join(learner_id, "probe"), probe=True)

    def heartbeat(self, beat: Heartbeat) -> pb.HeartbeatReply:
        """Renew the lease. A heartbeat carries nothing, so one left unanswered for its whole
        deadline while nothing else came back on the channel either (no answer, no update) means
        the connection under the channel stopped carrying bytes. A TCP connection can starve so
        behind others on a saturated link after an outage, its retransmissions backing off for
        tens of seconds, and gRPC keeps it; a new connection starts afresh. The calls in flight
        on the old one end unreachable (an upload is folded into the next one, as any undelivered
        one) and the update stream is made again on the new channel."""
        sent = time.monotonic()
        try:
            return self._call("Heartbeat", wire.heartbeat_to_pb(beat))
        except Unreachable as err:
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and self._heard_at < sent:
                self._reconnect(time.monotonic() - self._heard_at)
            raise

    def contribute(self, c: Contribution) -> pb.ContributeReply:
        """Upload one contribution in chunks."""
        timeout = call_deadline_s(len(c.payload), CLIENT_UPLOAD_LINK)
        return self._call("Contribute", iter(wire.contribution_chunks(c)), timeout)

    def contribute_chunks(self, chunks: list[pb.ContributionChunk]) -> pb.ContributeReply:
        """Upload hand-made chunks (tests of the boundary checks)."""
        return self._call("Contribute", iter(chunks))

    def updates(self, learner_id: str, have_versions: list[int], session: Session,
                part: tuple[int, int] | None = None) -> "UpdateStream":
        """The learner's update stream (``part``: one rank's, each update's payload cut to its slices)."""
        request = pb.UpdatesRequest(learner_id=learner_id, have_versions=have_versions,
                                    session=wire.session_to_pb(session))
        if part is not None:
            request.part.CopyFrom(pb.RankSlice(rank=part[0], world=part[1]))
        stub = self.stub
        try:
            call = stub.Updates(request, metadata=self.metadata)
        except ValueError:
            if (gone := self._gone(stub)) is None:
                raise
            raise gone from None
        return UpdateStream(call, self.address, self.heard)

    def fetch_state(self, timeout_s: float = CLIENT_FETCH_S, *, learner_id: str = "", session: Session | None = None,
                    part: tuple[int, int] | None = None, wait_for_ready: bool = False) -> GlobalState:
        """The global state; with ``part`` (and the learner's live ``session``), one rank's slices of it.
        ``wait_for_ready``: a failed connection attempt is tried again within ``timeout_s`` (for a caller
        that knows the synchronizer runs: on a saturated capped link a handshake's packets can be dropped
        for longer than one attempt's 20 s)."""
        request = pb.FetchStateRequest(learner_id=learner_id)
        if part is not None:
            assert session is not None
            request.session.CopyFrom(wire.session_to_pb(session))
            request.part.CopyFrom(pb.RankSlice(rank=part[0], world=part[1]))
        assembler = wire.StateAssembler()
        stub = self.stub
        with self._streamed(stub):
            for chunk in stub.FetchState(request, timeout=timeout_s, metadata=self.metadata,
                                         wait_for_ready=wait_for_ready):
                assembler.add(chunk)
            state = assembler.state()
        self.heard()
        return state

    def leave(self, leave: Leave) -> pb.LeaveReply:
        return self._call("Leave", wire.leave_to_pb(leave))

    def status(self, timeout_s: float = CLIENT_ANSWER_S, *, learner_offset: int = 0,
               learner_limit: int = 0) -> pb.StatusReply:
        """The synchronizer's status, with one page of its learners (in id order)."""
        request = pb.StatusRequest(learner_offset=learner_offset, learner_limit=learner_limit)
        return self._call("Status", request, timeout_s)

    def status_dict(self, timeout_s: float = CLIENT_ANSWER_S, *, learner_offset: int = 0,
                    learner_limit: int = 0) -> dict[str, Any]:
        return status_to_dict(self.status(timeout_s, learner_offset=learner_offset, learner_limit=learner_limit))


class UpdateStream:
    """Iterates over complete :class:`FragmentUpdate` values and :class:`StopNotice` (the budget is spent)."""

    def __init__(self, call: Any, address: str, heard: Callable[[], None]) -> None:
        self._call = call
        self._address = address
        self._heard = heard

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[FragmentUpdate | StopNotice]:
        assembler = wire.UpdateAssembler()
        try:
            for msg in self._call:
                self._heard()
                if msg.stop:
                    yield StopNotice()
                    continue
                update = assembler.add(msg)
                if update is not None:
                    yield update
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return
            raise _translate(err, self._address) from None
