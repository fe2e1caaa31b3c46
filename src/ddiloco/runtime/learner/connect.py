"""Reaching a run's synchronizer before a learner joins: the probe that waits for it, and the
clients of every shard, checked to be one run (what ``LearnerRuntime`` and ``ddiloco learner``
do before the learner core takes over)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ddiloco.core.learner_side.link_watch import OUTAGE_AFTER_S, OUTAGE_SUMMARY_S
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
    ``OUTAGE_AFTER_S`` and every ``OUTAGE_SUMMARY_S`` (a wrong port looks just like this, unless it
    answers HTTP: then the warning says which port it is). Whatever follows — the join, its retries
    and refusals — is the learner core's."""
    started = time.monotonic()
    deadline = None if not timeout_s else started + timeout_s
    delay, waiting, warned_at = BACKOFF_START_S, False, None
    limit = f", for {timeout_s:g} s in all (--join-timeout)" if timeout_s else ""
    while True:
        try:
            return client.probe(learner_id)
        except Unreachable as err:
            now = time.monotonic()
            if deadline is not None and now + delay > deadline:
                if line := wrong_port_line(parse_address(client.address, option="--connect"), "--connect"):
                    raise DdilocoError(f"{line}; gave up after {timeout_s:g} s (--join-timeout)") from None
                raise DdilocoError(f"no answer from the synchronizer at {client.address} in {timeout_s:g} s "
                                   f"(--join-timeout): {err}. Is it running, and is that its gRPC port?") from None
            if not waiting:  # a learner started before its synchronizer: one line, then a warning if it lasts
                log.info("waiting for the synchronizer at %s (%s)", client.address, err)
                waiting = True
            elif now - started >= OUTAGE_AFTER_S and (warned_at is None or now - warned_at >= OUTAGE_SUMMARY_S):
                if line := wrong_port_line(parse_address(client.address, option="--connect"), "--connect"):
                    log.warning("%s; still trying%s", line, limit)
                else:
                    log.warning("no answer from the synchronizer at %s for %.0f s (%s): is it running, and is that "
                                "its gRPC port (not its status page's or metrics port)? Still trying%s",
                                client.address, now - started, err, limit)
                warned_at = now
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
    """The clients in shard order, after checking that their synchronizers form one run."""
    shards = {probe.header.shards or 1 for probe in probes}
    first = probes[0].header
    for client, probe in zip(clients, probes):
        if probe.header.run_sha256 != first.run_sha256:
            raise ConfigError(f"the synchronizers at {clients[0].address} and {client.address} serve different runs "
                              "(another model or configuration): they are not shards of one synchronizer")
    if shards != {len(clients)}:
        raise ConfigError(f"the synchronizer at {clients[0].address} is one of {first.shards or 1} shard(s), but "
                          f"{len(clients)} address(es) were given: connect to every shard, each once")
    by_shard: dict[int, SyncClient] = {}
    for client, probe in zip(clients, probes):
        other = by_shard.setdefault(probe.header.shard, client)
        if other is not client:
            raise ConfigError(f"the synchronizers at {other.address} and {client.address} both serve shard "
                              f"{probe.header.shard}: they claim the same fragments")
    return [by_shard[i] for i in range(len(clients))]
