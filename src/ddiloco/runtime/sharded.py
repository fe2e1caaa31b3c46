"""Watching a synchronizer sharded by fragment as one: merged status and global state.

``ddiloco status A,B`` and the process launcher read every shard and put the run back
together: each fragment's value and version come from the shard that owns it; counts are
summed, the run is finished when every shard is.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ddiloco.core.messages import GlobalState
from ddiloco.runtime.client import SyncClient

_SUMMED = ("bytes_up", "bytes_down", "pending_tokens", "checkpoints", "checkpoint_failures", "progress_clipped",
           "weights_capped", "link_starved_episodes")


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

    def fetch_state(self) -> GlobalState:
        fragments = sorted((f for c in self.clients for f in c.fetch_state().fragments), key=lambda f: f.fragment)
        return GlobalState(tuple(fragments))

    def status_dict(self, timeout_s: float = 10.0, *, learner_offset: int = 0, learner_limit: int = 0) -> dict[str, Any]:
        shards = [c.status_dict(timeout_s, learner_offset=learner_offset, learner_limit=learner_limit)
                  for c in self.clients]
        return shards[0] if len(shards) == 1 else merge_statuses(shards)


def merge_statuses(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One status for the whole run, and each shard's under ``per_shard``."""
    first = shards[0]
    merged = dict(first)
    merged["per_shard"] = shards
    merged["fragments"] = sorted((f for s in shards for f in s["fragments"]), key=lambda f: f["id"])
    merged["finished"] = all(s["finished"] for s in shards)
    merged["phase"] = first["phase"] if len({s["phase"] for s in shards}) == 1 else "mixed"
    merged["instance_id"] = ",".join(s["instance_id"] for s in shards)
    for key in _SUMMED:
        merged[key] = sum(s[key] for s in shards)
    merged["tokens"] = min(s["tokens"] for s in shards)  # every shard counts the same reports; the slowest to hear
    merged["tokens_left"] = max(s["tokens_left"] for s in shards)
    merged["elapsed_s"] = min(s["elapsed_s"] for s in shards)  # each shard's clock starts at its first join
    merged["time_left_s"] = max(s["time_left_s"] for s in shards)
    merged["longest_pause_s"] = max(s["longest_pause_s"] for s in shards)
    merged["goodput"] = min(1.0, sum(s["goodput"] for s in shards))  # each shard credits its own fragments' share
    merged["model_uptime"] = max(s["model_uptime"] for s in shards)
    for key in ("rejections", "claims_clipped"):
        merged[key] = dict(sum((Counter(s[key]) for s in shards), Counter()))
    rounds = sum((Counter(s["quorum"]["rounds_closed"]) for s in shards), Counter())
    merged["quorum"] = {**first["quorum"], "rounds_closed": dict(rounds)}
    learners: dict[str, dict[str, Any]] = {}
    for s in shards:
        for lr in s["learners"]:
            seen = learners.setdefault(lr["id"], {**lr, "alive": True, "accepted": 0, "rejected": 0,
                                                  "bytes_up": 0, "bytes_down": 0, "accepted_per_min": 0,
                                                  "link_starved": False, "joining": False})
            seen["alive"] = seen["alive"] and lr["alive"]  # alive in the run: at every shard
            for key in ("accepted", "rejected", "bytes_up", "bytes_down", "accepted_per_min"):
                seen[key] += lr[key]
            for key in ("link_starved", "joining"):  # at any shard
                seen[key] = seen[key] or lr[key]
            seen["data_position"] = min(seen["data_position"], lr["data_position"])  # reached every shard's fragments
    merged["learners"] = [learners[name] for name in sorted(learners)]
    return merged
