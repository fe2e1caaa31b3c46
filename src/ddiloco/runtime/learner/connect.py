"""Reaching a run's synchronizer before a learner joins: the probe that waits for it, and the
clients of every shard, checked to be one run (what ``LearnerRuntime`` and ``ddiloco learner``
do before the learner core takes over). The decisions — wait, say so, warn, give up; one run or
not — are the core's (``core/learner_side/first_contact.py``); this makes the calls and says the lines."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ddiloco.core.learner_side.first_contact import ProbeMove, ProbeWait, ShardHeader, shard_order
from ddiloco.core.learner_side.shard_link import BACKOFF_START_S
from ddiloco.core.shared.errors import ConfigError, DdilocoError
from ddiloco.runtime.auth import is_loopback, parse_address
from ddiloco.runtime.client import JoinResult, SyncClient, Unreachable
from ddiloco.runtime.http_probe import wrong_port_line
from ddiloco.runtime.learner.repeats import next_delay

log = logging.getLogger("ddiloco.learner")


def on_loopback(clients: Sequence[SyncClient]) -> bool:
    """Is every shard of the synchronizer on this host? Then a learner whose sends fall behind is told
    its CPU is short, never its link (``core/learner_side/link_watch.py``)."""
    return all(is_loopback(client.address) for client in clients)


def probe_with_backoff(client: SyncClient, learner_id: str, *, timeout_s: float | None = None) -> JoinResult:
    """The run's layout and configuration (a join that registers nothing), waiting while the
    synchronizer is unreachable (for ever unless ``timeout_s``; 0 or None: no limit): a learner
    that starts before its synchronizer waits for it, saying so once, then warning after
    ``OUTAGE_AFTER_S`` and every ``OUTAGE_SUMMARY_S``, as the core's ``ProbeWait`` decides
    (``core/learner_side/first_contact.py``; a wrong port looks just like this, unless it answers
    HTTP: then the warning says which port it is)."""
    wait = ProbeWait(time.monotonic(), timeout_s)
    delay = BACKOFF_START_S
    limit = f", for {timeout_s:g} s in all (--join-timeout)" if timeout_s else ""
    while True:
        try:
            return client.probe(learner_id)
        except Unreachable as err:
            now = time.monotonic()
            move = wait.unanswered(now, delay)
            wrong_port = None if move in (ProbeMove.SAY_WAITING, ProbeMove.WAIT) else wrong_port_line(
                parse_address(client.address, option="--connect"), "--connect")
            if move is ProbeMove.GIVE_UP:
                if wrong_port:
                    raise DdilocoError(f"{wrong_port}; gave up after {timeout_s:g} s (--join-timeout)") from None
                raise DdilocoError(f"no answer from the synchronizer at {client.address} in {timeout_s:g} s "
                                   f"(--join-timeout): {err}. Is it running, and is that its gRPC port?") from None
            if move is ProbeMove.SAY_WAITING:  # a learner started before its synchronizer: one line
                log.info("waiting for the synchronizer at %s (%s)", client.address, err)
            elif move is ProbeMove.WARN:
                if wrong_port:
                    log.warning("%s; still trying%s", wrong_port, limit)
                else:
                    log.warning("no answer from the synchronizer at %s for %.0f s (%s): is it running, and is that "
                                "its gRPC port (not its status page's or metrics port)? Still trying%s",
                                client.address, now - wait.started_s, err, limit)
            time.sleep(delay)
            delay = next_delay(delay)


def connect_all(connect: str | SyncClient | Sequence[str | SyncClient], *, token: str | None = None,
                tls_ca: str | None = None, learner_id: str | None = None) -> list[SyncClient]:
    """Clients for one address, ``"A,B,..."`` (a synchronizer sharded by fragment), or a list."""
    items: Sequence[str | SyncClient]
    if isinstance(connect, SyncClient):
        items = [connect]
    elif isinstance(connect, str):
        items = [a.strip() for a in connect.split(",") if a.strip()]
    else:
        items = list(connect)
    if not items:
        raise ConfigError("no synchronizer address given")
    return [c if isinstance(c, SyncClient) else SyncClient(c, token=token, tls_ca=tls_ca, learner_id=learner_id)
            for c in items]


def one_run(clients: list[SyncClient], probes: list[JoinResult]) -> list[SyncClient]:
    """The clients in shard order, once the core found their synchronizers to be one run."""
    headers = [ShardHeader(c.address, p.header.run_sha256, p.header.shards or 1, p.header.shard)
               for c, p in zip(clients, probes)]
    return [clients[i] for i in shard_order(headers)]
