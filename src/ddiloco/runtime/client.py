"""A blocking client of the synchronizer service (learners, ``ddiloco status``, the launcher).

Every call has a deadline. Failures come back as three kinds of exception, because a
learner reacts to each differently:

- :class:`~ddiloco.runtime.auth.AuthenticationError`: the token was refused — permanent;
- :class:`Refused`: the synchronizer answered and rejected the message, with the reason
  code (``unknown_learner`` means: join again);
- :class:`Unreachable`: no answer (down, restarting, network) — retry later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import grpc
import numpy as np
import torch

from ddiloco.core.messages import Contribution, FragmentUpdate, FragmentValue, GlobalState
from ddiloco.runtime.auth import (
    REASON_HEADER,
    Address,
    AuthenticationError,
    channel_credentials,
    client_metadata,
)
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.proto import ddiloco_pb2_grpc as pb_grpc
from ddiloco.runtime.wire import CHUNK_BYTES, KEEPALIVE_OPTIONS, MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = KEEPALIVE_OPTIONS + [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
CALL_TIMEOUT_S = 10.0
UPLOAD_MIN_BYTES_PER_S = 1e6
"""Upload deadlines allow at least this throughput (plus CALL_TIMEOUT_S)."""


class Unreachable(Exception):
    """The synchronizer did not answer (down, restarting, deadline exceeded)."""


class Refused(Exception):
    """The synchronizer rejected the message; ``reason`` is the stable code."""

    def __init__(self, reason: str, detail: str, code: grpc.StatusCode) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.code = code


@dataclass(frozen=True, slots=True)
class JoinResult:
    """What a (re)joining learner receives: the run's layout and the full global state."""

    header: pb.JoinHeader
    state: GlobalState

    @property
    def protocol(self) -> dict[str, Any]:
        return json.loads(self.header.protocol_json)

    @property
    def run_config(self) -> dict[str, Any]:
        return json.loads(self.header.run_json)


def _translate(err: grpc.RpcError, address: str) -> Exception:
    code = err.code()
    reason = ""
    for key, value in err.trailing_metadata() or ():
        if key == REASON_HEADER:
            reason = value.decode() if isinstance(value, bytes) else value
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"the synchronizer at {address} refused our auth token "
                                   "(check --token-file / $DDILOCO_TOKEN on both sides)")
    if reason:
        return Refused(reason, err.details() or reason, code)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return Refused(code.name.lower(), err.details() or code.name, code)
    return Unreachable(f"{address}: {code.name}: {err.details()}")


