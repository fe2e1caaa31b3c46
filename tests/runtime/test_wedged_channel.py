"""A connection that stops carrying bytes is replaced at the next unanswered heartbeat.

After an outage, a TCP connection on a saturated link can starve behind the others (its lone
retransmissions dropped, its backoff doubling), and gRPC keeps it: a learner's calls to one shard
then went unanswered for 18 s and its lease there ran out (the sharded chaos run in namespaces,
issue 44). Here a proxy holds the bytes of every connection open at one moment, both ways, and
lets later connections through, as such a starved connection does.
"""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from ddiloco.core.shared.messages import Heartbeat, Join, Progress
from ddiloco.runtime.call_errors import Unreachable
from ddiloco.runtime.client import SyncClient
from ddiloco.settings.config_sources import build_config

ANSWER_S = 1.0
"""The test client's wait for a heartbeat's answer (a learner's is ``CLIENT_ANSWER_S``)."""


class HoldingProxy:
    """Forwards every TCP connection to ``upstream_port``; :meth:`hold` keeps every connection
    open at that moment from carrying another byte either way (never closing it)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.gates: list[threading.Event] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        for gate in self.gates:
            gate.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            gate = threading.Event()
            gate.set()
            self.gates.append(gate)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, gate), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, gate: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                gate.wait()  # a held connection's bytes wait here for ever
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def through_proxy(inproc_sync):
    sync = inproc_sync(build_config(preset="tiny", overrides=("run.learners=1",)))
    proxy = HoldingProxy(sync.port)
    client = SyncClient(f"127.0.0.1:{proxy.port}", answer_s=ANSWER_S)
    try:
        yield proxy, client
    finally:
        client.close()
        proxy.close()


def test_a_heartbeat_unanswered_on_a_silent_connection_replaces_it_and_the_next_one_is_answered(through_proxy):
    proxy, client = through_proxy
    session = client.join(Join("learner-0", "boot")).state.session
    beat = Heartbeat("learner-0", session, Progress("boot"))
    client.heartbeat(beat)
    assert len(proxy.gates) == 1 and client.reconnects == 0

    proxy.hold()
    with pytest.raises(Unreachable) as info:
        client.heartbeat(beat)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.reconnects == 1

    assert client.heartbeat(beat) is not None  # over a new connection: the lease is renewed
    assert len(proxy.gates) == 2 and client.reconnects == 1


def test_a_heartbeat_unanswered_while_the_connection_still_brings_something_keeps_it(through_proxy):
    """Only silence replaces a connection: an answer or an update that came while the heartbeat
    waited shows the connection carries bytes (a slow link, not a dead one)."""
    proxy, client = through_proxy
    session = client.join(Join("learner-0", "boot")).state.session
    beat = Heartbeat("learner-0", session, Progress("boot"))
    proxy.hold()
    stop = threading.Event()

    def stream_brings_messages() -> None:
        while not stop.wait(ANSWER_S / 10):
            client.heard()

    feeder = threading.Thread(target=stream_brings_messages, daemon=True)
    feeder.start()
    try:
        with pytest.raises(Unreachable):
            client.heartbeat(beat)
    finally:
        stop.set()
        feeder.join()
    assert client.reconnects == 0 and len(proxy.gates) == 1
