"""The fault-injecting proxy against a local echo server: pass-through, latency, bandwidth, reset, partition.

Only lower bounds on time are asserted (the proxy cannot deliver before a delay or faster
than a cap, however loaded the machine), never upper ones.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from typing import Iterator

import pytest

from ddiloco.chaos.proxy import ProxyHost

DEADLINE_S = 30.0


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def host() -> Iterator[ProxyHost]:
    h = ProxyHost()
    try:
        yield h
    finally:
        h.close()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def echo(s: socket.socket, payload: bytes) -> bytes:
    s.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def assert_reset(port: int) -> None:
    """A new connection through ``port`` ends in a reset (at connect, send or receive), not an orderly close."""
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        with connect(port) as s:
            s.sendall(b"x")
            if not s.recv(1):
                raise AssertionError("orderly close, expected a reset")


def test_bytes_pass_through_unchanged(host, echo_port) -> None:
    port = host.add("learner-0", echo_port)
    payload = bytes(range(256)) * 1000
    with connect(port) as s:
        assert echo(s, payload) == payload
    assert host.call(lambda: host.proxies["learner-0"].bytes) == {"up": len(payload), "down": len(payload)}


def test_latency_delays_each_direction(host, echo_port) -> None:
    port = host.add("learner-0", echo_port)
    proxy = host.proxies["learner-0"]
    host.call(lambda: proxy.set_latency(0.3))
    with connect(port) as s:
        started = time.monotonic()
        assert echo(s, b"ping") == b"ping"
        assert time.monotonic() - started >= 0.6  # 0.3 s up and 0.3 s down
        host.call(lambda: proxy.set_latency(0.0))
        assert echo(s, b"pong") == b"pong"


def test_bandwidth_caps_the_rate(host, echo_port) -> None:
    port = host.add("learner-0", echo_port)
    proxy = host.proxies["learner-0"]
    host.call(lambda: proxy.set_bandwidth(10_000))
    payload = b"x" * 20_000
    with connect(port) as s:
        started = time.monotonic()
        assert echo(s, payload) == payload
        # 20 kB through a 10 kB/s bucket that starts empty (burst 1.5 kB): at least 1.85 s each way.
        assert time.monotonic() - started >= 1.85
        host.call(lambda: proxy.set_bandwidth(0.0))
        assert echo(s, payload) == payload


def test_reset_cuts_open_connections_and_new_ones_while_it_holds(host, echo_port) -> None:
    port = host.add("learner-0", echo_port)
    proxy = host.proxies["learner-0"]
    s = connect(port)
    assert echo(s, b"hello") == b"hello"
    host.call(lambda: proxy.reset(hold_s=60.0))
    with pytest.raises(ConnectionResetError):
        for _ in range(100):  # the RST may arrive after the first send
            s.sendall(b"x")
            if not s.recv(1):
                raise AssertionError("orderly close, expected a reset")
    s.close()
    assert_reset(port)
    host.call(lambda: proxy.reset(hold_s=0.0))
    with connect(port) as fresh:
        assert echo(fresh, b"back") == b"back"
    assert host.call(lambda: proxy.connections_reset) >= 2


def test_partition_holds_every_byte_until_it_heals(host, echo_port) -> None:
    port = host.add("learner-0", echo_port)
    proxy = host.proxies["learner-0"]
    with connect(port) as s:
        assert echo(s, b"before") == b"before"
        host.call(lambda: proxy.set_partitioned(True))
        s.sendall(b"during")
        s.settimeout(1.0)
        with pytest.raises(socket.timeout):
            s.recv(16)
        with connect(port) as newcomer:  # a new connection gets through no more than the old one
            newcomer.sendall(b"new")
            newcomer.settimeout(0.5)
            with pytest.raises(socket.timeout):
                newcomer.recv(16)
            host.call(lambda: proxy.set_partitioned(False))
            newcomer.settimeout(DEADLINE_S)
            assert newcomer.recv(16) == b"new"
        s.settimeout(DEADLINE_S)
        assert s.recv(16) == b"during"  # held, not dropped: the stream is intact


def test_a_proxy_in_front_of_nothing_refuses_with_a_reset(host) -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        dead = placeholder.getsockname()[1]
    assert_reset(host.add("learner-0", dead))


def test_close_stops_every_proxy_and_its_thread(echo_port) -> None:
    host = ProxyHost()
    port = host.add("learner-0", echo_port)
    s = connect(port)
    assert echo(s, b"a") == b"a"
    host.close()
    assert not host._thread.is_alive()  # noqa: SLF001 - the point of the test
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    s.close()