class SyncClient:
    """One channel to a synchronizer; thread-safe (gRPC channels are)."""

    def __init__(self, address: Address | str, *, token: str | None = None, tls_ca: str | None = None) -> None:
        self.address = str(address)
        credentials = channel_credentials(tls_ca)
        if credentials is None:
            self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SynchronizerStub(self.channel)
        self.metadata = client_metadata(token)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        try:
            return method(request, timeout=timeout_s, metadata=self.metadata)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None

    # ---- calls -----------------------------------------------------------------------------

    def join(self, learner_id: str, timeout_s: float = 300.0, *, probe: bool = False) -> JoinResult:
        """Register and download the full global state (``probe``: only the header, no registration)."""
        request = pb.JoinRequest(learner_id=learner_id, probe=probe)
        header: pb.JoinHeader | None = None
        try:
            replies = self.stub.Join(request, timeout=timeout_s, metadata=self.metadata)
            assembler = _StateAssembler()
            for reply in replies:
                if reply.HasField("header"):
                    header = reply.header
                    assembler.expect(len(header.fragments))
                else:
                    assembler.add(reply.chunk)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None
        if header is None:
            raise Unreachable(f"{self.address}: join answered without a header")
        if header.finished or probe:
            return JoinResult(header, GlobalState(()))
        return JoinResult(header, assembler.state())

    def heartbeat(self, learner_id: str, *, tokens: int, steps: int, instance_id: str) -> pb.HeartbeatReply:
        request = pb.HeartbeatRequest(learner_id=learner_id, tokens=tokens, steps=steps, instance_id=instance_id)
        return self._call(self.stub.Heartbeat, request)

    def contribute(self, c: Contribution, *, instance_id: str = "", trained_tokens: int = 0,
                   trained_steps: int = 0) -> pb.ContributeReply:
        """Upload one contribution in chunks (optionally reporting training progress with it)."""
        header = pb.ContributionHeader(
            learner_id=c.learner_id, fragment=c.fragment, base_version=c.base_version, seq=c.seq,
            tokens=c.tokens, steps=c.steps, compute_s=c.compute_s, step_time_s=c.step_time_s,
            codec=c.codec, payload_bytes=len(c.payload), first_step=c.first_step, instance_id=instance_id,
            trained_tokens=trained_tokens, trained_steps=trained_steps,
        )
        timeout = CALL_TIMEOUT_S + len(c.payload) / UPLOAD_MIN_BYTES_PER_S
        return self._call(self.stub.Contribute, iter(contribution_chunks(header, c.payload)), timeout)

    def contribute_chunks(self, chunks: list[pb.ContributionChunk]) -> pb.ContributeReply:
        """Upload hand-made chunks (tests of the boundary checks)."""
        return self._call(self.stub.Contribute, iter(chunks))

    def updates(self, learner_id: str, have_versions: list[int], instance_id: str) -> "UpdateStream":
        request = pb.UpdatesRequest(learner_id=learner_id, have_versions=have_versions, instance_id=instance_id)
        return UpdateStream(self.stub.Updates(request, metadata=self.metadata), self.address)

    def fetch_state(self, timeout_s: float = 300.0) -> GlobalState:
        assembler = _StateAssembler()
        try:
            for chunk in self.stub.FetchState(pb.FetchStateRequest(), timeout=timeout_s, metadata=self.metadata):
                assembler.add(chunk)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None
        return assembler.state()

    def leave(self, learner_id: str) -> None:
        self._call(self.stub.Leave, pb.LeaveRequest(learner_id=learner_id))

    def status(self, timeout_s: float = CALL_TIMEOUT_S) -> pb.StatusReply:
        return self._call(self.stub.Status, pb.StatusRequest(), timeout_s)

    def status_dict(self, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        return status_to_dict(self.status(timeout_s))


def contribution_chunks(header: pb.ContributionHeader, payload: bytes) -> Iterator[pb.ContributionChunk]:
    view = memoryview(payload)
    for offset in range(0, max(len(view), 1), CHUNK_BYTES):
        chunk = pb.ContributionChunk(offset=offset, data=bytes(view[offset : offset + CHUNK_BYTES]))
        if offset == 0:
            chunk.header.CopyFrom(header)
        yield chunk


class UpdateStream:
    """Iterates over complete :class:`FragmentUpdate` values (or ``None`` for "stop")."""

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self._address = address

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[FragmentUpdate | None]:
        parts: list[bytes] = []
        current: tuple[int, int] | None = None
        try:
            for msg in self._call:
                if msg.stop:
                    yield None
                    continue
                if msg.offset == 0:
                    parts, current = [], (msg.fragment, msg.version)
                elif current != (msg.fragment, msg.version) or msg.offset != sum(map(len, parts)):
                    parts, current = [], None  # a broken sequence: drop it (the learner will see a gap)
                    continue
                parts.append(msg.data)
                if sum(map(len, parts)) == msg.total_bytes:
                    yield FragmentUpdate(msg.fragment, msg.version, msg.codec, b"".join(parts))
                    parts, current = [], None
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return
            raise _translate(err, self._address) from None


class _StateAssembler:
    """Rebuilds fp32 fragment values from StateChunks (each fragment's chunks in order)."""

    def __init__(self) -> None:
        self._parts: dict[int, list[bytes]] = {}
        self._meta: dict[int, tuple[int, int]] = {}
        self._expected: int | None = None

    def expect(self, fragments: int) -> None:
        self._expected = fragments

    def add(self, chunk: pb.StateChunk) -> None:
        parts = self._parts.setdefault(chunk.fragment, [])
        if chunk.offset != sum(map(len, parts)):
            raise Unreachable(f"state chunk of fragment {chunk.fragment} out of order")
        parts.append(chunk.data)
        self._meta[chunk.fragment] = (chunk.version, chunk.total_bytes)

    def state(self) -> GlobalState:
        values = []
        for p in sorted(self._parts):
            version, total = self._meta[p]
            data = b"".join(self._parts[p])
            if len(data) != total:
                raise Unreachable(f"state of fragment {p} incomplete ({len(data)} of {total} bytes)")
            tensor = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32, copy=True))
            values.append(FragmentValue(p, version, tensor))
        if self._expected is not None and len(values) != self._expected:
            raise Unreachable(f"state has {len(values)} fragments, expected {self._expected}")
        if [v.fragment for v in values] != list(range(len(values))):
            raise Unreachable("state is missing fragments")
        return GlobalState(tuple(values))


def status_to_dict(reply: pb.StatusReply) -> dict[str, Any]:
    """The JSON of ``ddiloco status --json``."""
    return {
        "instance_id": reply.instance_id,
        "protocol_version": reply.protocol_version,
        "mode": reply.mode,
        "uptime": round(reply.uptime_s, 3),
        "finished": reply.finished,
        "tokens": reply.tokens,
        "token_budget": reply.token_budget,
        "learners": [
            {
                "id": lr.id,
                "alive": lr.alive,
                "last_seen_s_ago": round(lr.last_seen_s_ago, 3),
                "accepted": lr.accepted,
                "rejected": lr.rejected,
                "registrations": lr.registrations,
                "tokens": lr.tokens,
                "step_time_s": round(lr.step_time_s, 6),
                "bytes_up": lr.bytes_up,
                "bytes_down": lr.bytes_down,
            }
            for lr in reply.learners
        ],
        "fragments": [
            {"id": f.id, "version": f.version, "numel": f.numel, "bytes_up": f.bytes_up, "bytes_down": f.bytes_down}
            for f in reply.fragments
        ],
        "quorum": {"required": reply.quorum, "effective": reply.effective_quorum,
                   "rounds_closed": {e.key: e.count for e in reply.rounds_closed}},
        "grace": {"window_s": round(reply.grace_window_s, 6), "quorum_s": round(reply.grace_quorum_s, 6),
                  "sync_s": round(reply.grace_sync_s, 6)},
        "rejections": {e.key: e.count for e in reply.rejections},
        "bytes_up": reply.bytes_up,
        "bytes_down": reply.bytes_down,
        "longest_pause_s": round(reply.longest_pause_s, 3),
        "goodput": round(reply.goodput, 6),
        "model_uptime": round(reply.model_uptime, 6),
        "checkpoints": reply.checkpoints,
        "last_checkpoint_s_ago": round(reply.last_checkpoint_s_ago, 3),
    }
