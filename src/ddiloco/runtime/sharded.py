"""Watching a synchronizer sharded by fragment as one: merged status and global state.

``ddiloco status A,B`` and the process launcher read every shard and put the run back
together: each fragment's value and version come from the shard that owns it; each status
field merges by the rule its core dataclass gives it (counts summed, the run finished when
every shard is, ...).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable

from ddiloco.core.shared.messages import GlobalState
from ddiloco.core.sync_side.status_snapshot import LearnerStatus, ShardMerge, SyncStatus, merge_rule
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.status.wire_form import NOT_ON_WIRE, presented, wire_name


class ShardedClient:
    """Clients of every shard of one run (one client for an unsharded synchronizer)."""

    def __init__(self, addresses: list[str], *, token: str | None = None, tls_ca: str | None = None,
                 clients: list[SyncClient] | None = None) -> None:
        self.clients = clients if clients is not None else [SyncClient(a, token=token, tls_ca=tls_ca) for a in addresses]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fetch_state(self, *, wait_for_ready: bool = False) -> GlobalState:
        fragments = sorted((f for c in self.clients for f in c.fetch_state(wait_for_ready=wait_for_ready).fragments),
                           key=lambda f: f.fragment)
        return GlobalState(tuple(fragments))

    def status_dict(self, timeout_s: float = 10.0, *, learner_offset: int = 0, learner_limit: int = 0) -> dict[str, Any]:
        shards = [c.status_dict(timeout_s, learner_offset=learner_offset, learner_limit=learner_limit)
                  for c in self.clients]
        return shards[0] if len(shards) == 1 else merge_statuses(shards)


def merge_statuses(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One status for the whole run, and each shard's under ``per_shard``: each core field merged
    by its :class:`~ddiloco.core.sync_side.status_snapshot.ShardMerge`, what the service measures by :data:`MEASURED`."""
    return {**_merge(shards, _STATUS_RULES), "per_shard": shards}


Rule = Callable[[list[Any]], Any]


def _sum(values: list[Any]) -> Any:
    """Numbers, or counts by key."""
    if values and isinstance(values[0], dict):
        return dict(sum((Counter(v) for v in values), Counter()))
    return sum(values)


def _by_learner(shards: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    entries: dict[str, list[dict[str, Any]]] = {}
    for learners in shards:
        for learner in learners:
            entries.setdefault(learner["id"], []).append(learner)
    return [_merge(entries[name], _LEARNER_RULES) for name in sorted(entries)]


_RULES: dict[ShardMerge, Rule] = {
    ShardMerge.FIRST: lambda values: values[0],
    ShardMerge.SUM: _sum,
    ShardMerge.MIN: min,
    ShardMerge.MAX: max,
    ShardMerge.ALL: all,
    ShardMerge.ANY: any,
    ShardMerge.AGREED: lambda values: values[0] if len(set(values)) == 1 else "mixed",
    ShardMerge.OWNED: lambda shards: sorted((f for fragments in shards for f in fragments), key=lambda f: f["id"]),
    ShardMerge.BY_LEARNER: _by_learner,
}
MEASURED: dict[str, Rule] = {
    "instance_id": ",".join,
    "finished": all,
    "bytes_up": _sum, "bytes_down": _sum, "checkpoints": _sum, "checkpoint_failures": _sum,
    "goodput": lambda values: min(1.0, sum(values)),  # each shard credits its own fragments' share
    "model_uptime": max,
}
"""How the shards' values merge for what the service measures (``runtime/sync/status_reply.py``)
and the dict adds, where not the first shard's."""
_LEARNER_MEASURED: dict[str, Rule] = {"bytes_up": _sum, "bytes_down": _sum}


def _rules(cls: type, measured: dict[str, Rule]) -> dict[str, Any]:
    """Dict key -> its rule (a dict of rules for a nested group), from ``cls``'s fields' ShardMerge."""
    rules = {wire_name(f.name): _RULES[merge_rule(f)] for f in dataclasses.fields(cls) if f.name not in NOT_ON_WIRE}
    return presented({**rules, **measured})


def _merge(dicts: list[dict[str, Any]], rules: dict[str, Any]) -> dict[str, Any]:
    """``dicts`` (one per shard, the first shard's first) as one, key by key in the first's order."""
    out = {}
    for key in dicts[0]:
        values = [d[key] for d in dicts if key in d]
        rule = rules.get(key, _RULES[ShardMerge.FIRST])
        out[key] = _merge(values, rule) if isinstance(rule, dict) else rule(values)
    return out


_STATUS_RULES = _rules(SyncStatus, MEASURED)
_LEARNER_RULES = _rules(LearnerStatus, _LEARNER_MEASURED)
