"""Where the children of a local run live: all on 127.0.0.1, or each in its own network namespace.

``--hosts local`` (the default) runs everything on loopback, as before. ``--hosts netns``
(:mod:`ddiloco.runtime.launch.netns`) gives the synchronizer and every learner a namespace and a
capped link; the synchronizer then listens beyond loopback, so the run gets a shared token
(``OUT/token``, mode 0600) that every child and the launcher present. The launcher itself
stays in its own namespace and reaches the others over the bridge.
"""

from __future__ import annotations

import enum
import os
import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ddiloco.runtime.launch.netns import INNER_IFNAME, SYNC_HOST, NetnsHosts
from ddiloco.runtime.launch.topology import Topology

SYNC_PORT = 7000
"""A namespace has its ports to itself: shard i of the synchronizer listens on SYNC_PORT + i."""
LOOPBACK = "127.0.0.1"


def sync_names(shards: int) -> list[str]:
    """The launcher's names of the synchronizer's processes (and their logs): ``sync``, or ``sync-I`` per shard."""
    return [SYNC_HOST] if shards == 1 else [f"{SYNC_HOST}-{i}" for i in range(shards)]


class Hosts(enum.StrEnum):
    """``--hosts``: where the processes of a local run live."""

    LOCAL = "local"
    NETNS = "netns"


@dataclass
class Placement:
    """The hosts of one run; ``net`` is None on loopback."""

    net: NetnsHosts | None
    token_file: Path | None

    @property
    def token(self) -> str | None:
        return self.token_file.read_text().strip() if self.token_file else None

    def prefix(self, host: str) -> list[str]:
        """What goes before a child's command line to run it on ``host``."""
        return self.net.prefix(host) if self.net else []

    def address(self, host: str) -> str:
        return self.net.address(host) if self.net else LOOPBACK

    def sync_listen(self, shard: int) -> tuple[str, int]:
        """(host, port) for shard ``shard`` of the synchronizer (port 0: any free one, on loopback)."""
        return (self.net.address(SYNC_HOST), SYNC_PORT + shard) if self.net else (LOOPBACK, 0)

    @property
    def ifname(self) -> str:
        """The interface a host's traffic to the others leaves by (gloo's GLOO_SOCKET_IFNAME)."""
        return INNER_IFNAME if self.net else "lo"

    @property
    def gateway(self) -> str:
        """The launcher's own address, as the hosts reach it."""
        return self.net.gateway if self.net else LOOPBACK

    def counters(self) -> dict[str, dict[str, int]]:
        return self.net.counters() if self.net else {}

    def describe(self) -> dict[str, object]:
        if self.net is None:
            return {"hosts": str(Hosts.LOCAL)}
        return {"hosts": str(Hosts.NETNS), "subnet": f"{self.net.subnet}.0/24", **self.net.topology.to_dict()}


@contextmanager
def placed(topology: Topology | None, hosts: list[str], out: Path) -> Iterator[Placement]:
    """The run's hosts for as long as the block runs: namespaces (when ``topology`` is given) are
    removed on the way out, whatever ends the block."""
    if topology is None:
        yield Placement(None, None)
        return
    token_file = out / "token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16) + "\n")
    net = NetnsHosts.create(topology, hosts)
    try:
        yield Placement(net, token_file)
    finally:
        net.remove()
