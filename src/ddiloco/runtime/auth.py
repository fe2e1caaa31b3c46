"""Addresses, the auth token, per-learner credentials and TLS of the gRPC runtime.

A synchronizer that listens beyond loopback must authenticate its callers: anyone who can
reach the port could otherwise push outer gradients into the global model. Two ways:

- a *shared token* (``--token-file``, else ``$DDILOCO_TOKEN``): every member holds it, so a
  member can speak for any learner id;
- *per-learner credentials* (``--credentials FILE`` of ``learner-id: secret`` lines): a
  learner sends its id (``ddiloco-learner`` metadata) and its own secret, and every request
  it makes must name that id, so no member can speak, leave or subscribe for another. With
  both, the shared token still admits operators (status, state fetches), never a learner's calls.

Secrets travel as ``authorization: Bearer <secret>`` and are compared in constant time. An
explicit flag always wins over the environment; the environment never overrides a flag.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from ddiloco.core.shared.errors import ConfigError

TOKEN_ENV = "DDILOCO_TOKEN"
SECRET_ENV = "DDILOCO_SECRET"
AUTH_HEADER = "authorization"
LEARNER_HEADER = "ddiloco-learner"
PROTOCOL_HEADER = "ddiloco-protocol"
REASON_HEADER = "ddiloco-reason"
PROTOCOL_VERSION = 2
"""Major version of the wire protocol (the ``ddiloco.v2`` package of the schema)."""


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


def is_loopback(address: str) -> bool:
    """Is ``HOST:PORT`` this host's loopback (127.0.0.0/8, ::1, localhost)? A name is not resolved."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def load_secret(secret_file: str | None) -> str | None:
    """A learner's own secret from ``secret_file``, else from $DDILOCO_SECRET, else None."""
    if secret_file:
        return _read_text(secret_file, "--secret-file")
    return os.environ.get(SECRET_ENV, "").strip() or None


def load_credentials(path: str | None) -> dict[str, str] | None:
    """``learner-id: secret`` lines (blank lines and ``#`` comments allowed); ConfigError naming the
    first problem: unreadable, a line without ``id: secret``, an implausible id, a repeated id."""
    if not path:
        return None
    from ddiloco.core.shared.messages import check_id

    credentials: dict[str, str] = {}
    for number, line in enumerate(_read_text(path, "--credentials").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        learner, sep, secret = (part.strip() for part in line.partition(":"))
        if not sep or not learner or not secret:
            raise ConfigError(f"--credentials {path!r} line {number}: expected 'learner-id: secret'")
        try:
            check_id(learner, "learner id")
        except ValueError as err:
            raise ConfigError(f"--credentials {path!r} line {number}: {err}") from None
        if learner in credentials:
            raise ConfigError(f"--credentials {path!r} line {number}: learner {learner!r} is listed twice")
        credentials[learner] = secret
    if not credentials:
        raise ConfigError(f"--credentials {path!r} lists no learner")
    return credentials


def _read_text(path: str, option: str) -> str:
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{option} {path!r}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    if not text:
        raise ConfigError(f"{option} {path!r} is empty")
    return text


def require_token_beyond_loopback(listen: Address, token: str | None, credentials: object = None) -> None:
    if token is None and credentials is None and not listen.is_loopback:
        raise ConfigError(
            f"--listen {listen} is reachable beyond this machine: give a shared token with "
            f"--token-file FILE (or ${TOKEN_ENV}) or per-learner --credentials FILE, or listen on 127.0.0.1"
        )


def client_metadata(token: str | None, learner_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """What a client sends with every call: the protocol version, its secret, and with
    per-learner credentials the learner it speaks as."""
    metadata = ((PROTOCOL_HEADER, str(PROTOCOL_VERSION)),)
    if token is not None:
        metadata += ((AUTH_HEADER, f"Bearer {token}"),)
    if learner_id is not None:
        metadata += ((LEARNER_HEADER, learner_id),)
    return metadata


def http_authorized(token: str | None, authorization: str, query_token: str = "") -> bool:
    """An HTTP request (status page, metrics) carries the token as ``Authorization: Bearer`` or ``?token=``."""
    if token is None:
        return True
    return _secret_matches(authorization, token) or hmac.compare_digest(query_token.encode(), token.encode())


def _header(metadata: Sequence[tuple[str, str | bytes]] | None, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def _secret_matches(given: str | None, secret: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), f"Bearer {secret}".encode())


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a call comes from: ``learner`` is the only id its requests may name (None: any, or
    an operator without a learner's credentials)."""

    learner: str | None = None
    operator: bool = False
    """Holds the shared token while per-learner credentials are in force: status and state, no learner calls."""


class Authenticator:
    """Checks every call against the shared token and/or the per-learner credentials."""

    def __init__(self, token: str | None = None, credentials: dict[str, str] | None = None) -> None:
        self.token = token
        self.credentials = credentials

    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Identity | None:
        """The caller's identity, or None when it is not authenticated."""
        given = _header(metadata, AUTH_HEADER)
        if self.credentials is None:
            return Identity() if self.token is None or _secret_matches(given, self.token) else None
        learner = _header(metadata, LEARNER_HEADER)
        if learner is not None:
            secret = self.credentials.get(learner)
            # Compare even for an unknown id, so the time taken does not tell which ids exist.
            return Identity(learner) if _secret_matches(given, secret or "\0") and secret is not None else None
        if self.token is not None and _secret_matches(given, self.token):
            return Identity(operator=True)
        return None


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
