"""Whether an address that gRPC cannot talk to answers plain HTTP, and as which port.

``ddiloco sync`` serves gRPC on ``--listen`` and may serve its status page (``--http-port``)
and Prometheus metrics (``--metrics-port``) on plain HTTP. A gRPC client pointed at one of the
HTTP ports only learns "Failed parsing HTTP/2 (Expected SETTINGS frame ...)"; one HTTP/1.0
request tells the operator which port they reached instead.
"""

from __future__ import annotations

import enum
import socket

from ddiloco.runtime.auth import Address

PROBE_TIMEOUT_S = 1.0
READ_LIMIT_BYTES = 64 * 1024
"""Enough of a reply to see the head and the first metric names."""


class HttpPort(enum.Enum):
    """What answered HTTP at an address."""

    STATUS_PAGE = "the status page (ddiloco sync --http-port)"
    METRICS = "the metrics port (ddiloco sync --metrics-port)"
    OTHER = "an HTTP server, not a synchronizer"

    def __str__(self) -> str:
        return self.value


def http_port_at(address: Address, timeout_s: float = PROBE_TIMEOUT_S) -> HttpPort | None:
    """What answers ``GET /`` over HTTP/1.0 at ``address``; None when nothing answers HTTP there."""
    reply = b""
    try:
        with socket.create_connection((address.host, address.port), timeout=timeout_s) as conn:
            conn.sendall(f"GET / HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
            while len(reply) < READ_LIMIT_BYTES:
                chunk = conn.recv(READ_LIMIT_BYTES - len(reply))
                if not chunk:
                    break
                reply += chunk
    except OSError:  # refused, reset, timed out: judge by what came, if anything did
        pass
    if not reply.startswith(b"HTTP/"):
        return None
    head, _, body = reply.partition(b"\r\n\r\n")
    if b"\nserver: ddiloco-status" in head.lower():
        return HttpPort.STATUS_PAGE
    if b"# HELP ddiloco_" in body:
        return HttpPort.METRICS
    return HttpPort.OTHER


def wrong_port_line(address: Address, who: str) -> str | None:
    """One line for an operator when ``address`` answers HTTP (``who`` should use the gRPC port); else None."""
    port = http_port_at(address)
    if port is None:
        return None
    return (f"{address} answers HTTP, it is {port}; point {who} at the synchronizer's gRPC port "
            "(the one `ddiloco sync --listen` names)")
