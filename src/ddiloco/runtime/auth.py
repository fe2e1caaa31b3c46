"""Addresses, the shared auth token and TLS credentials of the gRPC runtime.

A synchronizer that listens beyond loopback must have a token: anyone who can reach the
port could otherwise push outer gradients into the global model. The token travels as
``authorization: Bearer <token>`` metadata and is compared in constant time. It comes from
``--token-file FILE`` or, when no file is given, from the ``DDILOCO_TOKEN`` environment
variable (an explicit flag always wins; the variable never overrides it).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from ddiloco.errors import ConfigError, DdilocoError

TOKEN_ENV = "DDILOCO_TOKEN"
AUTH_HEADER = "authorization"
PROTOCOL_HEADER = "ddiloco-protocol"
REASON_HEADER = "ddiloco-reason"
PROTOCOL_VERSION = 2
"""Major version of the wire protocol (the ``ddiloco.v2`` package of the schema)."""


class AuthenticationError(DdilocoError):
    """The synchronizer refused our token: permanent, retrying cannot help."""


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything


def parse_address(text: str, *, option: str, allow_port_zero: bool = False) -> Address:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into an :class:`Address`; ConfigError otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{option} {text!r}: expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{option} {text!r}: port {port_text!r} is not a number") from None
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ConfigError(f"{option} {text!r}: port must be in 1..65535")
    return Address(host, port)


def load_token(token_file: str | None) -> str | None:
    """The shared token from ``token_file``, else from $DDILOCO_TOKEN, else None."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"--token-file {token_file!r}: cannot read ({err.strerror})") from None
        if not token:
            raise ConfigError(f"--token-file {token_file!r} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def require_token_beyond_loopback(listen: Address, token: str | None) -> None:
    if token is None and not listen.is_loopback:
        raise ConfigError(
            f"--listen {listen} is reachable beyond this machine: give a shared token with "
            f"--token-file FILE (or ${TOKEN_ENV}), or listen on 127.0.0.1"
        )


def client_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    metadata = ((PROTOCOL_HEADER, str(PROTOCOL_VERSION)),)
    if token is not None:
        metadata += ((AUTH_HEADER, f"Bearer {token}"),)
    return metadata


def token_matches(metadata: tuple[tuple[str, str | bytes], ...] | None, token: str | None) -> bool:
    """True when no token is required, or the call carries exactly ours."""
    if token is None:
        return True
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            given = value.decode() if isinstance(value, bytes) else value
            return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
    return False


def server_credentials(cert_file: str | None, key_file: str | None) -> grpc.ServerCredentials | None:
    """TLS for the service, when both a certificate chain and its private key are given."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials([(_read(key_file, "--tls-key"), _read(cert_file, "--tls-cert"))])


def channel_credentials(ca_file: str | None) -> grpc.ChannelCredentials | None:
    """TLS for a client, trusting the certificate authority in ``ca_file``."""
    if not ca_file:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file, "--tls-ca"))


def _read(path: str, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{option} {path!r}: cannot read ({err.strerror})") from None
